// attnkit/config.h — layer configurations, from Hugging Face config.json.
//
// Field names follow Hugging Face. Configs are parsed strictly: a missing
// required field, a wrong JSON type or a contradictory value is an error that
// names the field and its value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "attnkit/rope.h"
#include "attnkit/status.h"

namespace attnkit {

// One MHA / MQA / GQA attention layer.
struct AttentionConfig {
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3", ... (informational)
  int64_t hidden_size = 0;   // hidden_size
  int64_t num_heads = 0;     // num_attention_heads
  int64_t num_kv_heads = 0;  // num_key_value_heads (default num_attention_heads)
  int64_t head_dim = 0;      // head_dim (default hidden_size / num_attention_heads)
  bool qkv_bias = false;     // q_proj/k_proj/v_proj carry .bias
  bool o_bias = false;       // o_proj carries .bias
  bool qk_norm = false;      // Qwen3: RMSNorm per head on q and k, before RoPE
  double rms_norm_eps = 1e-6;
  bool use_rope = true;
  RopeConfig rope;             // rope.head_dim == head_dim
  int64_t sliding_window = 0;  // 0 = none; W = each token sees itself and W-1 before it
  float softcap = 0.0f;        // attn_logit_softcapping (Gemma-2); 0 = off
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  bool causal = true;          // decoder self-attention
};

// Checks the invariants every layer relies on (positive sizes, num_heads %
// num_kv_heads == 0, rope consistent with head_dim, ...).
Status validate(const AttentionConfig& config);

// Reads the attention fields of a Hugging Face config.json: model_type
// llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe or gemma2 (a
// config without model_type is read as llama's shape; any other model_type
// is an error naming it). `layer_index` picks
// the per-layer settings where a model alternates them (Gemma-2's sliding
// layers, Qwen2's max_window_layers, an explicit layer_types list).
Result<AttentionConfig> attention_config_from_json(std::string_view json_text,
                                                   int64_t layer_index = 0);

// The seeds' unified constructor: "mha" (num_kv_heads = num_heads), "mqa"
// (1) or "gqa-N" (N kv heads); head_dim = d_model / num_heads, no RoPE,
// non-causal, biases on all four projections when `bias` is set (as
// nn.Linear's default in the seeds' modules).
Result<AttentionConfig> attention_config_from_variant(std::string_view variant, int64_t d_model,
                                                      int64_t num_heads, bool bias = true);

}  // namespace attnkit
