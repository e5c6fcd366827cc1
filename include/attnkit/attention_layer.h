// attnkit/attention_layer.h — the MHA / MQA / GQA attention layer.
//
// One code path for all three and for the per-layer features of the
// 2025-26 families, each switched on by a field of AttentionConfig (never by
// model_type). Weights (Hugging Face names, nn.Linear layout):
//   q_proj.weight [num_heads*head_dim*(output_gate ? 2 : 1), hidden]
//   k_proj.weight, v_proj.weight [num_kv_heads*head_dim, hidden]
//   o_proj.weight [hidden, num_heads*head_dim]
//   q_proj.bias, k_proj.bias, v_proj.bias (qkv_bias), o_proj.bias (o_bias)
//   q_norm.weight, k_norm.weight [head_dim] (qk_norm kRms / kRmsOnePlus)
//   sinks [num_heads] (sinks; gpt-oss's self_attn.sinks)
//
// forward() order for x [batch, seq, hidden] at positions p:
//   q = x Wq^T (+bq); output_gate: per head h the rows are
//       [query (head_dim) | gate (head_dim)], split into q_h and g_h
//   k = x Wk^T (+bk), v = x Wv^T (+bv)
//   kRms:        q_h = RMSNorm(q_h) * q_norm,       k_h likewise  (Qwen3)
//   kRmsOnePlus: q_h = RMSNorm(q_h) * (1 + q_norm), k_h likewise  (Gemma 3,
//                Qwen3-Next; the weight is kept as stored)
//   RoPE(q, p), RoPE(k, p)                   (use_rope; NoPE skips it)
//   kL2:         q_h = RMSNorm(q_h), k_h = RMSNorm(k_h), no weight, after
//                RoPE (Llama 4)
//   temperature_tuning on a NoPE layer (use_rope false; Llama 4):
//                q *= log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1
//   o = attention(q, k, v): causal per config, sliding_window, chunk_size,
//       softcap, softmax_scale, sinks (via the cache if one is given)
//   output_gate: o_h *= sigmoid(g_h)
//   out = o Wo^T (+bo)
// docs/LAYERS.md walks through each family.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "attnkit/kv_cache.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/rope.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit {

class AttentionLayer {
 public:
  static Result<AttentionLayer> create(const AttentionConfig& config);

  const AttentionConfig& config() const { return config_; }

  // Names this layer expects, without prefix: q_proj.weight, k_proj.weight,
  // v_proj.weight, o_proj.weight, and where configured q_proj.bias,
  // k_proj.bias, v_proj.bias, o_proj.bias, q_norm.weight, k_norm.weight,
  // sinks.
  std::vector<std::string> weight_names() const;

  // Copies every expected weight `prefix + name` from `weights`. The four
  // projection matrices keep a bf16 source as bf16 (no f32 copy: half the
  // memory, and the projections run as bf16 GEMMs with fp32 accumulation,
  // their inputs rounded to bf16; see kernels/linear.h); every other source
  // dtype, and the biases and norms, become f32. Strict: a missing name, a
  // wrong shape or dtype, an unexpected name under `prefix`, or a sink that
  // is not finite is an error, and then no weight changes.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");

  // Views of the layer's own weights by unprefixed name (tests, tools), in
  // the dtype they are kept in: f32, or bf16 for projections loaded from
  // bf16.
  Result<TensorView> weight(std::string_view name) const;

  // A cache sized for this layer (its window or chunk, kv heads and head
  // dim).
  Result<KVCache> new_cache(int64_t batch_size, int64_t max_seq_len,
                            DType dtype = DType::kF32) const;

  // Self-attention over x [batch, seq, hidden] f32 into out (same shape; must
  // not alias x). positions: empty = (cache ? cache->length() : 0) + t;
  // [seq] shared by the batch or [batch*seq]; each >= 0 (RoPE only).
  // With a cache, the new tokens are appended and attend to everything
  // before them; the layer must have been configured causal.
  Status forward(const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions = {}, KVCache* cache = nullptr,
                 const RunOptions& run = {});

