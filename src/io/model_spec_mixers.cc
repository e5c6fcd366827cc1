// The token mixer of every layer: softmax attention (window, chunk, RoPE or
// NoPE, sinks, gate, qk-norm, scale, softcap), MLA, or Qwen3-Next's Gated
// DeltaNet. The layer kinds are decided in model_spec.cc; here each kind's
// fields are read with its family's defaults (docs/MODELS.md).
#include <cmath>
#include <string>
#include <vector>

#include "io/model_spec_reader.h"

namespace attnkit::io {
namespace {

bool is_qwen2(Family f) { return f == Family::kQwen2 || f == Family::kQwen2Moe; }
bool is_qwen3(Family f) { return f == Family::kQwen3 || f == Family::kQwen3Moe; }

// rope_theta when the config leaves it out (each config class's default).
double default_theta(Family f) {
  switch (f) {
    case Family::kMixtral:
    case Family::kGemma3:
      return 1e6;
    case Family::kGptOss:
      return 150000.0;
    case Family::kLlama4:
      return 500000.0;
    default:
      return 10000.0;
  }
}

// head_dim when the config leaves it out: the config classes that declare
// one, else hidden_size / num_attention_heads.
int64_t default_head_dim(Family f) {
  switch (f) {
    case Family::kQwen3:
    case Family::kQwen3Moe:
    case Family::kLlama4:
      return 128;
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
    case Family::kQwen3Next:
      return 256;
    case Family::kGptOss:
      return 64;
    default:
      return 0;
  }
}

// A rope_scaling / rope_parameters block into `rope` (rope_theta included,
// as HF v5 puts it there).
Status read_rope_block(const SpecContext& c, const json& block, const std::string& name,
                       RopeConfig* rope) {
  if (!block.is_object())
    return c.f.error(name + " = " + json_brief(block) + " must be an object or null");
  const JsonFields f(c.fn, block, name + ".");
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
    // transformers requires factor (rope_config_validation) and falls back
    // to the model's context length for the pre-extension one.
    ATTNKIT_RETURN_IF_ERROR(f.required("factor", "YaRN scales the frequencies by it"));
    ATTNKIT_RETURN_IF_ERROR(f.number("factor", &s.factor));
    if (!f.has("original_max_position_embeddings")) {
      if (c.max_position_embeddings <= 0)
        return f.error(f.path("original_max_position_embeddings") +
                       " is missing and so is max_position_embeddings (YaRN needs the "
                       "pre-extension context length)");
      s.original_max_position_embeddings = c.max_position_embeddings;
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
    return f.boolean("truncate", &s.truncate);
  }
  return f.error(f.path(type_key) + " = \"" + type +
                 "\" is not supported; accepted: \"default\", \"linear\", \"llama3\", \"yarn\" "
                 "(dynamic NTK and longrope depend on the run-time sequence length)");
}

// The rope block that applies to a layer of kind `sliding` (HF v5 may key
// rope_parameters by layer type), or nullptr.
const json* rope_block(const SpecContext& c, bool sliding, std::string* name) {
  const char* key = c.f.has("rope_scaling") ? "rope_scaling" : "rope_parameters";
  const json* block = c.f.get(key);
  *name = c.f.path(key);
  if (block == nullptr) return nullptr;
  const char* layer_type = sliding ? "sliding_attention" : "full_attention";
  if (block->is_object() && block->contains(layer_type) && (*block)[layer_type].is_object()) {
    *name += std::string(".") + layer_type;
    return &(*block)[layer_type];
  }
  return block;
}

// The fields every softmax-attention layer of the model shares.
Status read_attention_base(const SpecContext& c, AttentionConfig* a) {
  const Family fam = c.family;
  const bool gpt2 = fam == Family::kGpt2;
  const char* hidden_key = gpt2 ? "n_embd" : "hidden_size";
  const char* heads_key = gpt2 ? "n_head" : "num_attention_heads";
  a->model_type = c.model_type;
  a->hidden_size = c.hidden_size;
  ATTNKIT_RETURN_IF_ERROR(in_range(c, hidden_key, a->hidden_size, 1));
  // Gemma 3's released text_configs leave the head counts to
  // Gemma3TextConfig (8 heads, 4 kv heads); every other family must say.
  const bool gemma3 = fam == Family::kGemma3;
  if (gemma3) {
    a->num_heads = 8;
  } else {
    ATTNKIT_RETURN_IF_ERROR(
        c.f.required(heads_key, "an attention config needs hidden_size and num_attention_heads"));
  }
  ATTNKIT_RETURN_IF_ERROR(c.f.integer(heads_key, &a->num_heads));
  ATTNKIT_RETURN_IF_ERROR(in_range(c, heads_key, a->num_heads, 1));
  a->num_kv_heads = gemma3 && !c.f.has("num_key_value_heads") ? 4 : a->num_heads;
  if (fam == Family::kFalcon) {
    // FalconAttention: num_kv_heads when new_decoder_architecture (or not
    // multi_query), else one.
    bool multi_query = true, new_arch = false;
    ATTNKIT_RETURN_IF_ERROR(c.f.boolean("multi_query", &multi_query));
    ATTNKIT_RETURN_IF_ERROR(c.f.boolean("new_decoder_architecture", &new_arch));
    if (new_arch || !multi_query) {
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("num_kv_heads", &a->num_kv_heads));
      ATTNKIT_RETURN_IF_ERROR(in_range(c, "num_kv_heads", a->num_kv_heads, 1));
    } else {
      a->num_kv_heads = 1;
    }
  } else if (!gpt2) {
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("num_key_value_heads", &a->num_kv_heads));
    ATTNKIT_RETURN_IF_ERROR(in_range(c, "num_key_value_heads", a->num_kv_heads, 1));
  }
  if (a->num_heads % a->num_kv_heads != 0)
    return c.f.error(c.f.path("num_key_value_heads") + " = " + std::to_string(a->num_kv_heads) +
                     " must divide num_attention_heads = " + std::to_string(a->num_heads));
  if (c.f.has("head_dim")) {
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("head_dim", &a->head_dim));
    ATTNKIT_RETURN_IF_ERROR(in_range(c, "head_dim", a->head_dim, 1));
  } else if (default_head_dim(fam) > 0) {
    a->head_dim = default_head_dim(fam);
  } else {
    if (a->hidden_size % a->num_heads != 0)
      return c.f.error("head_dim is not given and " + c.f.path(hidden_key) + " = " +
                       std::to_string(a->hidden_size) + " is not divisible by " +
                       c.f.path(heads_key) + " = " + std::to_string(a->num_heads));
    a->head_dim = a->hidden_size / a->num_heads;
  }
  a->rms_norm_eps = c.rms_norm_eps;

  // Biases.
  bool bias = fam == Family::kGptOss || gpt2 || fam == Family::kBert;
  ATTNKIT_RETURN_IF_ERROR(c.f.boolean(fam == Family::kFalcon ? "bias" : "attention_bias", &bias));
  a->qkv_bias = is_qwen2(fam) ? true : bias;  // Qwen2Attention hard-codes q/k/v bias, no o bias
  a->o_bias = is_qwen2(fam) ? false : bias;
  a->qk_norm = is_qwen3(fam)                                         ? QkNorm::kRms
               : fam == Family::kGemma3 || fam == Family::kQwen3Next ? QkNorm::kRmsOnePlus
                                                                     : QkNorm::kNone;

  // Logit scale and softcap (Gemma's names; read for any family).
  const bool gemma = fam == Family::kGemma2 || fam == Family::kGemma3;
  if (c.f.has("query_pre_attn_scalar") || gemma) {
    double scalar = 256.0;  // Gemma2Config / Gemma3TextConfig default
    ATTNKIT_RETURN_IF_ERROR(c.f.number("query_pre_attn_scalar", &scalar));
    if (!(scalar > 0.0))
      return c.f.error(c.f.path("query_pre_attn_scalar") + " = " + num(scalar) + " must be > 0");
    a->softmax_scale = static_cast<float>(1.0 / std::sqrt(scalar));
  }
  // Gemma2Config defaults the cap to 50 (an explicit null turns it off).
  double softcap = fam == Family::kGemma2 && !c.cfg.contains("attn_logit_softcapping") ? 50.0 : 0;
  ATTNKIT_RETURN_IF_ERROR(c.f.number("attn_logit_softcapping", &softcap));
  if (softcap < 0.0)
    return c.f.error(c.f.path("attn_logit_softcapping") + " = " + num(softcap) +
                     " must be >= 0 or null");
  a->softcap = static_cast<float>(softcap);
  a->causal = fam != Family::kBert;
  a->sinks = fam == Family::kGptOss;

  // RoPE (gpt2 and bert use learned absolute positions).
  a->use_rope = !gpt2 && fam != Family::kBert;
  a->rope = RopeConfig{};
  a->rope.head_dim = a->head_dim;
  a->rope.theta = default_theta(fam);
  a->rope.pairing = fam == Family::kLlama4 ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  ATTNKIT_RETURN_IF_ERROR(c.f.number("rope_theta", &a->rope.theta));
  if (c.f.has("partial_rotary_factor") || fam == Family::kQwen3Next) {
    double factor = 0.25;  // Qwen3NextConfig's default
    ATTNKIT_RETURN_IF_ERROR(c.f.number("partial_rotary_factor", &factor));
    // transformers: int(head_dim * partial_rotary_factor).
    const double rotary = std::floor(static_cast<double>(a->head_dim) * factor);
    if (!(factor > 0.0 && factor <= 1.0) || rotary < 2.0 || std::fmod(rotary, 2.0) != 0.0)
      return c.f.error(c.f.path("partial_rotary_factor") + " = " + num(factor) +
                       " must be in (0, 1] and make int(head_dim * factor) (head_dim = " +
                       std::to_string(a->head_dim) + ") a positive even number");
    a->rope.rotary_dim = static_cast<int64_t>(rotary);
  }
  if (fam == Family::kLlama4) {
    a->temperature_tuning = true;  // Llama4TextConfig's default
    // Llama4TextConfig declares a bool but the released Scout config says 4;
    // transformers tests its truth, and so does this reader.
    if (const json* v = c.f.get("attn_temperature_tuning"); v != nullptr && v->is_number_integer())
      a->temperature_tuning = v->get<int64_t>() != 0;
    else
      ATTNKIT_RETURN_IF_ERROR(c.f.boolean("attn_temperature_tuning", &a->temperature_tuning));
    ATTNKIT_RETURN_IF_ERROR(c.f.number("floor_scale", &a->floor_scale));
    ATTNKIT_RETURN_IF_ERROR(c.f.number("attn_scale", &a->attn_scale));
    if (!(a->floor_scale > 0.0))
      return c.f.error(c.f.path("floor_scale") + " = " + num(a->floor_scale) + " must be > 0");
  }
  if (fam == Family::kGptOss) {
    // GptOssConfig's rope_parameters when the config has none.
    a->rope.scaling.type = RopeScaling::Type::kYarn;
    a->rope.scaling.factor = 32.0;
    a->rope.scaling.beta_fast = 32.0;
    a->rope.scaling.beta_slow = 1.0;
    a->rope.scaling.truncate = false;
    a->rope.scaling.original_max_position_embeddings = 4096;
  }
  return Status::Ok();
}

