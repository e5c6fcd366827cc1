// The one reader of a Hugging Face config.json (model_spec.cc and its two
// halves, model_spec_mixers.cc and model_spec_ffn.cc). model_spec_from_json
// reads everything; the older entry points (attention_config_from_json,
// mla_config_from_json, moe_config_from_json, model_shape_from_json) run
// the same reader on the parts they return, under their own name in every
// message, and take their answer from the spec it fills.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/model_spec.h"
#include "io/json_util.h"

namespace attnkit::io {

struct SpecRequest {
  const char* fn = "model_spec_from_json";  // the name every message starts with
  bool mixers = true;                       // read each layer's token mixer
  bool softmax_only = false;                // ... only where it is softmax attention
  bool ffn = true;                          // read each layer's feed-forward
  // num_hidden_layers absent: 0 = an error; n > 0 = describe n layers (an
  // entry point that reads one layer of a config that omits the count).
  int64_t layers_if_absent = 0;
  // Refuse the families read for the analysis only (gpt2, bert, falcon,
  // gemma), whose attention no layer of attnkit runs.
  bool layer_families_only = false;
};

Status read_model_spec(std::string_view text, const SpecRequest& request, ModelSpec* spec);

// ---- shared by the reader's files ----------------------------------------

// The rules a model_type is read with.
enum class Family : uint8_t {
  kLlama,
  kMistral,
  kMixtral,
  kQwen2,
  kQwen2Moe,
  kQwen3,
  kQwen3Moe,
  kQwen3Next,
  kGemma,
  kGemma2,
  kGemma3,
  kGptOss,
  kLlama4,
  kDeepseekV2,
  kDeepseekV3,
  // A config without model_type that carries DeepSeek's field names
  // (kv_lora_rank or n_routed_experts): neutral routing defaults.
  kDeepseekGeneric,
  kGpt2,
  kBert,
  kFalcon,
};

// What mixes tokens in one layer, after every family rule is applied.
enum class Mixer : uint8_t { kFull, kSliding, kChunked, kLinear, kLatent };

// The text model's fields and what the reader knows about them.
struct SpecContext {
  const char* fn;
  const json& cfg;  // the text model's object (a wrapper's text_config)
  JsonFields f;     // over cfg; paths carry "text_config." inside a wrapper
  Family family;
  std::string model_type;  // the text model's
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
};

constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxLayers = int64_t{1} << 16;

// "[lo, 2^20]" range check naming the field.
Status in_range(const SpecContext& c, const char* key, int64_t value, int64_t lo);
// sliding_window, or the family's default when the key is absent; 0 = none.
Status sliding_window_of(const SpecContext& c, int64_t* window);
// Llama 4: whether each layer uses RoPE (no_rope_layers, 1 = RoPE).
Status llama4_rope_layers(const SpecContext& c, std::vector<bool>* rope);
// Short form of a double for messages ("1e-06", "0.5").
std::string num(double v);
// `status` (from validate(X), message "X: ...") under the reader's name.
Status renamed(const SpecContext& c, const Status& status, std::string_view validator);

// model_spec_mixers.cc: the per-layer mixers (kinds already decided).
Status read_mixers(const SpecContext& c, const std::vector<Mixer>& kinds, bool softmax_only,
                   std::vector<LayerSpec>* layers);
// model_spec_ffn.cc: the per-layer feed-forwards.
Status read_ffns(const SpecContext& c, std::vector<LayerSpec>* layers);

}  // namespace attnkit::io
