// Hugging Face config.json -> ModelShape. Field names differ across
// families (gpt2's n_embd, falcon's multi_query, DeepSeek's kv_lora_rank);
// each family's reading is spelled out below.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>

#include "attnkit/analysis.h"
#include "attnkit/latent_attention.h"

namespace attnkit {
namespace {

using nlohmann::json;
constexpr const char* kFn = "model_shape_from_json";

Status field_error(const std::string& field, const std::string& rule, const json& value) {
  return invalid_argument(std::string(kFn) + ": " + field + " = " + value.dump() + " " + rule);
}

// Reads an integer field; `required` fields must exist, others keep *out.
// Every size is capped far above any real model (2^20) so that the
// analysis' products of sizes cannot overflow 64 bits and a hostile config
// cannot ask for a per-layer table of 10^18 entries.
constexpr int64_t kMaxSize = int64_t{1} << 20;

Status get_int(const json& j, const char* field, bool required, int64_t* out,
               int64_t min_value = 1) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required)
      return invalid_argument(std::string(kFn) + ": required field '" + field + "' is missing");
    return Status::Ok();
  }
  // Integers only; a float is accepted when it is integral and in range
  // (some exporters write 4096.0). The range check comes before the cast:
  // converting an out-of-range double to int64 is undefined behaviour.
  int64_t v;
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return field_error(field, "is out of range", *it);
    v = static_cast<int64_t>(u);
  } else if (it->is_number_integer()) {
    v = it->get<int64_t>();
  } else if (it->is_number_float()) {
    const double d = it->get<double>();
    if (!(d >= -9.2e18 && d <= 9.2e18) || d != std::floor(d))
      return field_error(field, "must be an integer", *it);
    v = static_cast<int64_t>(d);
  } else {
    return field_error(field, "must be an integer", *it);
  }
  if (v < min_value) return field_error(field, "must be >= " + std::to_string(min_value), *it);
  if (v > kMaxSize) return field_error(field, "must be <= " + std::to_string(kMaxSize), *it);
  *out = v;
  return Status::Ok();
}

Status get_bool(const json& j, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return field_error(field, "must be true or false", *it);
  *out = it->get<bool>();
  return Status::Ok();
}

Status parse_windows(const json& j, ModelShape* m) {
  m->layers.assign(static_cast<size_t>(m->num_layers), LayerShape{});
  int64_t window = 0;
  auto sw = j.find("sliding_window");
  if (sw != j.end() && !sw->is_null()) {
    if (!sw->is_number_integer() || sw->get<int64_t>() < 0)
      return field_error("sliding_window", "must be a non-negative integer or null", *sw);
    window = sw->get<int64_t>();
  }
  auto types = j.find("layer_types");
  if (types != j.end() && !types->is_null()) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != m->num_layers)
      return invalid_argument(std::string(kFn) +
                              ": layer_types must be a list of num_hidden_layers = " +
                              std::to_string(m->num_layers) + " strings");
    for (size_t l = 0; l < types->size(); ++l) {
      const json& t = (*types)[l];
      if (!t.is_string())
        return field_error("layer_types[" + std::to_string(l) + "]", "must be a string", t);
      if (t.get<std::string>() == "sliding_attention") m->layers[l].sliding_window = window;
    }
    return Status::Ok();
  }
  if (window == 0) return Status::Ok();
  const std::string& type = m->model_type;
  if (type == "gemma2" || type == "gemma3") {
    // Gemma-2 alternates local (even layer index) and global layers.
    for (int64_t l = 0; l < m->num_layers; l += 2)
      m->layers[static_cast<size_t>(l)].sliding_window = window;
  } else if (type == "qwen2" || type == "qwen3" || type == "qwen2_moe" || type == "qwen3_moe") {
    bool use = false;
    ATTNKIT_RETURN_IF_ERROR(get_bool(j, "use_sliding_window", &use));
    if (!use) return Status::Ok();
    int64_t first = 0;
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "max_window_layers", false, &first, 0));
    for (int64_t l = first; l < m->num_layers; ++l)
      m->layers[static_cast<size_t>(l)].sliding_window = window;
  } else {
    for (auto& l : m->layers) l.sliding_window = window;  // mistral and llama-shaped configs
  }
  return Status::Ok();
}

// MLA configs are read by the layer's own parser, so that analyze and
// LatentAttention accept and reject the same files with the same message.
Status parse_mla(std::string_view json_text, ModelShape* m) {
  Result<MlaConfig> c = mla_config_from_json(json_text);
  if (!c.ok()) return c.status();
  m->mla = true;
  m->kv_lora_rank = c->kv_lora_rank;
  m->q_lora_rank = c->q_lora_rank;
  m->qk_nope_head_dim = c->qk_nope_head_dim;
  m->qk_rope_head_dim = c->qk_rope_head_dim;
  m->v_head_dim = c->v_head_dim;
  m->rope_interleave = c->rope_interleave;
  return Status::Ok();
}

