// AttentionConfig: validation, the seeds' variant constructor, and parsing
// of a Hugging Face config.json (llama, mistral, mixtral, qwen2, qwen2_moe,
// qwen3, qwen3_moe, gemma2, and configs without a model_type, read as
// llama's shape; any other model_type is rejected by name).
//
// The per-family rules mirror transformers' attention modules:
//   llama / none     q/k/v/o bias = attention_bias; no window
//   mistral/mixtral  window = sliding_window on every layer (null = none)
//   qwen2            q/k/v bias always, o_proj never; window only when
//                    use_sliding_window and layer_index >= max_window_layers
//   qwen3            qk_norm; bias = attention_bias; window as qwen2
//   gemma2           window on even layers; query_pre_attn_scalar^-0.5 scale;
//                    attn_logit_softcapping; bias = attention_bias
// An explicit layer_types list overrides every family's window rule. HF
// checkpoints store q/k rows in half-split ("rotate_half") order.
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
#include "io/json_util.h"

namespace attnkit {
namespace {

using io::json;
using io::JsonFields;

constexpr const char* kParse = "attention_config_from_json";
constexpr const char* kVariant = "attention_config_from_variant";
constexpr const char* kValidate = "AttentionConfig";

// Each size at most 2^20 keeps every product a layer forms (weight element
// counts such as num_heads * head_dim * hidden_size) far below 2^63.
constexpr int64_t kMaxDim = int64_t{1} << 20;

// transformers' Qwen2Config / Qwen3Config default for max_window_layers.
constexpr int64_t kQwenDefaultMaxWindowLayers = 28;

enum class Family { kLlama, kMistral, kQwen2, kQwen3, kGemma2 };

// The model types whose attention this parser reads, with the family whose
// rules apply. Anything else is rejected by name: a config of another
// architecture (gpt2's n_embd, falcon's fused qkv, ...) would otherwise be
// read through the llama rules into a layer that is not that model's.
struct KnownType {
  const char* model_type;
  Family family;
};
constexpr KnownType kKnownTypes[] = {
    {"llama", Family::kLlama},     {"mistral", Family::kMistral}, {"mixtral", Family::kMistral},
    {"qwen2", Family::kQwen2},     {"qwen2_moe", Family::kQwen2}, {"qwen3", Family::kQwen3},
    {"qwen3_moe", Family::kQwen3}, {"gemma2", Family::kGemma2},
};

// A config without model_type is read with llama's rules (the shape every
// family here shares); an unknown one is an error naming it.
Status family_of(const JsonFields& f, const std::string& model_type, Family* family) {
  *family = Family::kLlama;
  if (model_type.empty()) return Status::Ok();
  std::string accepted;
  for (const KnownType& t : kKnownTypes) {
    if (model_type == t.model_type) {
      *family = t.family;
      return Status::Ok();
    }
    accepted += std::string(accepted.empty() ? "" : ", ") + "\"" + t.model_type + "\"";
  }
  return f.error("model_type = \"" + model_type + "\" is not supported; accepted: " + accepted +
                 " (MLA models \"deepseek_v2\", \"deepseek_v3\", \"kimi_k2\" are read by "
                 "mla_config_from_json)");
}

// Short form for messages ("1e-06", "0.5").
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

Status in_range(const JsonFields& f, const char* key, int64_t value, int64_t lo) {
  if (value >= lo && value <= kMaxDim) return Status::Ok();
  return f.error(f.path(key) + " = " + std::to_string(value) + " must be in [" +
                 std::to_string(lo) + ", " + std::to_string(kMaxDim) + "]");
}

// rope_scaling (or HF v5's rope_parameters, which also carries rope_theta).
Status read_rope_block(const json& block, const std::string& name, int64_t max_position_embeddings,
                       RopeConfig* rope) {
  if (!block.is_object())
    return invalid_argument(std::string(kParse) + ": " + name + " = " + io::json_brief(block) +
                            " must be an object or null");
  const JsonFields f(kParse, block, name + ".");
  ATTNKIT_RETURN_IF_ERROR(f.number("rope_theta", &rope->theta));
  std::string type;
  const char* type_key = f.has("rope_type") ? "rope_type" : "type";
  ATTNKIT_RETURN_IF_ERROR(f.string(type_key, &type));
  if (type.empty() || type == "default") return Status::Ok();

  RopeScaling& s = rope->scaling;
  if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
    ATTNKIT_RETURN_IF_ERROR(f.required("factor", "linear scaling divides frequencies by it"));
    return f.number("factor", &s.factor);
  }
  if (type == "llama3") {
    s.type = RopeScaling::Type::kLlama3;
    for (const char* key :
         {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      ATTNKIT_RETURN_IF_ERROR(f.required(key,
                                         "llama3 scaling needs factor, low_freq_factor, "
                                         "high_freq_factor, original_max_position_embeddings"));
    ATTNKIT_RETURN_IF_ERROR(f.number("factor", &s.factor));
    ATTNKIT_RETURN_IF_ERROR(f.number("low_freq_factor", &s.low_freq_factor));
    ATTNKIT_RETURN_IF_ERROR(f.number("high_freq_factor", &s.high_freq_factor));
    return f.integer("original_max_position_embeddings", &s.original_max_position_embeddings);
  }
  if (type == "yarn") {
    s.type = RopeScaling::Type::kYarn;
    ATTNKIT_RETURN_IF_ERROR(
        f.integer("original_max_position_embeddings", &s.original_max_position_embeddings));
    // transformers falls back to the model's context length for the
    // pre-extension one, and (newer versions) derives a missing factor
    // from the ratio of the two.
    if (!f.has("original_max_position_embeddings")) {
      if (max_position_embeddings <= 0)
        return f.error(f.path("original_max_position_embeddings") +
                       " is missing and so is max_position_embeddings (YaRN needs the "
                       "pre-extension context length)");
      s.original_max_position_embeddings = max_position_embeddings;
    }
    if (f.has("factor")) {
      ATTNKIT_RETURN_IF_ERROR(f.number("factor", &s.factor));
    } else if (max_position_embeddings > 0 && s.original_max_position_embeddings > 0) {
      s.factor = static_cast<double>(max_position_embeddings) /
                 static_cast<double>(s.original_max_position_embeddings);
    } else {
      return f.error("required field " + f.path("factor") +
                     " is missing (and max_position_embeddings is not there to derive it)");
    }
    // As in transformers (`get("beta_fast") or 32`), 0 means the default.
    double beta_fast = 0.0, beta_slow = 0.0;
    ATTNKIT_RETURN_IF_ERROR(f.number("beta_fast", &beta_fast));
    ATTNKIT_RETURN_IF_ERROR(f.number("beta_slow", &beta_slow));
    if (beta_fast != 0.0) s.beta_fast = beta_fast;
    if (beta_slow != 0.0) s.beta_slow = beta_slow;
    ATTNKIT_RETURN_IF_ERROR(f.number("mscale", &s.mscale));
    ATTNKIT_RETURN_IF_ERROR(f.number("mscale_all_dim", &s.mscale_all_dim));
    ATTNKIT_RETURN_IF_ERROR(f.number("attention_factor", &s.attention_factor));
    bool truncate = true;
    ATTNKIT_RETURN_IF_ERROR(f.boolean("truncate", &truncate));
    if (!truncate)
      return f.error(f.path("truncate") +
                     " = false is not supported (Rope rounds the YaRN correction range to "
                     "whole pairs, truncate = true)");
    return Status::Ok();
  }
  return f.error(f.path(type_key) + " = \"" + type +
                 "\" is not supported; accepted: \"default\", \"linear\", \"llama3\", \"yarn\" "
                 "(dynamic NTK and longrope depend on the run-time sequence length)");
}

// Whether layer `layer_index` uses its sliding window, from layer_types.
Status read_layer_types(const JsonFields& f, const json& types, int64_t num_layers,
                        int64_t layer_index, bool* sliding) {
  if (!types.is_array())
    return f.error("layer_types = " + io::json_brief(types) + " must be a list of strings");
  const int64_t n = static_cast<int64_t>(types.size());
  if (num_layers > 0 && n != num_layers)
    return f.error("layer_types has " + std::to_string(n) + " entries, must have " +
                   "num_hidden_layers = " + std::to_string(num_layers));
  if (layer_index >= n)
    return f.error("layer_index = " + std::to_string(layer_index) +
                   " is past layer_types, which has " + std::to_string(n) + " entries");
  const json& t = types[static_cast<size_t>(layer_index)];
  const std::string where = "layer_types[" + std::to_string(layer_index) + "]";
  if (t.is_string() && t.get<std::string>() == "sliding_attention") {
    *sliding = true;
  } else if (t.is_string() && t.get<std::string>() == "full_attention") {
    *sliding = false;
  } else {
    return f.error(where + " = " + io::json_brief(t) +
                   " must be \"sliding_attention\" or \"full_attention\"");
  }
  return Status::Ok();
}

Status parse(std::string_view text, int64_t layer_index, AttentionConfig* c) {
  json j;
  ATTNKIT_RETURN_IF_ERROR(io::json_parse(kParse, text, &j));
  if (!j.is_object())
    return invalid_argument(std::string(kParse) + ": the top level must be a JSON object, got " +
                            io::json_brief(j));
  const JsonFields f(kParse, j);
  ATTNKIT_RETURN_IF_ERROR(f.string("model_type", &c->model_type));
  if (f.has("kv_lora_rank"))
    return f.error("kv_lora_rank is set: this is an MLA config (model_type \"" + c->model_type +
                   "\"); read it with mla_config_from_json");
  Family family = Family::kLlama;
  ATTNKIT_RETURN_IF_ERROR(family_of(f, c->model_type, &family));

  // Sizes.
  const char* why = "an attention config needs hidden_size and num_attention_heads";
  ATTNKIT_RETURN_IF_ERROR(f.required("hidden_size", why));
  ATTNKIT_RETURN_IF_ERROR(f.required("num_attention_heads", why));
  ATTNKIT_RETURN_IF_ERROR(f.integer("hidden_size", &c->hidden_size));
  ATTNKIT_RETURN_IF_ERROR(in_range(f, "hidden_size", c->hidden_size, 1));
  ATTNKIT_RETURN_IF_ERROR(f.integer("num_attention_heads", &c->num_heads));
  ATTNKIT_RETURN_IF_ERROR(in_range(f, "num_attention_heads", c->num_heads, 1));
  c->num_kv_heads = c->num_heads;
  ATTNKIT_RETURN_IF_ERROR(f.integer("num_key_value_heads", &c->num_kv_heads));
  ATTNKIT_RETURN_IF_ERROR(in_range(f, "num_key_value_heads", c->num_kv_heads, 1));
  if (c->num_heads % c->num_kv_heads != 0)
    return f.error("num_key_value_heads = " + std::to_string(c->num_kv_heads) +
                   " must divide num_attention_heads = " + std::to_string(c->num_heads));
  if (f.has("head_dim")) {
    ATTNKIT_RETURN_IF_ERROR(f.integer("head_dim", &c->head_dim));
    ATTNKIT_RETURN_IF_ERROR(in_range(f, "head_dim", c->head_dim, 1));
  } else {
    if (c->hidden_size % c->num_heads != 0)
      return f.error("head_dim is not given and hidden_size = " + std::to_string(c->hidden_size) +
                     " is not divisible by num_attention_heads = " + std::to_string(c->num_heads));
    c->head_dim = c->hidden_size / c->num_heads;
  }

  // Layer index.
  int64_t num_layers = 0, max_position_embeddings = 0;
  ATTNKIT_RETURN_IF_ERROR(f.integer("num_hidden_layers", &num_layers));
  if (f.has("num_hidden_layers"))
    ATTNKIT_RETURN_IF_ERROR(in_range(f, "num_hidden_layers", num_layers, 1));
  if (layer_index < 0 || (num_layers > 0 && layer_index >= num_layers))
    return f.error("layer_index = " + std::to_string(layer_index) + " must be in [0, " +
                   (num_layers > 0 ? "num_hidden_layers = " + std::to_string(num_layers)
                                   : std::string("inf")) +
                   ")");
  ATTNKIT_RETURN_IF_ERROR(f.integer("max_position_embeddings", &max_position_embeddings));
  if (max_position_embeddings < 0)
    return f.error("max_position_embeddings = " + std::to_string(max_position_embeddings) +
                   " must be >= 0");

  ATTNKIT_RETURN_IF_ERROR(f.number("rms_norm_eps", &c->rms_norm_eps));

  // Biases and q/k norm.
  bool attention_bias = false;
  ATTNKIT_RETURN_IF_ERROR(f.boolean("attention_bias", &attention_bias));
  c->qkv_bias = family == Family::kQwen2 ? true : attention_bias;
  c->o_bias = family == Family::kQwen2 ? false : attention_bias;
  c->qk_norm = family == Family::kQwen3 ? QkNorm::kRms : QkNorm::kNone;

  // Sliding window.
  int64_t window = 0;
  ATTNKIT_RETURN_IF_ERROR(f.integer("sliding_window", &window));
  if (window < 0)
    return f.error("sliding_window = " + std::to_string(window) + " must be >= 0 or null");
  bool sliding = false;
  if (const json* types = f.get("layer_types")) {
    ATTNKIT_RETURN_IF_ERROR(read_layer_types(f, *types, num_layers, layer_index, &sliding));
  } else if (family == Family::kMistral) {
    sliding = window > 0;
  } else if (family == Family::kQwen2 || family == Family::kQwen3) {
    bool use_sliding_window = false;
    int64_t max_window_layers = kQwenDefaultMaxWindowLayers;
    ATTNKIT_RETURN_IF_ERROR(f.boolean("use_sliding_window", &use_sliding_window));
    ATTNKIT_RETURN_IF_ERROR(f.integer("max_window_layers", &max_window_layers));
    sliding = use_sliding_window && layer_index >= max_window_layers;
  } else if (family == Family::kGemma2) {
    sliding = layer_index % 2 == 0 && window > 0;
  }
  if (sliding && window == 0)
    return f.error("layer " + std::to_string(layer_index) +
                   " uses sliding-window attention but sliding_window is " +
                   (f.has("sliding_window")        ? "0"
                    : j.contains("sliding_window") ? "null"
                                                   : "missing"));
  c->sliding_window = sliding ? window : 0;

  // Logit scale and softcap (Gemma-2 names; read for any family).
  if (f.has("query_pre_attn_scalar")) {
    double scalar = 0.0;
    ATTNKIT_RETURN_IF_ERROR(f.number("query_pre_attn_scalar", &scalar));
    if (!(scalar > 0.0))
      return f.error("query_pre_attn_scalar = " + io::json_brief(*f.get("query_pre_attn_scalar")) +
                     " must be > 0");
    c->softmax_scale = static_cast<float>(1.0 / std::sqrt(scalar));
  }
  double softcap = 0.0;
  ATTNKIT_RETURN_IF_ERROR(f.number("attn_logit_softcapping", &softcap));
  if (softcap < 0.0)
    return f.error("attn_logit_softcapping = " + io::json_brief(*f.get("attn_logit_softcapping")) +
                   " must be >= 0 or null");
  c->softcap = static_cast<float>(softcap);
  c->causal = true;

  // RoPE.
  c->use_rope = true;
  c->rope = RopeConfig{};
  c->rope.head_dim = c->head_dim;
  c->rope.pairing = RopePairing::kHalfSplit;
  ATTNKIT_RETURN_IF_ERROR(f.number("rope_theta", &c->rope.theta));
  if (f.has("partial_rotary_factor")) {
    double factor = 0.0;
    ATTNKIT_RETURN_IF_ERROR(f.number("partial_rotary_factor", &factor));
    // transformers: int(head_dim * partial_rotary_factor).
    const double rotary = std::floor(static_cast<double>(c->head_dim) * factor);
    if (!(factor > 0.0 && factor <= 1.0) || rotary < 2.0 || std::fmod(rotary, 2.0) != 0.0)
      return f.error("partial_rotary_factor = " + io::json_brief(*f.get("partial_rotary_factor")) +
                     " must be in (0, 1] and make int(head_dim * factor) (head_dim = " +
                     std::to_string(c->head_dim) + ") a positive even number");
    c->rope.rotary_dim = static_cast<int64_t>(rotary);
  }
  const char* block_name = f.has("rope_scaling") ? "rope_scaling" : "rope_parameters";
  if (const json* block = f.get(block_name)) {
    // HF v5 may key rope_parameters by layer type (Gemma-style models).
    const char* layer_type = sliding ? "sliding_attention" : "full_attention";
    const json* chosen = block;
    std::string name = block_name;
    if (block->is_object() && block->contains(layer_type)) {
      chosen = &(*block)[layer_type];
      name += std::string(".") + layer_type;
    }
    ATTNKIT_RETURN_IF_ERROR(read_rope_block(*chosen, name, max_position_embeddings, &c->rope));
  }
  if (auto rope = Rope::create(c->rope); !rope.ok())
    return f.error("rope_theta / rope_scaling / partial_rotary_factor give an invalid RoPE: " +
                   rope.status().message());
  return Status::Ok();
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
  AttentionConfig c;
  // The readers check types before converting, so nlohmann should never
  // throw; this is the backstop that keeps the no-throw promise regardless.
  try {
    ATTNKIT_RETURN_IF_ERROR(parse(json_text, layer_index, &c));
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(kParse) + ": out of memory while reading the config");
  } catch (const std::exception& e) {
    return invalid_argument(std::string(kParse) + ": " + e.what());
  }
  const Status st = validate(c);
  if (!st.ok()) return Status(st.code(), std::string(kParse) + ": " + st.message());
  return c;
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
