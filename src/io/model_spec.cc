// model_spec_from_json: reads a Hugging Face config.json once into a
// ModelSpec. This file holds the model-wide part: the JSON, a multimodal
// wrapper's text_config, the family of model_type, the model-wide sizes,
// quantization_config, and which kind of token mixer each layer runs (every
// family's older way of saying it, normalised into one list). The mixers'
// fields are read in model_spec_mixers.cc, the feed-forwards' in
// model_spec_ffn.cc. docs/MODELS.md lists every rule and default with the
// transformers file it comes from.
#include <cmath>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/model_spec.h"
#include "io/model_spec_reader.h"

namespace attnkit::io {
namespace {

struct KnownType {
  const char* model_type;
  Family family;
  bool layer;  // false: read for the analysis only (no layer runs its attention)
};
constexpr KnownType kKnownTypes[] = {
    {"llama", Family::kLlama, true},
    {"mistral", Family::kMistral, true},
    {"mixtral", Family::kMixtral, true},
    {"qwen2", Family::kQwen2, true},
    {"qwen2_moe", Family::kQwen2Moe, true},
    {"qwen3", Family::kQwen3, true},
    {"qwen3_moe", Family::kQwen3Moe, true},
    {"qwen3_next", Family::kQwen3Next, true},
    {"gemma2", Family::kGemma2, true},
    {"gemma3_text", Family::kGemma3, true},
    {"gpt_oss", Family::kGptOss, true},
    {"llama4_text", Family::kLlama4, true},
    {"deepseek_v2", Family::kDeepseekV2, true},
    {"deepseek_v3", Family::kDeepseekV3, true},
    {"deepseek_v32", Family::kDeepseekV3, true},
    {"kimi_k2", Family::kDeepseekV3, true},
    {"gemma", Family::kGemma, false},
    {"gpt2", Family::kGpt2, false},
    {"bert", Family::kBert, false},
    {"falcon", Family::kFalcon, false},
};

// Multimodal wrappers whose text model sits in text_config.
struct Wrapper {
  const char* outer;
  const char* inner;
};
constexpr Wrapper kWrappers[] = {{"gemma3", "gemma3_text"}, {"llama4", "llama4_text"}};

std::string accepted_types(bool layers_only) {
  std::string out;
  for (const KnownType& t : kKnownTypes)
    if (t.layer || !layers_only)
      out += std::string(out.empty() ? "" : ", ") + "\"" + t.model_type + "\"";
  for (const Wrapper& w : kWrappers) out += std::string(", \"") + w.outer + "\" (text_config)";
  return out;
}

// The family of model_type; a config without one is read by its fields:
// DeepSeek's names (kv_lora_rank, n_routed_experts), Mixtral's
// (num_local_experts), else llama's shape.
Status family_of(const SpecContext& c, const SpecRequest& r, Family* family) {
  if (c.model_type.empty()) {
    const bool deepseek = c.f.has("kv_lora_rank") || c.f.has("n_routed_experts");
    const bool mixtral = c.f.has("num_local_experts");
    if (deepseek && mixtral)
      return c.f.error("without model_type, " + c.f.path("num_local_experts") + " and " +
                       c.f.path("n_routed_experts") + " are both set; give model_type");
    *family = deepseek ? Family::kDeepseekGeneric : mixtral ? Family::kMixtral : Family::kLlama;
    return Status::Ok();
  }
  for (const KnownType& t : kKnownTypes) {
    if (c.model_type != t.model_type) continue;
    if (!t.layer && r.layer_families_only) break;
    *family = t.family;
    return Status::Ok();
  }
  return c.f.error(c.f.path("model_type") + " = \"" + c.model_type +
                   "\" is not supported; accepted: " + accepted_types(r.layer_families_only));
}

bool is_mla(Family f) {
  return f == Family::kDeepseekV2 || f == Family::kDeepseekV3 || f == Family::kDeepseekGeneric;
}

// HF's defaults of rms_norm_eps (or the family's LayerNorm epsilon).
double default_norm_eps(Family f) {
  switch (f) {
    case Family::kMixtral:
    case Family::kGptOss:
    case Family::kLlama4:
    case Family::kGpt2:
    case Family::kFalcon:
      return 1e-5;
    case Family::kBert:
      return 1e-12;
    default:
      return 1e-6;
  }
}

const char* norm_eps_key(Family f) {
  switch (f) {
    case Family::kGpt2:
    case Family::kFalcon:
      return "layer_norm_epsilon";
    case Family::kBert:
      return "layer_norm_eps";
    default:
      return "rms_norm_eps";
  }
}

bool default_tie_embeddings(Family f) {
  switch (f) {
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
    case Family::kGpt2:
    case Family::kBert:
    case Family::kFalcon:
      return true;
    default:
      return false;
  }
}

// layer_types: one known kind per layer.
Status kinds_from_layer_types(const SpecContext& c, const json& types, std::vector<Mixer>* kinds) {
  if (!types.is_array())
    return c.f.error(c.f.path("layer_types") + " = " + json_brief(types) +
                     " must be a list of strings");
  const int64_t n = static_cast<int64_t>(types.size());
  if (n != c.num_layers)
    return c.f.error(c.f.path("layer_types") + " has " + std::to_string(n) +
                     " entries, must have num_hidden_layers = " + std::to_string(c.num_layers));
  // The kinds each family's modeling code builds.
  struct Kind {
    const char* name;
    Mixer mixer;
  };
  std::vector<Kind> allowed = {{"full_attention", Mixer::kFull}};
  if (c.family == Family::kLlama4) {
    allowed.push_back({"chunked_attention", Mixer::kChunked});
  } else if (c.family == Family::kQwen3Next) {
    allowed.push_back({"linear_attention", Mixer::kLinear});
  } else {
    allowed.push_back({"sliding_attention", Mixer::kSliding});
  }
  kinds->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const json& t = types[static_cast<size_t>(i)];
    bool found = false;
    for (const Kind& k : allowed) {
      if (t.is_string() && t.get<std::string>() == k.name) {
        (*kinds)[static_cast<size_t>(i)] = k.mixer;
        found = true;
      }
    }
    if (found) continue;
    std::string names;
    for (const Kind& k : allowed)
      names += std::string(names.empty() ? "" : " or ") + "\"" + k.name + "\"";
    return c.f.error(c.f.path("layer_types") + "[" + std::to_string(i) + "] = " + json_brief(t) +
                     " must be " + names + " (the layer kinds of model_type \"" +
                     (c.model_type.empty() ? "llama" : c.model_type) + "\")");
  }
  return Status::Ok();
}

// Every family's rule for which layer is which, when layer_types is absent.
Status kinds_from_family_rule(const SpecContext& c, std::vector<Mixer>* kinds) {
  const int64_t n = c.num_layers;
  kinds->assign(static_cast<size_t>(n), Mixer::kFull);
  auto set = [&](int64_t i, Mixer m) { (*kinds)[static_cast<size_t>(i)] = m; };
  int64_t window = 0;
  ATTNKIT_RETURN_IF_ERROR(sliding_window_of(c, &window));
  switch (c.family) {
    case Family::kMistral:
    case Family::kMixtral:
      if (window > 0)
        for (int64_t i = 0; i < n; ++i) set(i, Mixer::kSliding);
      return Status::Ok();
    case Family::kQwen2:
    case Family::kQwen2Moe:
    case Family::kQwen3:
    case Family::kQwen3Moe: {
      // configuration_qwen2.py: with use_sliding_window, layer i slides when
      // i >= max_window_layers (default 28) and sliding_window is not null.
      bool use = false;
      ATTNKIT_RETURN_IF_ERROR(c.f.boolean("use_sliding_window", &use));
      int64_t first = 28;
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("max_window_layers", &first));
      if (!use || window == 0) return Status::Ok();
      for (int64_t i = std::max<int64_t>(first, 0); i < n; ++i) set(i, Mixer::kSliding);
      return Status::Ok();
    }
    case Family::kGemma2:
      // Even layers slide ((i + 1) % 2 != 0), when there is a window.
      if (window > 0)
        for (int64_t i = 0; i < n; i += 2) set(i, Mixer::kSliding);
      return Status::Ok();
    case Family::kGemma3: {
      int64_t pattern = 6;
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("sliding_window_pattern", &pattern));
      if (pattern < 1)
        return c.f.error(c.f.path("sliding_window_pattern") + " = " + std::to_string(pattern) +
                         " must be >= 1");
      for (int64_t i = 0; i < n; ++i)
        if ((i + 1) % pattern != 0) set(i, Mixer::kSliding);
      return Status::Ok();
    }
    case Family::kGptOss:
      for (int64_t i = 0; i < n; ++i)
        if ((i + 1) % 2 != 0) set(i, Mixer::kSliding);
      return Status::Ok();
    case Family::kLlama4: {
      // Chunked attention on the RoPE layers, full attention on the NoPE ones.
      std::vector<bool> rope;
      ATTNKIT_RETURN_IF_ERROR(llama4_rope_layers(c, &rope));
      for (int64_t i = 0; i < n; ++i)
        if (rope[static_cast<size_t>(i)]) set(i, Mixer::kChunked);
      return Status::Ok();
    }
    case Family::kQwen3Next: {
      int64_t interval = 4;
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("full_attention_interval", &interval));
      if (interval < 1)
        return c.f.error(c.f.path("full_attention_interval") + " = " + std::to_string(interval) +
                         " must be >= 1");
      for (int64_t i = 0; i < n; ++i)
        if ((i + 1) % interval != 0) set(i, Mixer::kLinear);
      return Status::Ok();
    }
    default:
      // llama, gemma, gpt2, bert, falcon: full attention everywhere.
      return Status::Ok();
  }
}