// The families whose attention is MLA, with or without their MLA fields.
bool is_mla_family(const std::string& model_type) {
  return model_type == "deepseek_v2" || model_type == "deepseek_v3" || model_type == "kimi_k2";
}

Status parse(std::string_view json_text, const json& j, ModelShape* m) {
  if (!j.is_object())
    return invalid_argument(std::string(kFn) + ": the config must be a JSON object");
  if (auto it = j.find("model_type"); it != j.end() && it->is_string())
    m->model_type = it->get<std::string>();
  if (auto it = j.find("_name_or_path"); it != j.end() && it->is_string())
    m->name = it->get<std::string>();
  const std::string& type = m->model_type;
  // A deepseek_v3 config without kv_lora_rank is a broken MLA config, not
  // an MHA one: it goes to the MLA parser, which names the missing field.
  const bool mla =
      is_mla_family(type) || (j.contains("kv_lora_rank") && !j["kv_lora_rank"].is_null());
  if (mla) ATTNKIT_RETURN_IF_ERROR(parse_mla(json_text, m));

  if (type == "gpt2") {
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "n_embd", true, &m->hidden_size));
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "n_head", true, &m->num_heads));
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "n_layer", true, &m->num_layers));
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "n_positions", false, &m->max_position_embeddings));
    m->num_kv_heads = m->num_heads;
    m->q_bias = m->k_bias = m->v_bias = m->o_bias = true;  // Conv1D c_attn / c_proj carry biases
  } else {
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "hidden_size", true, &m->hidden_size));
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "num_attention_heads", true, &m->num_heads));
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "num_hidden_layers", true, &m->num_layers));
    ATTNKIT_RETURN_IF_ERROR(
        get_int(j, "max_position_embeddings", false, &m->max_position_embeddings));
    m->num_kv_heads = m->num_heads;
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "num_key_value_heads", false, &m->num_kv_heads));
  }
  if (m->hidden_size % m->num_heads != 0 && !j.contains("head_dim") && !j.contains("kv_lora_rank"))
    return invalid_argument(std::string(kFn) + ": hidden_size = " + std::to_string(m->hidden_size) +
                            " is not a multiple of num_attention_heads = " +
                            std::to_string(m->num_heads) + " and the config has no head_dim");
  m->head_dim = m->hidden_size / m->num_heads;

  if (mla) {
    // num_key_value_heads and head_dim in these configs do not describe the
    // cache (mla.md, analyzer traps): each head gets its own K/V after
    // decompression, q/k are nope + rope wide and v is v_head_dim wide.
    m->num_kv_heads = m->num_heads;
    m->head_dim = m->qk_nope_head_dim + m->qk_rope_head_dim;
    m->head_dim_v = m->v_head_dim;
  } else {
    ATTNKIT_RETURN_IF_ERROR(get_int(j, "head_dim", false, &m->head_dim));
    m->head_dim_v = m->head_dim;
    if (type == "bert") {
      m->causal = false;
      m->q_bias = m->k_bias = m->v_bias = m->o_bias = true;
    } else if (type == "falcon") {
      bool multi_query = false, new_arch = false, bias = false;
      ATTNKIT_RETURN_IF_ERROR(get_bool(j, "multi_query", &multi_query));
      ATTNKIT_RETURN_IF_ERROR(get_bool(j, "new_decoder_architecture", &new_arch));
      ATTNKIT_RETURN_IF_ERROR(get_bool(j, "bias", &bias));
      if (new_arch) {
        ATTNKIT_RETURN_IF_ERROR(get_int(j, "num_kv_heads", false, &m->num_kv_heads));
      } else if (multi_query) {
        m->num_kv_heads = 1;
      }
      m->q_bias = m->k_bias = m->v_bias = m->o_bias = bias;
    } else if (type != "gpt2") {
      bool attention_bias = false;
      ATTNKIT_RETURN_IF_ERROR(get_bool(j, "attention_bias", &attention_bias));
      m->q_bias = m->k_bias = m->v_bias = m->o_bias = attention_bias;
      if (type == "qwen2" || type == "qwen2_moe") {  // q/k/v always carry a bias, o never
        m->q_bias = m->k_bias = m->v_bias = true;
        m->o_bias = false;
      }
      if (type == "qwen3" || type == "qwen3_moe") m->qk_norm = true;
    }
    if (m->num_heads % m->num_kv_heads != 0)
      return invalid_argument(std::string(kFn) +
                              ": num_key_value_heads = " + std::to_string(m->num_kv_heads) +
                              " must divide num_attention_heads = " + std::to_string(m->num_heads));
  }
  return parse_windows(j, m);
}

}  // namespace

Result<ModelShape> model_shape_from_json(std::string_view json_text) {
  ModelShape m;
  try {
    const json j = json::parse(json_text.begin(), json_text.end());
    ATTNKIT_RETURN_IF_ERROR(parse(json_text, j, &m));
  } catch (const json::exception& e) {
    return invalid_argument(std::string(kFn) + ": not valid JSON: " + e.what());
  }
  return m;
}

}  // namespace attnkit
