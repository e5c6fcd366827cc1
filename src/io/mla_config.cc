// MlaConfig: validation, the softmax scale, and parsing from a Hugging Face
// config.json (deepseek_v2, deepseek_v3, kimi_k2).
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "attnkit/latent_attention.h"

namespace attnkit {
namespace {

constexpr const char* kParse = "mla_config_from_json";
constexpr const char* kValidate = "MlaConfig";

using json = nlohmann::json;

std::string dump(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// HF's yarn_get_mscale: 0.1 * mscale * ln(factor) + 1, or 1 for factor <= 1.
double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

// Reads an integer field. `required`: absence is an error; `allow_null`:
// JSON null reads as 0 (q_lora_rank).
Status read_int(const json& obj, const char* name, bool required, bool allow_null,
                const std::string& where, int64_t* out) {
  const auto it = obj.find(name);
  if (it == obj.end()) {
    if (!required) return Status::Ok();
    return invalid_argument(std::string(kParse) + ": required field " + where + name +
                            " is missing (an MLA config needs hidden_size, "
                            "num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                            "qk_rope_head_dim, v_head_dim)");
  }
  if (it->is_null() && allow_null) {
    *out = 0;
    return Status::Ok();
  }
  if (!it->is_number_integer())
    return invalid_argument(std::string(kParse) + ": " + where + name + " = " + dump(*it) +
                            " must be an integer" + (allow_null ? " or null" : ""));
  *out = it->get<int64_t>();
  return Status::Ok();
}

Status read_double(const json& obj, const char* name, const std::string& where, double* out) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_number())
    return invalid_argument(std::string(kParse) + ": " + where + name + " = " + dump(*it) +
                            " must be a number");
  *out = it->get<double>();
  return Status::Ok();
}

// rope_scaling (or rope_parameters): null, {"type"|"rope_type": "default"}
// or a YaRN block.
Status read_rope_scaling(const json& rs, const char* field, MlaConfig* c) {
  if (rs.is_null()) return Status::Ok();
  if (!rs.is_object())
    return invalid_argument(std::string(kParse) + ": " + field + " = " + dump(rs) +
                            " must be an object or null");
  const std::string where = std::string(field) + ".";
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    const auto it = rs.find(key);
    if (it == rs.end() || it->is_null()) continue;
    if (!it->is_string())
      return invalid_argument(std::string(kParse) + ": " + where + key + " = " + dump(*it) +
                              " must be a string");
    type = it->get<std::string>();
    break;
  }
  // HF's newer rope_parameters carries rope_theta inside the block.
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "rope_theta", where, &c->rope_theta));
  if (type.empty() || type == "default") return Status::Ok();
  if (type != "yarn")
    return invalid_argument(std::string(kParse) + ": " + where + "type = \"" + type +
                            "\" is not supported for MLA (only \"yarn\" or none)");
  RopeScaling& y = c->rope_scaling;
  y.type = RopeScaling::Type::kYarn;
  if (rs.find("factor") == rs.end())
    return invalid_argument(std::string(kParse) + ": required field " + where +
                            "factor is missing (YaRN needs it)");
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "factor", where, &y.factor));
  double orig = 0.0;
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "original_max_position_embeddings", where, &orig));
  if (orig != std::floor(orig) || orig < 0.0 || orig > 9.0e15)
    return invalid_argument(std::string(kParse) + ": " + where +
                            "original_max_position_embeddings = " + std::to_string(orig) +
                            " must be a positive integer");
  // Hugging Face falls back to the model's context length.
  y.original_max_position_embeddings =
      orig > 0.0 ? static_cast<int64_t>(orig) : c->max_position_embeddings;
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "beta_fast", where, &y.beta_fast));
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "beta_slow", where, &y.beta_slow));
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "mscale", where, &y.mscale));
  ATTNKIT_RETURN_IF_ERROR(read_double(rs, "mscale_all_dim", where, &y.mscale_all_dim));
  if (y.original_max_position_embeddings <= 0)
    return invalid_argument(std::string(kParse) + ": " + where +
                            "original_max_position_embeddings is missing and so is "
                            "max_position_embeddings (YaRN needs the pre-extension length)");
  return Status::Ok();
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
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return invalid_argument(std::string(kParse) + ": the text is not valid JSON");
  if (!j.is_object())
    return invalid_argument(std::string(kParse) + ": the top level must be a JSON object, got " +
                            dump(j));
  MlaConfig c;
  if (const auto it = j.find("model_type"); it != j.end() && it->is_string())
    c.model_type = it->get<std::string>();
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "hidden_size", true, false, "", &c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(
      read_int(j, "num_attention_heads", true, false, "", &c.num_attention_heads));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "q_lora_rank", true, true, "", &c.q_lora_rank));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "kv_lora_rank", true, false, "", &c.kv_lora_rank));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "qk_nope_head_dim", true, false, "", &c.qk_nope_head_dim));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "qk_rope_head_dim", true, false, "", &c.qk_rope_head_dim));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "v_head_dim", true, false, "", &c.v_head_dim));
  ATTNKIT_RETURN_IF_ERROR(
      read_int(j, "max_position_embeddings", false, true, "", &c.max_position_embeddings));
  ATTNKIT_RETURN_IF_ERROR(read_double(j, "rope_theta", "", &c.rope_theta));
  ATTNKIT_RETURN_IF_ERROR(read_double(j, "rms_norm_eps", "", &c.rms_norm_eps));
  if (const auto it = j.find("rope_interleave"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean())
      return invalid_argument(std::string(kParse) + ": rope_interleave = " + dump(*it) +
                              " must be true or false");
    c.rope_interleave = it->get<bool>();
  }
  if (const auto it = j.find("attention_bias"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean())
      return invalid_argument(std::string(kParse) + ": attention_bias = " + dump(*it) +
                              " must be true or false");
    if (it->get<bool>())
      return invalid_argument(std::string(kParse) +
                              ": attention_bias = true is not supported by LatentAttention "
                              "(no released DeepSeek or Kimi checkpoint has attention biases)");
  }
  if (const auto it = j.find("rope_scaling"); it != j.end()) {
    ATTNKIT_RETURN_IF_ERROR(read_rope_scaling(*it, "rope_scaling", &c));
  } else if (const auto p = j.find("rope_parameters"); p != j.end()) {
    ATTNKIT_RETURN_IF_ERROR(read_rope_scaling(*p, "rope_parameters", &c));
  }
  Status st = validate(c);
  if (!st.ok()) {
    // Same rule, reported under the parser's name.
    std::string msg = st.message();
    if (msg.rfind(kValidate, 0) == 0)
      msg = std::string(kParse) + msg.substr(std::string(kValidate).size());
    return Status(st.code(), msg);
  }
  return c;
}

}  // namespace attnkit
