// MlaConfig: validation, the softmax scale, and mla_config_from_json, the
// MLA layer of the ModelSpec that model_spec_from_json reads (model_spec.cc).
#include <cmath>
#include <string>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "io/model_spec_reader.h"

namespace attnkit {
namespace {

constexpr const char* kParse = "mla_config_from_json";
constexpr const char* kValidate = "MlaConfig";

// HF's yarn_get_mscale: 0.1 * mscale * ln(factor) + 1, or 1 for factor <= 1.
double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

Status positive(const char* name, int64_t value, const char* why) {
  if (value >= 1) return Status::Ok();
  return invalid_argument(std::string(kValidate) + ": " + name + " = " + std::to_string(value) +
                          " must be >= 1" + why);
}

}  // namespace

const char* mla_form_name(MlaForm form) {
  switch (form) {
    case MlaForm::kAuto:
      return "auto";
    case MlaForm::kNaive:
      return "naive";
    case MlaForm::kAbsorbed:
      return "absorbed";
  }
  return "unknown";
}

Status validate(const MlaConfig& c) {
  ATTNKIT_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size, ""));
  ATTNKIT_RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads, ""));
  ATTNKIT_RETURN_IF_ERROR(positive("kv_lora_rank", c.kv_lora_rank,
                                   " (the latent every key and value is decompressed from)"));
  ATTNKIT_RETURN_IF_ERROR(positive("qk_nope_head_dim", c.qk_nope_head_dim, ""));
  ATTNKIT_RETURN_IF_ERROR(positive("v_head_dim", c.v_head_dim, ""));
  const std::string f = kValidate;
  if (c.q_lora_rank < 0)
    return invalid_argument(f + ": q_lora_rank = " + std::to_string(c.q_lora_rank) +
                            " must be >= 0 (0 = no query compression, q_proj)");
  if (c.qk_rope_head_dim < 2 || c.qk_rope_head_dim % 2 != 0)
    return invalid_argument(f + ": qk_rope_head_dim = " + std::to_string(c.qk_rope_head_dim) +
                            " must be even and >= 2 (RoPE rotates pairs of features)");
  // Every size product the layer forms must stay far from overflow.
  const int64_t kMaxDim = int64_t{1} << 20;
  const std::pair<const char*, int64_t> dims[] = {{"hidden_size", c.hidden_size},
                                                  {"num_attention_heads", c.num_attention_heads},
                                                  {"q_lora_rank", c.q_lora_rank},
                                                  {"kv_lora_rank", c.kv_lora_rank},
                                                  {"qk_nope_head_dim", c.qk_nope_head_dim},
                                                  {"qk_rope_head_dim", c.qk_rope_head_dim},
                                                  {"v_head_dim", c.v_head_dim}};
  for (const auto& [name, value] : dims)
    if (value > kMaxDim)
      return invalid_argument(f + ": " + name + " = " + std::to_string(value) +
                              " must be <= " + std::to_string(kMaxDim));
  if (!std::isfinite(c.rope_theta) || c.rope_theta <= 1.0)
    return invalid_argument(f + ": rope_theta = " + std::to_string(c.rope_theta) +
                            " must be finite and > 1");
  if (!std::isfinite(c.rms_norm_eps) || c.rms_norm_eps <= 0.0)
    return invalid_argument(f + ": rms_norm_eps = " + std::to_string(c.rms_norm_eps) +
                            " must be finite and > 0");
  if (c.max_position_embeddings < 0)
    return invalid_argument(f + ": max_position_embeddings = " +
                            std::to_string(c.max_position_embeddings) + " must be >= 0");
  if (c.index_n_heads < 0 || c.index_n_heads > kMaxDim)
    return invalid_argument(f + ": index_n_heads = " + std::to_string(c.index_n_heads) +
                            " must be in [0, " + std::to_string(kMaxDim) + "] (0 = dense MLA)");
  if (c.index_n_heads > 0) {
    if (c.q_lora_rank < 1)
      return invalid_argument(f + ": q_lora_rank = " + std::to_string(c.q_lora_rank) +
                              " must be >= 1 with sparse attention (index_n_heads = " +
                              std::to_string(c.index_n_heads) +
                              "): the indexer query is projected from MLA's compressed query");
    if (c.index_head_dim < 128 || c.index_head_dim % 128 != 0 || c.index_head_dim > kMaxDim ||
        (c.index_head_dim & (c.index_head_dim - 1)) != 0)
      return invalid_argument(f + ": index_head_dim = " + std::to_string(c.index_head_dim) +
                              " must be a multiple of 128 (the indexer's fp8 block: one scale "
                              "per 128 values) and a power of two (Sylvester's Hadamard), at "
                              "most " +
                              std::to_string(kMaxDim));
    if (c.index_head_dim < c.qk_rope_head_dim)
      return invalid_argument(
          f + ": index_head_dim = " + std::to_string(c.index_head_dim) +
          " must be >= qk_rope_head_dim = " + std::to_string(c.qk_rope_head_dim) +
          " (RoPE rotates the indexer's first qk_rope_head_dim features)");
    if (c.index_topk < 1)
      return invalid_argument(f + ": index_topk = " + std::to_string(c.index_topk) +
                              " must be >= 1 (the keys each query attends to)");
  }
  const RopeScaling& y = c.rope_scaling;
  if (y.type == RopeScaling::Type::kNone) return Status::Ok();
  if (y.type != RopeScaling::Type::kYarn)
    return invalid_argument(f + ": rope_scaling.type must be none or yarn for MLA");
  if (!std::isfinite(y.factor) || y.factor < 1.0)
    return invalid_argument(f + ": rope_scaling.factor = " + std::to_string(y.factor) +
                            " must be finite and >= 1");
  if (y.original_max_position_embeddings < 1)
    return invalid_argument(f + ": rope_scaling.original_max_position_embeddings = " +
                            std::to_string(y.original_max_position_embeddings) + " must be >= 1");
  if (!std::isfinite(y.beta_fast) || y.beta_fast <= 0.0)
    return invalid_argument(f + ": rope_scaling.beta_fast = " + std::to_string(y.beta_fast) +
                            " must be finite and > 0");
  if (!std::isfinite(y.beta_slow) || y.beta_slow <= 0.0)
    return invalid_argument(f + ": rope_scaling.beta_slow = " + std::to_string(y.beta_slow) +
                            " must be finite and > 0");
  if (!std::isfinite(y.mscale) || y.mscale < 0.0)
    return invalid_argument(f + ": rope_scaling.mscale = " + std::to_string(y.mscale) +
                            " must be finite and >= 0 (0 = absent)");
  if (!std::isfinite(y.mscale_all_dim) || y.mscale_all_dim < 0.0)
    return invalid_argument(f +
                            ": rope_scaling.mscale_all_dim = " + std::to_string(y.mscale_all_dim) +
                            " must be finite and >= 0 (0 = absent)");
  return Status::Ok();
}