// One softmax-attention layer of kind `kind` from the shared base.
Status read_attention_layer(const SpecContext& c, const AttentionConfig& base, int64_t layer,
                            Mixer kind, bool rope_layer, AttentionConfig* a) {
  const Family fam = c.family;
  *a = base;
  const bool sliding = kind == Mixer::kSliding;
  if (sliding) ATTNKIT_RETURN_IF_ERROR(sliding_window_of(c, &a->sliding_window));
  if (kind == Mixer::kChunked) {
    int64_t chunk = 8192;  // Llama4TextConfig's attention_chunk_size
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("attention_chunk_size", &chunk));
    if (!c.f.has("attention_chunk_size") && c.cfg.contains("attention_chunk_size")) chunk = 0;
    if (chunk < 1)
      return c.f.error("layer " + std::to_string(layer) + " uses chunked attention but " +
                       c.f.path("attention_chunk_size") + " = " +
                       (chunk == 0 ? std::string("null") : std::to_string(chunk)) +
                       " (must be >= 1)");
    a->chunk_size = chunk;
  }
  if (fam == Family::kLlama4) {
    a->use_rope = rope_layer;
    bool qk_norm = true;
    ATTNKIT_RETURN_IF_ERROR(c.f.boolean("use_qk_norm", &qk_norm));
    a->qk_norm = qk_norm && rope_layer ? QkNorm::kL2 : QkNorm::kNone;
    a->temperature_tuning = base.temperature_tuning && !rope_layer;
  }
  if (fam == Family::kQwen3Next) a->output_gate = true;
  if (a->use_rope) {
    std::string name;
    const json* block = rope_block(c, sliding, &name);
    const bool keyed = name.ends_with(".sliding_attention");
    if (fam == Family::kGemma3 && sliding && !keyed) {
      // Local layers: rope_local_base_freq, never scaled (unless HF v5's
      // rope_parameters gives the sliding layers a block of their own).
      a->rope.theta = 10000.0;
      ATTNKIT_RETURN_IF_ERROR(c.f.number("rope_local_base_freq", &a->rope.theta));
      a->rope.scaling = RopeScaling{};
    } else {
      if (block != nullptr) {
        a->rope.scaling = RopeScaling{};
        ATTNKIT_RETURN_IF_ERROR(read_rope_block(c, *block, name, &a->rope));
      }
    }
    if (auto rope = Rope::create(a->rope); !rope.ok())
      return c.f.error("rope_theta / rope_scaling / partial_rotary_factor give an invalid RoPE: " +
                       rope.status().message());
  }
  return renamed(c, validate(*a), "AttentionConfig");
}

