// attnkit/attention_layer.h — the MHA / MQA / GQA attention layer.
//
// One code path for all three: q_proj [num_heads*head_dim, hidden],
// k_proj/v_proj [num_kv_heads*head_dim, hidden], o_proj [hidden,
// num_heads*head_dim] (Hugging Face names, nn.Linear layout), optional
// biases, optional per-head q/k RMSNorm (Qwen3: q_norm.weight,
// k_norm.weight [head_dim]), RoPE on q and k, then sdpa.
//
// forward() order for x [batch, seq, hidden]:
//   q = x Wq^T (+bq), k = x Wk^T (+bk), v = x Wv^T (+bv)
//   qk_norm: q_h = RMSNorm(q_h) * q_norm, k_h = RMSNorm(k_h) * k_norm
//   RoPE(q, positions), RoPE(k, positions)
//   o = sdpa(q, k, v) (causal per config, window per config, via the cache
//       if one is given)
//   out = o Wo^T (+bo)
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
  // k_proj.bias, v_proj.bias, o_proj.bias, q_norm.weight, k_norm.weight.
  std::vector<std::string> weight_names() const;

  // Copies every expected weight `prefix + name` from `weights`. The four
  // projection matrices keep a bf16 source as bf16 (no f32 copy: half the
  // memory, and the projections run as bf16 GEMMs with fp32 accumulation,
  // their inputs rounded to bf16; see kernels/linear.h); every other source
  // dtype, and the biases and norms, become f32. Strict: a missing name, a
  // wrong shape or dtype, or an unexpected name under `prefix` is an error,
  // and then no weight changes.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");

  // Views of the layer's own weights by unprefixed name (tests, tools), in
  // the dtype they are kept in: f32, or bf16 for projections loaded from
  // bf16.
  Result<TensorView> weight(std::string_view name) const;

  // A cache sized for this layer (its window, kv heads and head dim).
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
  //   and softcap default to the layer's. RoPE, if configured, uses
  //   positions 0..seqlen-1 on each side. probs, if present, receives
  //   [batch, num_heads, seqlen_q, seqlen_k].
  Status forward_qkv(const TensorView& query, const TensorView& key, const TensorView& value,
                     const TensorView& out, const AttentionOptions& options = {},
                     const TensorView& probs = {});

  // A pool shaped for this layer (its kv heads, head dim and window) with
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
  // layer must be causal and the pool's shape and window this layer's.
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
  // o_proj into out.
  Status compute(const char* fn, const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions, int64_t first_position, const RunOptions& run,
                 bool gemv_for_one_row, const AttendFn& attend) const;
  // softmax_scale and softcap from the config, backend and threads from run.
  AttentionOptions attention_options(const RunOptions& run) const;

  AttentionConfig config_;
  Rope rope_;
  // Projections in nn.Linear layout, f32 or bf16 (as loaded).
  Tensor wq_, wk_, wv_, wo_;
  Tensor bq_, bk_, bv_, bo_;  // f32, present when configured
  Tensor q_norm_, k_norm_;    // present when qk_norm
};

}  // namespace attnkit