Status layer_kinds(const SpecContext& c, std::vector<Mixer>* kinds) {
  if (is_mla(c.family)) {
    kinds->assign(static_cast<size_t>(c.num_layers), Mixer::kLatent);
    return Status::Ok();
  }
  if (const json* types = c.f.get("layer_types")) {
    ATTNKIT_RETURN_IF_ERROR(kinds_from_layer_types(c, *types, kinds));
  } else {
    ATTNKIT_RETURN_IF_ERROR(kinds_from_family_rule(c, kinds));
  }
  // A sliding layer needs its window (the family rules above mark layers
  // only where there is one; layer_types may not).
  int64_t window = 0;
  ATTNKIT_RETURN_IF_ERROR(sliding_window_of(c, &window));
  for (int64_t i = 0; i < c.num_layers; ++i)
    if ((*kinds)[static_cast<size_t>(i)] == Mixer::kSliding && window == 0)
      return c.f.error("layer " + std::to_string(i) + " uses sliding-window attention but " +
                       c.f.path("sliding_window") + " is " +
                       (c.cfg.contains("sliding_window") ? c.f.has("sliding_window") ? "0" : "null"
                                                         : "missing"));
  return Status::Ok();
}

// quantization_config, recorded as published; never a reason to refuse.
void read_quantization(const json& top, WeightQuantization* q) {
  const auto it = top.find("quantization_config");
  if (it == top.end() || !it->is_object()) return;
  if (const auto m = it->find("quant_method"); m != it->end() && m->is_string())
    q->quant_method = m->get<std::string>();
  for (const char* key : {"modules_to_not_convert", "modules_not_to_convert", "ignored_layers"}) {
    const auto list = it->find(key);
    if (list == it->end() || !list->is_array()) continue;
    for (const json& v : *list)
      if (v.is_string()) q->modules_not_to_convert.push_back(v.get<std::string>());
  }
}