// One MLA configuration (every layer of a DeepSeek model shares it).
Status read_mla(const SpecContext& c, MlaConfig* m) {
  m->model_type = c.model_type;
  m->hidden_size = c.hidden_size;
  const char* why =
      "an MLA config needs hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, "
      "qk_nope_head_dim, qk_rope_head_dim, v_head_dim";
  for (const char* key : {"num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                          "qk_rope_head_dim", "v_head_dim"}) {
    // q_lora_rank must be there but may be null (= no query compression).
    if (std::string_view(key) == "q_lora_rank" && c.cfg.contains(key)) continue;
    ATTNKIT_RETURN_IF_ERROR(c.f.required(key, why));
  }
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("num_attention_heads", &m->num_attention_heads));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("q_lora_rank", &m->q_lora_rank));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("kv_lora_rank", &m->kv_lora_rank));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("qk_nope_head_dim", &m->qk_nope_head_dim));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("qk_rope_head_dim", &m->qk_rope_head_dim));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("v_head_dim", &m->v_head_dim));
  m->max_position_embeddings = c.max_position_embeddings;
  m->rms_norm_eps = c.rms_norm_eps;
  ATTNKIT_RETURN_IF_ERROR(c.f.boolean("rope_interleave", &m->rope_interleave));
  bool bias = false;
  ATTNKIT_RETURN_IF_ERROR(c.f.boolean("attention_bias", &bias));
  if (bias)
    return c.f.error(c.f.path("attention_bias") +
                     " = true is not supported by LatentAttention (no released DeepSeek or Kimi "
                     "checkpoint has attention biases)");
  RopeConfig rope;
  ATTNKIT_RETURN_IF_ERROR(c.f.number("rope_theta", &rope.theta));
  std::string name;
  if (const json* block = rope_block(c, false, &name)) {
    ATTNKIT_RETURN_IF_ERROR(read_rope_block(c, *block, name, &rope));
    const char* type_key = block->contains("rope_type") ? "rope_type" : "type";
    if (rope.scaling.type != RopeScaling::Type::kNone &&
        rope.scaling.type != RopeScaling::Type::kYarn)
      return c.f.error(name + "." + type_key + " = " + json_brief((*block)[type_key]) +
                       " is not supported for MLA (only \"yarn\" or none)");
  }
  m->rope_theta = rope.theta;
  m->rope_scaling = rope.scaling;
  if (c.model_type == "deepseek_v32") {
    // DeepSeek-V3.2's sparse attention: the indexer's three sizes are
    // required, and so is query compression (the indexer reads it).
    const char* dsa = "a deepseek_v32 config needs index_n_heads, index_head_dim, index_topk";
    for (const char* key : {"index_n_heads", "index_head_dim", "index_topk"})
      ATTNKIT_RETURN_IF_ERROR(c.f.required(key, dsa));
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("index_n_heads", &m->index_n_heads));
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("index_head_dim", &m->index_head_dim));
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("index_topk", &m->index_topk));
    if (m->index_n_heads < 1)
      return c.f.error(c.f.path("index_n_heads") + " = " + std::to_string(m->index_n_heads) +
                       " must be >= 1 for deepseek_v32");
    if (m->q_lora_rank < 1)
      return c.f.error(c.f.path("q_lora_rank") +
                       " is required (>= 1) for deepseek_v32: the indexer query is projected "
                       "from MLA's compressed query");
    // The power-of-two scales are the default (the released config's
    // scale_fmt "ue8m0"); an explicit null or other format asks for amax/448.
    std::string fmt = "ue8m0";
    ATTNKIT_RETURN_IF_ERROR(c.f.string("index_scale_fmt", &fmt));
    if (fmt != "ue8m0" && fmt != "amax")
      return c.f.error(c.f.path("index_scale_fmt") + " = \"" + fmt +
                       "\" must be \"ue8m0\" (power-of-two scales) or \"amax\" (amax / 448)");
    m->index_scale_ue8m0 = fmt == "ue8m0";
  }
  return renamed(c, validate(*m), "MlaConfig");
}

