// AttentionConfig: validation, the seeds' variant constructor, and
// attention_config_from_json, one layer of the ModelSpec that
// model_spec_from_json reads (model_spec.cc; the per-family rules are there
// and in docs/MODELS.md).
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "io/model_spec_reader.h"

namespace attnkit {
namespace {

constexpr const char* kParse = "attention_config_from_json";
constexpr const char* kVariant = "attention_config_from_variant";
constexpr const char* kValidate = "AttentionConfig";

using io::kMaxDim;
using io::num;

const char* kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kAttention:
      return "softmax attention";
    case LayerKind::kLatentAttention:
      return "latent attention (MLA; read it with mla_config_from_json)";
    case LayerKind::kLinearAttention:
      return "linear attention (Gated DeltaNet)";
  }
  return "unknown";
}

}  // namespace

Status validate(const AttentionConfig& c) {
  const std::string fn = kValidate;
  const std::pair<const char*, int64_t> sizes[] = {{"hidden_size", c.hidden_size},
                                                   {"num_heads", c.num_heads},
                                                   {"num_kv_heads", c.num_kv_heads},
                                                   {"head_dim", c.head_dim}};
  for (const auto& [name, value] : sizes)
    if (value < 1 || value > kMaxDim)
      return invalid_argument(fn + ": " + name + " = " + std::to_string(value) +
                              " must be in [1, " + std::to_string(kMaxDim) + "]");
  if (c.num_heads % c.num_kv_heads != 0)
    return invalid_argument(fn + ": num_kv_heads = " + std::to_string(c.num_kv_heads) +
                            " must divide num_heads = " + std::to_string(c.num_heads));
  if (!std::isfinite(c.rms_norm_eps) || !(c.rms_norm_eps > 0.0))
    return invalid_argument(fn + ": rms_norm_eps = " + num(c.rms_norm_eps) +
                            " must be finite and > 0");
  if (c.sliding_window < 0)
    return invalid_argument(fn + ": sliding_window = " + std::to_string(c.sliding_window) +
                            " must be >= 0 (0 = none)");
  if (!std::isfinite(c.softcap) || c.softcap < 0.0f)
    return invalid_argument(fn + ": softcap = " + num(c.softcap) +
                            " must be finite and >= 0 (0 = off)");
  // sdpa rejects a subnormal cap (1 / cap is +inf in the fast kernels), so a
  // layer built with one could never run.
  if (c.softcap > 0.0f && c.softcap < std::numeric_limits<float>::min()) {
    char value[32];  // shortest round-trip form of the float: "1e-40"
    const auto end = std::to_chars(value, value + sizeof value, c.softcap).ptr;
    return invalid_argument(fn + ": softcap = " + std::string(value, end) +
                            " is subnormal; a nonzero softcap must be >= FLT_MIN = 1.1754944e-38");
  }
  if (!std::isfinite(c.softmax_scale) || c.softmax_scale < 0.0f)
    return invalid_argument(fn + ": softmax_scale = " + num(c.softmax_scale) +
                            " must be finite and >= 0 (0 = 1/sqrt(head_dim))");
  if (c.use_rope) {
    if (c.rope.head_dim != c.head_dim)
      return invalid_argument(fn + ": rope.head_dim = " + std::to_string(c.rope.head_dim) +
                              " must equal head_dim = " + std::to_string(c.head_dim));
    if (auto rope = Rope::create(c.rope); !rope.ok())
      return Status(rope.status().code(), fn + ": rope: " + rope.status().message());
  }
  return Status::Ok();
}

Result<AttentionConfig> attention_config_from_json(std::string_view json_text,
                                                   int64_t layer_index) {
  io::SpecRequest request;
  request.fn = kParse;
  request.ffn = false;
  request.softmax_only = true;
  request.layers_if_absent = std::max<int64_t>(layer_index, 0) + 1;
  request.layer_families_only = true;
  if (layer_index < 0) request.mixers = false;  // only the count is needed for the message
  ModelSpec spec;
  ATTNKIT_RETURN_IF_ERROR(io::read_model_spec(json_text, request, &spec));
  if (layer_index < 0 || layer_index >= spec.num_layers)
    return invalid_argument(
        std::string(kParse) + ": layer_index = " + std::to_string(layer_index) +
        " must be in [0, num_hidden_layers = " + std::to_string(spec.num_layers) + ")");
  const LayerSpec& layer = spec.layers[static_cast<size_t>(layer_index)];
  if (layer.kind != LayerKind::kAttention)
    return invalid_argument(std::string(kParse) + ": layer " + std::to_string(layer_index) +
                            " of model_type \"" + spec.model_type + "\" is " +
                            kind_name(layer.kind) + ", not softmax attention");
  return layer.attention;
}

Result<AttentionConfig> attention_config_from_variant(std::string_view variant, int64_t d_model,
                                                      int64_t num_heads, bool bias) {
  const std::string fn = kVariant;
  if (num_heads < 1 || num_heads > kMaxDim)
    return invalid_argument(fn + ": num_heads = " + std::to_string(num_heads) + " must be in [1, " +
                            std::to_string(kMaxDim) + "]");
  if (d_model < 1 || d_model > kMaxDim)
    return invalid_argument(fn + ": d_model = " + std::to_string(d_model) + " must be in [1, " +
                            std::to_string(kMaxDim) + "]");
  if (d_model % num_heads != 0)
    return invalid_argument(fn + ": d_model = " + std::to_string(d_model) +
                            " must be divisible by num_heads = " + std::to_string(num_heads));
  int64_t kv_heads = 0;
  constexpr std::string_view kGqa = "gqa-";
  if (variant == "mha") {
    kv_heads = num_heads;
  } else if (variant == "mqa") {
    kv_heads = 1;
  } else if (variant.starts_with(kGqa)) {
    const char* first = variant.data() + kGqa.size();
    const char* last = variant.data() + variant.size();
    const auto [end, ec] = std::from_chars(first, last, kv_heads);
    if (ec != std::errc() || end != last || kv_heads < 1 || kv_heads > num_heads ||
        num_heads % kv_heads != 0)
      return invalid_argument(fn + ": variant = \"" + std::string(variant) +
                              "\": N in gqa-N must be a whole number with 1 <= N <= num_heads = " +
                              std::to_string(num_heads) + " and num_heads % N == 0");
  } else {
    return invalid_argument(fn + ": variant = \"" + std::string(variant) +
                            "\" is not one of \"mha\", \"mqa\", \"gqa-N\" (N kv heads, e.g. "
                            "\"gqa-2\")");
  }
  AttentionConfig c;
  c.model_type = std::string(variant);
  c.hidden_size = d_model;
  c.num_heads = num_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = d_model / num_heads;
  c.qkv_bias = bias;
  c.o_bias = bias;
  c.use_rope = false;
  c.rope.head_dim = c.head_dim;
  c.causal = false;
  ATTNKIT_RETURN_IF_ERROR(validate(c));
  return c;
}

}  // namespace attnkit
