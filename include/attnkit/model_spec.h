// attnkit/model_spec.h — one description of a model, layer by layer.
//
// A Hugging Face config.json is read once, here, into a ModelSpec: the
// model-wide sizes and, for every decoder layer, what kind of token mixer it
// runs (softmax attention with its window, chunk, RoPE and extras; MLA; a
// linear-attention layer with a fixed-size state) and which feed-forward
// follows it. Every older way a family says which layer is which
// (sliding_window_pattern, max_window_layers, no_rope_layers,
// full_attention_interval, Gemma-2's alternation) is normalised into the
// per-layer list at load time and then forgotten. Layers, caches, the
// analysis, the serving engine and the tools ask the spec; nobody re-reads
// the file (docs/MODELS.md lists each family's rules and defaults with
// their sources).
//
// Strict: a required field missing, a wrong JSON type, a value out of range,
// or a field that would change the arithmetic and that attnkit does not
// understand is an error naming the field and its value. Weight
// quantization (quantization_config) never refuses a config: it is recorded
// in `quantization` and the analysis says whether it counted it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/status.h"

namespace attnkit {

// What mixes tokens in one decoder layer.
enum class LayerKind : uint8_t {
  kAttention,        // softmax attention, MHA/MQA/GQA (full, sliding or chunked)
  kLatentAttention,  // DeepSeek's MLA
  kLinearAttention,  // Gated DeltaNet (Qwen3-Next): a fixed-size state per sequence
};

// Qwen3-Next's Gated DeltaNet layer (linear_attn.*), Hugging Face names in
// the comments. Per sequence it holds a state of num_v_heads x key_head_dim
// x value_head_dim values and the last conv_kernel - 1 inputs of its
// causal convolution, and nothing per token.
struct GatedDeltaNetConfig {
  int64_t hidden_size = 0;
  int64_t num_k_heads = 0;     // linear_num_key_heads
  int64_t num_v_heads = 0;     // linear_num_value_heads (a multiple of num_k_heads)
  int64_t key_head_dim = 0;    // linear_key_head_dim
  int64_t value_head_dim = 0;  // linear_value_head_dim
  int64_t conv_kernel = 0;     // linear_conv_kernel_dim
  double rms_norm_eps = 1e-6;

  // The recurrent state S, [num_v_heads, key_head_dim, value_head_dim].
  int64_t state_values() const { return num_v_heads * key_head_dim * value_head_dim; }
  // The convolution's rolling inputs, [conv_kernel - 1, conv channels] with
  // conv channels = 2 * num_k_heads * key_head_dim + num_v_heads * value_head_dim.
  int64_t conv_state_values() const {
    return (conv_kernel - 1) * (2 * num_k_heads * key_head_dim + num_v_heads * value_head_dim);
  }
};

// The feed-forward after a layer's token mixer.
enum class FeedForwardKind : uint8_t {
  kDense,  // gate/up/down MLP of intermediate_size
  kMoe,    // MoeConfig (routed experts, optional shared experts)
};

struct FeedForwardSpec {
  FeedForwardKind kind = FeedForwardKind::kDense;
  int64_t intermediate_size = 0;  // kDense
  std::string hidden_act;         // "silu", "gelu_pytorch_tanh", ... (as configured)
  MoeConfig moe;                  // kMoe
};

struct LayerSpec {
  LayerKind kind = LayerKind::kAttention;
  AttentionConfig attention;   // kAttention: window, chunk, RoPE / NoPE, sinks, gate, qk-norm
  MlaConfig mla;               // kLatentAttention
  GatedDeltaNetConfig linear;  // kLinearAttention
  FeedForwardSpec ffn;
};

// quantization_config as published (e.g. gpt-oss's MXFP4 experts).
struct WeightQuantization {
  std::string quant_method;  // "" = none; "mxfp4", "fp8", ...
  // modules_not_to_convert (or the family's equivalent), as listed.
  std::vector<std::string> modules_not_to_convert;
};

struct ModelSpec {
  std::string name;        // _name_or_path, or a preset's name
  std::string model_type;  // the text model's (gemma3_text for a gemma3 wrapper)
  // The outer model_type when the fields came from a multimodal wrapper's
  // text_config ("gemma3", "llama4"); empty otherwise.
  std::string wrapper_model_type;
  int64_t num_layers = 0;  // num_hidden_layers
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;  // 0 = not given
  bool tie_word_embeddings = false;
  double rms_norm_eps = 1e-6;
  // final_logit_softcapping: logits = cap * tanh(logits / cap) after the LM
  // head (Gemma-2's default 30; Gemma-3's none); 0 = off.
  double final_logit_softcapping = 0.0;
  WeightQuantization quantization;
  std::vector<LayerSpec> layers;  // num_layers entries, layer 0 first
};

// Reads a Hugging Face config.json (a multimodal wrapper's text_config
// included). Errors name the field, its value and the rule.
Result<ModelSpec> model_spec_from_json(std::string_view json_text);

}  // namespace attnkit