// Qwen3-Next's Gated DeltaNet layer (every linear layer shares it).
Status read_linear(const SpecContext& c, GatedDeltaNetConfig* g) {
  g->hidden_size = c.hidden_size;
  g->rms_norm_eps = c.rms_norm_eps;
  // Qwen3NextConfig's defaults.
  g->num_k_heads = 16;
  g->num_v_heads = 32;
  g->key_head_dim = 128;
  g->value_head_dim = 128;
  g->conv_kernel = 4;
  const std::pair<const char*, int64_t*> fields[] = {{"linear_num_key_heads", &g->num_k_heads},
                                                     {"linear_num_value_heads", &g->num_v_heads},
                                                     {"linear_key_head_dim", &g->key_head_dim},
                                                     {"linear_value_head_dim", &g->value_head_dim},
                                                     {"linear_conv_kernel_dim", &g->conv_kernel}};
  for (const auto& [key, out] : fields) {
    ATTNKIT_RETURN_IF_ERROR(c.f.integer(key, out));
    ATTNKIT_RETURN_IF_ERROR(in_range(c, key, *out, 1));
  }
  if (g->num_v_heads % g->num_k_heads != 0)
    return c.f.error(
        c.f.path("linear_num_value_heads") + " = " + std::to_string(g->num_v_heads) +
        " must be a multiple of linear_num_key_heads = " + std::to_string(g->num_k_heads));
  return Status::Ok();
}

}  // namespace