Status read(const json& top, const SpecRequest& r, ModelSpec* spec) {
  if (!top.is_object())
    return invalid_argument(std::string(r.fn) + ": the top level must be a JSON object, got " +
                            json_brief(top));
  const JsonFields outer(r.fn, top);
  std::string outer_type;
  ATTNKIT_RETURN_IF_ERROR(outer.string("model_type", &outer_type));
  const json* text = &top;
  std::string prefix;
  const Wrapper* wrapper = nullptr;
  for (const Wrapper& w : kWrappers)
    if (outer_type == w.outer) wrapper = &w;
  if (top.contains("text_config") && !top["text_config"].is_null()) {
    if (!top["text_config"].is_object())
      return outer.error("text_config = " + json_brief(top["text_config"]) +
                         " must be an object (a multimodal model's text model)");
    text = &top["text_config"];
    prefix = "text_config.";
    spec->wrapper_model_type = outer_type;
  } else if (wrapper != nullptr) {
    return outer.error("text_config is missing: model_type = \"" + outer_type +
                       "\" is a multimodal wrapper whose text model (\"" + wrapper->inner +
                       "\") is described in text_config");
  }
  SpecContext c{r.fn, *text, JsonFields(r.fn, *text, prefix), Family::kLlama, {}, 0, 0, 0, 1e-6};
  ATTNKIT_RETURN_IF_ERROR(c.f.string("model_type", &c.model_type));
  if (c.model_type.empty() && wrapper != nullptr) c.model_type = wrapper->inner;
  ATTNKIT_RETURN_IF_ERROR(family_of(c, r, &c.family));

  spec->model_type = c.model_type;
  ATTNKIT_RETURN_IF_ERROR(outer.string("_name_or_path", &spec->name));
  const bool gpt2 = c.family == Family::kGpt2;
  const char* layers_key = gpt2 ? "n_layer" : "num_hidden_layers";
  const char* hidden_key = gpt2 ? "n_embd" : "hidden_size";
  const char* positions_key = gpt2 ? "n_positions" : "max_position_embeddings";

  ATTNKIT_RETURN_IF_ERROR(c.f.integer(layers_key, &c.num_layers));
  if (c.f.has(layers_key)) {
    // Each layer costs a LayerSpec (about a kilobyte with its RoPE tables):
    // 2^16 layers, far past any model (Llama 3.1 405B has 126), bounds what
    // a hostile config can make the reader allocate.
    if (c.num_layers < 1 || c.num_layers > kMaxLayers)
      return c.f.error(c.f.path(layers_key) + " = " + std::to_string(c.num_layers) +
                       " must be in [1, " + std::to_string(kMaxLayers) + "]");
  } else if (r.layers_if_absent > 0) {
    // A layer_types list says how many layers there are.
    const json* types = c.f.get("layer_types");
    c.num_layers = types != nullptr && types->is_array() && !types->empty()
                       ? static_cast<int64_t>(types->size())
                       : r.layers_if_absent;
    if (c.num_layers > kMaxLayers)
      return c.f.error(c.f.path("layer_types") + " has " + std::to_string(c.num_layers) +
                       " entries, more than " + std::to_string(kMaxLayers) + " layers");
  } else {
    ATTNKIT_RETURN_IF_ERROR(c.f.required(layers_key, "the number of decoder layers"));
  }
  ATTNKIT_RETURN_IF_ERROR(c.f.required(hidden_key, "every layer's projections are that wide"));
  ATTNKIT_RETURN_IF_ERROR(c.f.integer(hidden_key, &c.hidden_size));
  if (c.family == Family::kGemma3) {
    // Gemma3TextConfig's defaults, which the released text_configs rely on.
    c.max_position_embeddings = 131072;
    spec->vocab_size = 262208;
  }
  ATTNKIT_RETURN_IF_ERROR(c.f.integer(positions_key, &c.max_position_embeddings));
  if (c.max_position_embeddings < 0)
    return c.f.error(c.f.path(positions_key) + " = " + std::to_string(c.max_position_embeddings) +
                     " must be >= 0");
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("vocab_size", &spec->vocab_size));
  spec->tie_word_embeddings = default_tie_embeddings(c.family);
  ATTNKIT_RETURN_IF_ERROR(c.f.boolean("tie_word_embeddings", &spec->tie_word_embeddings));
  c.rms_norm_eps = default_norm_eps(c.family);
  ATTNKIT_RETURN_IF_ERROR(c.f.number(norm_eps_key(c.family), &c.rms_norm_eps));

  // Gemma2Config defaults the final cap to 30 (an explicit null turns it off).
  double final_cap =
      c.family == Family::kGemma2 && !c.cfg.contains("final_logit_softcapping") ? 30.0 : 0.0;
  ATTNKIT_RETURN_IF_ERROR(c.f.number("final_logit_softcapping", &final_cap));
  if (!(final_cap >= 0.0) || !std::isfinite(final_cap))
    return c.f.error(c.f.path("final_logit_softcapping") + " = " + std::to_string(final_cap) +
                     " must be finite and >= 0, or null");
  spec->final_logit_softcapping = final_cap;

  spec->num_layers = c.num_layers;
  spec->hidden_size = c.hidden_size;
  spec->max_position_embeddings = c.max_position_embeddings;
  spec->rms_norm_eps = c.rms_norm_eps;
  read_quantization(top, &spec->quantization);

  std::vector<Mixer> kinds;
  ATTNKIT_RETURN_IF_ERROR(layer_kinds(c, &kinds));
  spec->layers.assign(static_cast<size_t>(c.num_layers), LayerSpec{});
  for (size_t i = 0; i < kinds.size(); ++i)
    spec->layers[i].kind = kinds[i] == Mixer::kLatent   ? LayerKind::kLatentAttention
                           : kinds[i] == Mixer::kLinear ? LayerKind::kLinearAttention
                                                        : LayerKind::kAttention;
  if (r.mixers) ATTNKIT_RETURN_IF_ERROR(read_mixers(c, kinds, r.softmax_only, &spec->layers));
  if (r.ffn) ATTNKIT_RETURN_IF_ERROR(read_ffns(c, &spec->layers));
  return Status::Ok();
}

}  // namespace

