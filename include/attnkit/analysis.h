// attnkit/analysis.h — exact arithmetic about attention variants on real
// model shapes: parameters, KV-cache bytes, FLOPs, arithmetic intensity.
// No timing here; the tool combines these with measured machine figures.
//
// Counting conventions (stated once, used everywhere):
// - Attention parameters of one layer: the q/k/v/o projection weights, the
//   biases that exist, qk-norm gains (Qwen3) and, for MLA, its factors and
//   their RMSNorm gains. Block-level norms are not counted.
// - KV values per token per layer: num_kv_heads * (head_dim + head_dim_v)
//   for MHA/GQA/MQA; kv_lora_rank + qk_rope_head_dim for MLA's latent cache;
//   num_heads * (qk_nope + qk_rope + v_head_dim) for MLA's naive cache.
// - A layer with a sliding window W holds min(context, W) tokens.
// - FLOPs count a multiply-add as 2. Prefill is causal over S tokens:
//   2 * S * (projection weights) + 2 * num_heads * (head_dim + head_dim_v) *
//   (visible query-key pairs). Decode is one new token over L cached ones:
//   2 * (projection weights) + 2 * num_heads * (head_dim + head_dim_v) * L,
//   or for absorbed MLA 2 * H * (d_c + d_r) * L + 2 * H * d_c * L.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

// What the analysis needs to know about a model's attention.
struct ModelShape {
  std::string name;        // preset name or the config's _name_or_path
  std::string model_type;  // Hugging Face model_type
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // MLA: num_heads (each head has its own K/V after decompression)
  int64_t head_dim = 0;      // q/k width per head (MLA: qk_nope + qk_rope)
  int64_t head_dim_v = 0;    // v width per head
  bool q_bias = false, k_bias = false, v_bias = false, o_bias = false;
  bool qk_norm = false;
  bool causal = true;
  // MLA (DeepSeek-V2/V3, Kimi-K2); mla == false for every other model.
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0 = direct q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = true;  // RoPE pairing of the rope features (MlaConfig's)
  // Per layer: 0 = full attention, W = sliding window of W tokens.
  std::vector<int64_t> window_per_layer;
  int64_t max_position_embeddings = 0;
  std::string source;  // where the numbers come from
};

// Reads a Hugging Face config.json: llama, mistral, qwen2, qwen3, gemma,
// gemma2, falcon, gpt2, bert, deepseek_v2, deepseek_v3, kimi_k2 and configs of
// the llama shape. MLA configs (model_type deepseek_v2 / deepseek_v3 /
// kimi_k2, or any config with kv_lora_rank) are read by
// mla_config_from_json, whose errors are returned unchanged; their
// misleading num_key_value_heads / head_dim fields are ignored.
Result<ModelShape> model_shape_from_json(std::string_view json_text);

// Built-in presets (facts and sources in docs/ANALYSIS.md). Names are
// matched case-insensitively: "llama-3-8b", "Llama-3-8B", "deepseek-v3", ...
std::vector<std::string> preset_names();
Result<ModelShape> model_preset(std::string_view name);
// The Hugging Face-style config.json text a preset is built from.
Result<std::string> preset_config_json(std::string_view name);

int64_t attention_params_per_layer(const ModelShape& m);
// MLA: latent = true counts the latent cache, false the naive per-head cache.
int64_t kv_values_per_token_per_layer(const ModelShape& m, bool mla_latent = true);
// Bytes of K/V for one token across all layers (no window cap); the 8-bit
// types (int8, fp8_e4m3) count their fp32 scales too, as the caches store
// them: one per kv head row of K and of V, one per 64 channels of an MLA
// latent row (kv_cache.h).
int64_t kv_bytes_per_token(const ModelShape& m, DType kv_dtype, bool mla_latent = true);
// Bytes of the whole cache for `batch` sequences of `context` tokens, with
// each layer's sliding window applied. A double, because user-given
// contexts and batches multiply past 2^63 (2e9 tokens x 2e9 sequences):
// exact up to 2^53 bytes (8 PiB), within two roundings above, never capped.
double kv_cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                      bool mla_latent = true);

// Per layer, causal prefill of `seq` tokens (windows applied).
double prefill_flops_per_layer(const ModelShape& m, int64_t seq, int64_t layer = 0);
// Per layer, one decode token over `context` cached tokens (windows applied).
double decode_flops_per_layer(const ModelShape& m, int64_t context, int64_t layer = 0,
                              bool mla_absorbed = true);
// Bytes a decode step must read per layer for `batch` sequences: the
// projection weights once (weight_dtype) plus every sequence's K/V.
double decode_bytes_per_layer(const ModelShape& m, int64_t context, int64_t batch, DType kv_dtype,
                              DType weight_dtype, int64_t layer = 0);

// "What if" variants of a model, as in the seeds' sweeps.
// The same model with n kv heads (n must divide num_heads; not for MLA).
Result<ModelShape> with_kv_heads(const ModelShape& m, int64_t num_kv_heads);
// The same model's attention replaced by MLA with the given ranks (q_lora_rank
// 0 = direct q_proj; qk split: head_dim - rope_dim nope + rope_dim rope).
Result<ModelShape> with_mla(const ModelShape& m, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                            int64_t q_lora_rank = 0);

// The valid kv-head counts of a model: the divisors of num_heads.
std::vector<int64_t> valid_kv_head_counts(int64_t num_heads);

}  // namespace attnkit
