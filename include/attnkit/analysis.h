// attnkit/analysis.h — exact arithmetic about attention variants on real
// model shapes: parameters, KV-cache bytes, FLOPs, arithmetic intensity.
// No timing here; the tool combines these with measured machine figures.
//
// Counting conventions (stated once, used everywhere; docs/ANALYSIS.md has
// the same rules with worked numbers):
// - Every figure is summed layer by layer from the layer's kind
//   (ModelShape::layers): softmax or MLA attention, full, sliding or
//   chunked, or a Gated DeltaNet linear-attention layer.
// - Attention parameters of one layer: the q/k/v/o projection weights, the
//   biases that exist, qk-norm gains (Qwen3, Gemma 3, Qwen3-Next; Llama 4's
//   L2 norm has none), one sink logit per query head (gpt-oss), the gate
//   half of q_proj (Qwen3-Next's output gate) and, for MLA, its factors and
//   their RMSNorm gains. A Gated DeltaNet layer counts in_proj_qkvz,
//   in_proj_ba, the depthwise conv, dt_bias, A_log, its norm gain and
//   out_proj. Block-level norms and the feed-forward are not counted.
// - KV values per token per layer: num_kv_heads * (head_dim + head_dim_v)
//   for MHA/GQA/MQA; kv_lora_rank + qk_rope_head_dim for MLA's latent cache;
//   num_heads * (qk_nope + qk_rope + v_head_dim) for MLA's naive cache.
// - Tokens a layer holds at a context of L tokens: L (full attention);
//   min(L, W) (sliding window W); min(L, C) (chunked attention, chunk C:
//   the upper bound, what a cache must reserve for the current chunk, not
//   the L mod C tokens the chunk happens to hold); none (Gated DeltaNet).
// - A Gated DeltaNet layer holds a fixed state per sequence instead:
//   GatedDeltaNetConfig::state_values() + conv_state_values() values, f32
//   unless said otherwise (the recurrence accumulates in f32).
// - FLOPs count a multiply-add as 2. Prefill is causal over S tokens:
//   2 * S * (projection weights) + 2 * num_heads * (head_dim + head_dim_v) *
//   (visible query-key pairs), pairs counted within the window or within
//   each chunk. Decode is one new token over the L' tokens the layer holds:
//   2 * (projection weights) + 2 * num_heads * (head_dim + head_dim_v) * L',
//   or for absorbed MLA 2 * H * (d_c + d_r) * L' + 2 * H * d_c * L'.
//   A Gated DeltaNet layer costs the same per token in prefill and decode:
//   2 * (projection weights) + 2 * conv channels * conv_kernel + 7 *
//   num_v_heads * key_head_dim * value_head_dim (the state's decay 1, its
//   read S^T k 2, its rank-1 write 2 and the output S^T q 2); elementwise
//   work (norms, gates, softmax) is not counted, for any kind.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/model_spec.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

// What mixes tokens in one layer, as the analysis counts it.
enum class MixerKind : uint8_t {
  kAttention,      // the model's attention: MHA/GQA/MQA, or MLA when ModelShape::mla
  kGatedDeltaNet,  // linear attention with a fixed state (LayerShape::linear)
};

// One layer as the analysis sees it. Sizes of the attention (heads,
// head_dim, MLA ranks) are the model's (ModelShape); what differs from
// layer to layer is here.
struct LayerShape {
  MixerKind kind = MixerKind::kAttention;
  int64_t sliding_window = 0;  // kAttention: W > 0 = sees itself and W - 1 before it
  int64_t chunk_size = 0;      // kAttention: C > 0 = sees its own chunk of C only
  bool use_rope = true;        // false = NoPE (Llama 4's global layers)
  bool sinks = false;          // one learned sink logit per query head (gpt-oss)
  bool output_gate = false;    // q_proj also emits a sigmoid gate (Qwen3-Next)
  GatedDeltaNetConfig linear;  // kGatedDeltaNet
  bool operator==(const LayerShape& o) const;
};

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
  bool qk_norm = false;  // q_norm / k_norm carry a gain of head_dim each
  bool causal = true;
  // MLA (DeepSeek-V2/V3, Kimi-K2); mla == false for every other model.
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0 = direct q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool rope_interleave = true;  // RoPE pairing of the rope features (MlaConfig's)
  // Layer by layer, layer 0 first: num_layers entries, or none, which
  // means every layer is plain full attention (shapes built by hand).
  std::vector<LayerShape> layers;
  int64_t max_position_embeddings = 0;
  std::string source;  // where the numbers come from
  // What the figures leave out, so that the tools can say so:
  // quantization_config's quant_method ("" = none; weights are counted in
  // the dtype a figure names, never quantized).
  std::string weight_quantization;
  // DeepSeek sparse attention (DSA, deepseek_v32): index_topk > 0 gives
  // every MLA layer a lightning indexer of index_n_heads heads of
  // index_head_dim. The figures above count such a model as dense MLA,
  // except its cache bytes, which hold the indexer keys too; dsa_* below
  // count the sparse path.
  int64_t index_topk = 0;
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
};