Status in_range(const SpecContext& c, const char* key, int64_t value, int64_t lo) {
  if (value >= lo && value <= kMaxDim) return Status::Ok();
  return c.f.error(c.f.path(key) + " = " + std::to_string(value) + " must be in [" +
                   std::to_string(lo) + ", " + std::to_string(kMaxDim) + "]");
}

Status llama4_rope_layers(const SpecContext& c, std::vector<bool>* rope) {
  const int64_t n = c.num_layers;
  rope->clear();
  int64_t interval = 4;
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("no_rope_layer_interval", &interval));
  if (interval < 1)
    return c.f.error(c.f.path("no_rope_layer_interval") + " = " + std::to_string(interval) +
                     " must be >= 1");
  const json* list = c.f.get("no_rope_layers");
  // configuration_llama4.py: an absent or empty list means NoPE on every
  // no_rope_layer_interval-th layer.
  if (list == nullptr || (list->is_array() && list->empty())) {
    for (int64_t i = 0; i < n; ++i) rope->push_back((i + 1) % interval != 0);
    return Status::Ok();
  }
  if (!list->is_array() || static_cast<int64_t>(list->size()) != n)
    return c.f.error(c.f.path("no_rope_layers") + " = " + json_brief(*list) +
                     " must be a list of num_hidden_layers = " + std::to_string(n) +
                     " entries, each 0 or 1");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& v = (*list)[i];
    if (!v.is_number_integer() || (v.get<int64_t>() != 0 && v.get<int64_t>() != 1))
      return c.f.error(c.f.path("no_rope_layers") + "[" + std::to_string(i) +
                       "] = " + json_brief(v) + " must be 0 (NoPE) or 1 (RoPE)");
    rope->push_back(v.get<int64_t>() == 1);
  }
  return Status::Ok();
}