Status read_mixers(const SpecContext& c, const std::vector<Mixer>& kinds, bool softmax_only,
                   std::vector<LayerSpec>* layers) {
  bool any_attention = false, any_mla = false, any_linear = false;
  for (Mixer k : kinds) {
    any_mla |= k == Mixer::kLatent;
    any_linear |= k == Mixer::kLinear;
    any_attention |= k != Mixer::kLatent && k != Mixer::kLinear;
  }
  if (any_mla && !softmax_only) {
    MlaConfig mla;
    ATTNKIT_RETURN_IF_ERROR(read_mla(c, &mla));
    for (size_t i = 0; i < kinds.size(); ++i)
      if (kinds[i] == Mixer::kLatent) (*layers)[i].mla = mla;
  }
  if (any_linear && !softmax_only) {
    GatedDeltaNetConfig linear;
    ATTNKIT_RETURN_IF_ERROR(read_linear(c, &linear));
    for (size_t i = 0; i < kinds.size(); ++i)
      if (kinds[i] == Mixer::kLinear) (*layers)[i].linear = linear;
  }
  if (!any_attention) return Status::Ok();
  AttentionConfig base;
  ATTNKIT_RETURN_IF_ERROR(read_attention_base(c, &base));
  std::vector<bool> rope(kinds.size(), true);
  if (c.family == Family::kLlama4) ATTNKIT_RETURN_IF_ERROR(llama4_rope_layers(c, &rope));
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == Mixer::kLatent || kinds[i] == Mixer::kLinear) continue;
    ATTNKIT_RETURN_IF_ERROR(read_attention_layer(c, base, static_cast<int64_t>(i), kinds[i],
                                                 rope[i], &(*layers)[i].attention));
  }
  return Status::Ok();
}

}  // namespace attnkit::io