// The layer `layer` of a model (a plain full-attention layer when
// m.layers is empty or `layer` is out of range).
LayerShape layer_shape(const ModelShape& m, int64_t layer);

// A ModelSpec (model_spec_from_json) as the analysis sees it. The attention
// layers must agree on their sizes (heads, head_dim, MLA ranks, biases):
// every published model does; one that does not is an error naming the
// layer.
Result<ModelShape> model_shape_from_spec(const ModelSpec& spec);

// Reads a Hugging Face config.json through the one reader
// (model_spec_from_json; docs/MODELS.md lists the families and their
// per-layer rules) and returns model_shape_from_spec of it. Errors name
// model_shape_from_json, the field, its value and the rule.
Result<ModelShape> model_shape_from_json(std::string_view json_text);

// Built-in presets (facts and sources in docs/ANALYSIS.md). Names are
// matched case-insensitively: "llama-3-8b", "Llama-3-8B", "deepseek-v3", ...
std::vector<std::string> preset_names();
Result<ModelShape> model_preset(std::string_view name);
// The Hugging Face-style config.json text a preset is built from.
Result<std::string> preset_config_json(std::string_view name);

// Tokens layer `layer` holds at a context of `context` tokens (the rules
// above; 0 for a Gated DeltaNet layer).
int64_t tokens_held(const ModelShape& m, int64_t layer, int64_t context);

// Parameters of layer `layer`'s token mixer: its attention with the layer's
// sinks and gate, or its Gated DeltaNet.
int64_t layer_params(const ModelShape& m, int64_t layer);
// Parameters of one attention layer: the first attention layer's (plain
// attention when the model has none).
int64_t attention_params_per_layer(const ModelShape& m);
// layer_params summed over all layers.
int64_t attention_params_total(const ModelShape& m);
// Per attention layer. MLA: latent = true counts the latent cache, false
// the naive per-head cache.
int64_t kv_values_per_token_per_layer(const ModelShape& m, bool mla_latent = true);
// Bytes of K/V for one token across the layers that hold K/V (no window or
// chunk cap; Gated DeltaNet layers hold none); the 8-bit types (int8,
// fp8_e4m3) count their fp32 scales too, as the caches store them: one per
// kv head row of K and of V, one per 64 channels of an MLA latent row
// (kv_cache.h).
int64_t kv_bytes_per_token(const ModelShape& m, DType kv_dtype, bool mla_latent = true);
// Bytes of the whole K/V cache for `batch` sequences of `context` tokens,
// each layer holding tokens_held() tokens. A double, because user-given
// contexts and batches multiply past 2^63 (2e9 tokens x 2e9 sequences):
// exact up to 2^53 bytes (8 PiB), within two roundings above, never capped.
// The Gated DeltaNet state is not K/V: see linear_state_bytes.
double kv_cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                      bool mla_latent = true);
// Bytes of the fixed per-sequence state of layer `layer` (its recurrent
// state and conv inputs; 0 for an attention layer), in `state_dtype`.
int64_t linear_state_bytes_per_layer(const ModelShape& m, int64_t layer,
                                     DType state_dtype = DType::kF32);
// The fixed state of every Gated DeltaNet layer for `batch` sequences, in
// `state_dtype`; independent of the context.
double linear_state_bytes(const ModelShape& m, int64_t batch, DType state_dtype = DType::kF32);
// What a model keeps per sequence while decoding: kv_cache_bytes plus the
// linear state in f32.
double cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                   bool mla_latent = true);

// Per layer, causal prefill of `seq` tokens (window or chunks applied; a
// Gated DeltaNet layer: seq times its per-token cost).
double prefill_flops_per_layer(const ModelShape& m, int64_t seq, int64_t layer = 0);
// Per layer, one decode token over the tokens the layer holds at `context`.
double decode_flops_per_layer(const ModelShape& m, int64_t context, int64_t layer = 0,
                              bool mla_absorbed = true);
// Bytes a decode step must read per layer for `batch` sequences: the
// projection weights once (weight_dtype) plus every sequence's K/V (or,
// for a Gated DeltaNet layer, its f32 state).
double decode_bytes_per_layer(const ModelShape& m, int64_t context, int64_t batch, DType kv_dtype,
                              DType weight_dtype, int64_t layer = 0);

// The per-layer figures summed over all layers, for `batch` sequences.
struct ModelTotals {
  double prefill_flops = 0;  // prefill of `context` tokens per sequence
  double decode_flops = 0;   // one decode step over `context` tokens per sequence
  double decode_bytes = 0;   // what that step reads
};
ModelTotals model_totals(const ModelShape& m, int64_t context, int64_t batch, DType kv_dtype,
                         DType weight_dtype);