Status sliding_window_of(const SpecContext& c, int64_t* window) {
  *window = 0;
  if (!c.cfg.contains("sliding_window")) {
    // The config classes' defaults for an absent key (an explicit null
    // means no window in every family).
    switch (c.family) {
      case Family::kMistral:
      case Family::kQwen2:
      case Family::kQwen2Moe:
      case Family::kQwen3:
      case Family::kQwen3Moe:
      case Family::kGemma2:
      case Family::kGemma3:
        *window = 4096;
        break;
      case Family::kGptOss:
        *window = 128;
        break;
      default:
        break;
    }
    return Status::Ok();
  }
  ATTNKIT_RETURN_IF_ERROR(c.f.integer("sliding_window", window));
  if (*window < 0)
    return c.f.error(c.f.path("sliding_window") + " = " + std::to_string(*window) +
                     " must be >= 0 or null");
  return Status::Ok();
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

Status renamed(const SpecContext& c, const Status& status, std::string_view validator) {
  if (status.ok()) return status;
  std::string msg = status.message();
  const std::string tag = std::string(validator) + ": ";
  if (msg.rfind(tag, 0) == 0) msg.erase(0, tag.size());
  return Status(status.code(), std::string(c.fn) + ": " + msg);
}

Status read_model_spec(std::string_view text, const SpecRequest& request, ModelSpec* spec) {
  *spec = ModelSpec{};
  // The field readers check types before converting, so nlohmann should
  // never throw; this is the backstop that keeps the no-throw promise.
  try {
    json j;
    ATTNKIT_RETURN_IF_ERROR(json_parse(request.fn, text, &j));
    return read(j, request, spec);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(request.fn) + ": out of memory while reading the config");
  } catch (const std::exception& e) {
    return invalid_argument(std::string(request.fn) + ": " + e.what());
  }
}

}  // namespace attnkit::io

namespace attnkit {

Result<ModelSpec> model_spec_from_json(std::string_view json_text) {
  ModelSpec spec;
  ATTNKIT_RETURN_IF_ERROR(io::read_model_spec(json_text, io::SpecRequest{}, &spec));
  return spec;
}

}  // namespace attnkit