  // The seeds' form with separate inputs (self- or cross-attention):
  //   query [batch, seqlen_q, hidden], key/value [batch, seqlen_k, hidden],
  //   out [batch, seqlen_q, hidden]. `options` supplies masks (mask,
  //   seqlens_k as key padding, causal, window, sparse); its softmax_scale
  //   softcap, chunk_size and sinks default to the layer's. RoPE and
  //   temperature tuning, if configured, use positions 0..seqlen-1 on each
  //   side; qk-norm and the output gate apply as in forward(). probs, if
  //   present, receives
  //   [batch, num_heads, seqlen_q, seqlen_k].
  Status forward_qkv(const TensorView& query, const TensorView& key, const TensorView& value,
                     const TensorView& out, const AttentionOptions& options = {},
                     const TensorView& probs = {});

  // A pool shaped for this layer (its kv heads, head dim, window or chunk) with
  // num_layers layers, for forward_batch().
  Result<PagedKVCache> new_paged_cache(int64_t num_pages, int64_t page_size = 16,
                                       int64_t num_layers = 1, DType dtype = DType::kF32) const;

  // One continuous-batching step over a paged pool: the new tokens of n
  // sequences packed along one axis,
  //   x   [total_tokens, hidden]  f32 (hidden contiguous)
  //   out [total_tokens, hidden]  f32, written; must not alias x
  // Sequence seq_ids[s] owns rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]):
  // the tokens it reserved with cache.append() that layer `layer_index` of
  // the pool has not written yet, at positions written(id, layer) + i
  // (RoPE). Each projection is one GEMM over all rows (never the one-row
  // GEMV, so that batching changes no bits where
  // kernels::linear_rows_independent()); attention is cache.attend(). The
  // layer must be causal and the pool's shape this layer's; the pool's
  // sliding_window and chunk_size are this layer's, or 0 in a pool shared
  // by layers of several kinds (gpt-oss's, Gemma 3's, Llama 4's), where
  // the layer passes its own window and chunk with each call.
  // A failed call changes neither out nor the pool.
  Status forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                       std::span<const int64_t> seq_ids, PagedKVCache& cache, int64_t layer_index,
                       const TensorView& out, const RunOptions& run = {});

 private:
  // Runs attention on the projected q, k, v [batch, seq, heads, head_dim]
  // into o; compute() calls it between the projections and o_proj.
  using AttendFn =
      std::function<Status(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o)>;
  // Projections, qk-norm and RoPE of x [batch, seq, hidden] at `positions`
  // ([seq] or [batch * seq]; empty = first_position + t), attend(), then
  // the gate and o_proj into out.
  Status compute(const char* fn, const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions, int64_t first_position, const RunOptions& run,
                 bool gemv_for_one_row, const AttendFn& attend) const;
  // q (and, with output_gate, gate) [batch, seq, num_heads, head_dim] from
  // x [batch, seq, hidden]; gate is left empty without output_gate.
  Status project_q(const char* fn, const TensorView& x, const RunOptions& run,
                   bool gemv_for_one_row, Tensor* q, Tensor* gate) const;
  // In place on q [batch, seq_q, num_heads, head_dim] and k [batch, seq_k,
  // num_kv_heads, head_dim]: qk-norm, RoPE, the L2 norm after RoPE and
  // temperature tuning, at positions pos_q / pos_k ([seq] or [batch*seq]).
  Status position_qk(const char* fn, const Tensor& q, const Tensor& k,
                     std::span<const int64_t> pos_q, std::span<const int64_t> pos_k) const;
  // o [batch, seq, num_heads, head_dim] *= sigmoid(gate) (output_gate only).
  void apply_gate(const Tensor& o, const Tensor& gate) const;
  // softmax_scale, softcap and sinks from the config, backend and threads
  // from run.
  AttentionOptions attention_options(const RunOptions& run) const;

  AttentionConfig config_;
  Rope rope_;
  // Projections in nn.Linear layout, f32 or bf16 (as loaded); wq_ holds the
  // gate rows too under output_gate.
  Tensor wq_, wk_, wv_, wo_;
  Tensor bq_, bk_, bv_, bo_;  // f32, present when configured
  Tensor q_norm_, k_norm_;    // f32 [head_dim] as loaded (kRms, kRmsOnePlus)
  // f32 [head_dim]: the gains RMSNorm multiplies by: q_norm (kRms),
  // 1 + q_norm (kRmsOnePlus), ones (kL2); empty for kNone.
  Tensor q_gain_, k_gain_;
  Tensor sinks_;  // f32 [num_heads], present when configured
};

}  // namespace attnkit