double mla_softmax_scale(const MlaConfig& c) {
  double sigma = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()));
  // The whole YaRN attention correction lives here, on every logit (nope
  // and rope parts alike), as DeepSeek's code and HF's DeepseekV3Attention
  // do; putting it on cos/sin would scale only the rope part.
  if (c.rope_scaling.type == RopeScaling::Type::kYarn && c.rope_scaling.mscale_all_dim > 0.0) {
    const double m = yarn_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    sigma *= m * m;
  }
  return sigma;
}

Result<MlaConfig> mla_config_from_json(std::string_view json_text) {
  io::SpecRequest request;
  request.fn = kParse;
  request.ffn = false;
  request.layers_if_absent = 1;
  ModelSpec spec;
  ATTNKIT_RETURN_IF_ERROR(io::read_model_spec(json_text, request, &spec));
  for (const LayerSpec& layer : spec.layers)
    if (layer.kind == LayerKind::kLatentAttention) return layer.mla;
  return invalid_argument(std::string(kParse) + ": model_type = \"" + spec.model_type +
                          "\" has no MLA layer (an MLA config needs q_lora_rank, kv_lora_rank, "
                          "qk_nope_head_dim, qk_rope_head_dim, v_head_dim and a DeepSeek "
                          "model_type: deepseek_v2, deepseek_v3, deepseek_v32, kimi_k2)");
}

}  // namespace attnkit