// Layers that share one description, in the order they first appear.
struct LayerGroup {
  LayerShape shape;
  // "full", "sliding 128", "chunked 8192", "full NoPE", "full (gated)",
  // "Gated DeltaNet".
  std::string label;
  std::vector<int64_t> layers;  // their indices
};
std::vector<LayerGroup> layer_groups(const ModelShape& m);
// "24 layers: 12 sliding 128, 12 full" (layer_groups' labels and counts).
std::string layer_mix(const ModelShape& m);
// A stack of the first n layers of m (n >= 1), the model's pattern repeated
// past its last layer: what a benchmark of n layers runs.
ModelShape first_layers(const ModelShape& m, int64_t n);

// One layer group's figures at a context and batch.
struct LayerGroupFigures {
  std::string label;
  int64_t count = 0;             // layers in the group
  int64_t tokens_held = 0;       // per layer and sequence (0 for Gated DeltaNet)
  int64_t params_per_layer = 0;  // layer_params
  // Summed over the group's layers and the batch:
  double kv_bytes = 0;       // K/V in kv_dtype
  double state_bytes = 0;    // Gated DeltaNet state in f32
  double prefill_flops = 0;  // prefill of `context` tokens
  double decode_flops = 0;   // one decode step
};
std::vector<LayerGroupFigures> layer_group_figures(const ModelShape& m, DType kv_dtype,
                                                   int64_t context, int64_t batch);

// DeepSeek sparse attention against dense MLA, per DSA layer (model
// with index_topk = k > 0; Hi = index_n_heads, Di = index_head_dim):
// - indexer weights: wq_b [Hi*Di, q_lora_rank], wk [Di, hidden], k_norm
//   gain and bias [Di] each, weights_proj [Hi, hidden];
// - indexer key per token: Di fp8 codes + one f32 scale per 128 values,
//   stored beside the latent row (counted in kv_bytes_per_token and
//   kv_cache_bytes of such a model);
// - a call in which no query sees more than k keys runs dense MLA's path
//   plus the new tokens' indexer keys (2 * Di * hidden FLOPs a token);
// - otherwise per query over L visible keys: the indexer's projections
//   (2 * its weights), its scores 2 * Hi * Di * L + 2 * Hi * L (dot
//   products, then the weighted sum of the ReLUs), and absorbed MLA over
//   the min(k, L) chosen rows, 2 * H * (2 d_c + d_r) FLOPs each; a decode
//   step reads the weights (dense + indexer) once and, per sequence, L
//   indexer keys plus k latent rows. Prefill over S tokens scores every
//   causal pair with the indexer and attends to sum_t min(k, t + 1) pairs,
//   against dense MLA's prefill (naive form) above. The top-k selection
//   itself (O(L) compares) is not counted, as no elementwise work is.
int64_t indexer_params(const ModelShape& m);
int64_t indexer_key_bytes_per_token(const ModelShape& m);

// One DSA layer at a context, for `batch` sequences, dense vs sparse.
struct DsaLayerFigures {
  int64_t context = 0;
  double dense_prefill_flops = 0, dsa_prefill_flops = 0;  // prefill of `context` tokens
  double dense_decode_flops = 0, dsa_decode_flops = 0;    // one decode step at `context`
  double dsa_indexer_decode_flops = 0;                    // of which the indexer's scores
  double dense_decode_bytes = 0, dsa_decode_bytes = 0;    // what that step reads
};
DsaLayerFigures dsa_layer_figures(const ModelShape& m, int64_t context, int64_t batch,
                                  DType kv_dtype, DType weight_dtype);

// The smallest context at which DSA costs less than dense MLA by each
// measure (decode FLOPs, decode bytes at `batch`, prefill FLOPs), or 0
// when it does not below 2^40 tokens. DSA never pays at or below
// index_topk (it runs the dense path and computes the keys too).
struct DsaCrossover {
  int64_t decode_flops = 0, decode_bytes = 0, prefill_flops = 0;
};
DsaCrossover dsa_crossover(const ModelShape& m, int64_t batch, DType kv_dtype, DType weight_dtype);

// "What if" variants of a model, as in the seeds' sweeps.
// Both keep every layer's kind, window and chunk.
// The same model with n kv heads (n must divide num_heads; not for MLA).
Result<ModelShape> with_kv_heads(const ModelShape& m, int64_t num_kv_heads);
// The same model's attention replaced by MLA with the given ranks (q_lora_rank
// 0 = direct q_proj; qk split: head_dim - rope_dim nope + rope_dim rope);
// sinks and output gates go with the attention they belonged to; Gated
// DeltaNet layers stay.
Result<ModelShape> with_mla(const ModelShape& m, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                            int64_t q_lora_rank = 0);

// The valid kv-head counts of a model: the divisors of num_heads.
std::vector<int64_t> valid_kv_head_counts(int64_t num_heads);

}  // namespace attnkit
