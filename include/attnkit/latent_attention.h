// attnkit/latent_attention.h — DeepSeek's multi-head latent attention (MLA),
// the attention of DeepSeek-V2 / V2-Lite / V3 and Kimi-K2.
//
// Symbols (DeepSeek-V3 values): d = hidden_size (7168), H =
// num_attention_heads (128), d_q = q_lora_rank (1536; 0 = no query
// compression), d_c = kv_lora_rank (512), d_n = qk_nope_head_dim (128),
// d_r = qk_rope_head_dim (64), d_v = v_head_dim (128), d_qk = d_n + d_r.
//
// Weights, Hugging Face names, nn.Linear layout [out, in], no biases:
//   q_a_proj.weight            [d_q, d]           only when d_q > 0
//   q_a_layernorm.weight       [d_q]              only when d_q > 0
//   q_b_proj.weight            [H*d_qk, d_q]      only when d_q > 0
//   q_proj.weight              [H*d_qk, d]        only when d_q = 0
//   kv_a_proj_with_mqa.weight  [d_c + d_r, d]     rows: latent, then rope key
//   kv_a_layernorm.weight      [d_c]
//   kv_b_proj.weight           [H*(d_n+d_v), d_c] per head: d_n key rows, then d_v value rows
//   o_proj.weight              [d, H*d_v]
//
// With DeepSeek-V3.2's sparse attention (config.index_n_heads > 0; Hi =
// index_n_heads, Di = index_head_dim), the lightning indexer's weights too:
//   indexer.wq_b.weight         [Hi*Di, d_q]
//   indexer.wk.weight           [Di, d]
//   indexer.k_norm.weight       [Di]               LayerNorm gain
//   indexer.k_norm.bias         [Di]               LayerNorm bias
//   indexer.weights_proj.weight [Hi, d]
// and each query attends only to the index_topk keys the indexer ranks
// best among those it sees (attnkit/sparse_attention.h has the indexer's
// math). A call in which no query sees more than index_topk keys selects
// them all and runs exactly the dense path. Otherwise attention runs in the
// absorbed form over the selected latent rows, read in place.
//
// forward() for token t at position p (each query head h):
//   q_t        = q_b_proj(RMSNorm(q_a_proj x_t))   (or q_proj x_t)   [H, d_qk] = [nope | rope]
//   [c~ ; k~]  = kv_a_proj_with_mqa x_t;  c_t = RMSNorm(c~)          [d_c], k~: [d_r]
//   q_rope_h   = RoPE(q_t,h[d_n:], p);    k_rope_t = RoPE(k~, p)     one key shared by all heads
//   k_t,h      = [W_UK_h c_t ; k_rope_t],  v_t,h = W_UV_h c_t       (W_UK_h, W_UV_h from kv_b_proj)
//   o_t,h      = sum_s softmax_s(sigma * q_t,h . k_s,h) v_s,h        causal
//   out_t      = o_proj [o_t,1 ; ... ; o_t,H]
// RoPE pairs features (2i, 2i+1) as DeepSeek's checkpoints do
// (rope_interleave = true, the default), or (i, i + d_r/2) when a config sets
// rope_interleave = false, as Hugging Face's DeepSeek-V3 then does; YaRN's
// frequency correction applies in both when configured.
// sigma = d_qk^-1/2 * m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1
// under YaRN (m = 1 otherwise, or when mscale_all_dim is absent); the cos/sin
// amplitude is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
// both are given (exactly 1 in every released config), else 1.
//
// Two forms compute the same function (docs/MLA.md):
//   naive:    decompress per-head K [S, H, d_qk] and V [S, H, d_v] from the
//             latents, then attention with head_dim d_qk, head_dim_v d_v.
//   absorbed: per head fold W_UK into the query (q^ = W_UK_h^T q_nope) and
//             W_UV into the output; attention is then one-KV-head attention
//             over the latent rows themselves: key [c ; k_rope] (d_c + d_r),
//             value c (d_c), same sigma.
// kAuto picks naive for prefill-like calls and absorbed for decode-like
// calls by an estimate of their cost (docs/MLA.md has the measurements).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/config.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/rope.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit {

// validate(MlaConfig), mla_softmax_scale, mla_config_from_json and MlaForm
// live in attnkit/config.h.

// The per-layer latent cache: for every token only the RMS-normed latent
// c (d_c) and the rotated shared rope key (d_r), contiguous per token:
//   storage [batch, max_seq_len, d_c + d_r]   f32, bf16, int8 or fp8_e4m3
// The absorbed form attends over these rows directly (key = the whole row,
// value = its first d_c values); the naive form decompresses them.
// All sequences of a batch advance together; token t lives in row t.
// The 8-bit types quantize each block of 64 channels of a row once, when
// it is written, with one fp32 scale (value = code * scale; as KVCache,
// include/attnkit/kv_cache.h): the latent's channels carry gains of their
// own and the rope part outliers, which one scale per row would spread
// over every channel. A token's scales follow its codes in its row;
// storage() is then strided and scales() views the scales.
class LatentCache {
 public:
  int64_t batch_size() const { return view_.shape[0]; }
  int64_t max_seq_len() const { return view_.shape[1]; }
  int64_t kv_lora_rank() const { return kv_lora_rank_; }
  int64_t qk_rope_head_dim() const { return qk_rope_head_dim_; }
  int64_t values_per_token() const { return view_.shape[2]; }  // d_c + d_r
  DType dtype() const { return view_.dtype; }
  int64_t length() const { return length_; }  // tokens appended so far
  // Bytes of the values (and the 8-bit types' scales) the cache can hold.
  size_t nbytes() const;
  // [batch, max_seq_len, d_c + d_r]; rows >= length() are unspecified.
  const TensorView& storage() const { return view_; }
  // 8-bit types: [batch, max_seq_len, ceil((d_c + d_r) / 64)] f32, the
  // scales of storage()'s rows; absent otherwise.
  const TensorView& scales() const { return scales_; }
  // Sparse attention (config.index_n_heads > 0) only, else absent: every
  // token's indexer key, fp8 codes [batch, max_seq_len, index_head_dim]
  // and their scales [batch, max_seq_len, index_head_dim / 128] f32.
  const TensorView& index_keys() const { return index_keys_; }
  const TensorView& index_scales() const { return index_scales_; }

  // Forgets every token (storage is kept).
  void reset() { length_ = 0; }

  // Appends T tokens' rows exactly as forward() caches them, to restore a
  // saved cache or share a computed prefix:
  //   rows [batch, T, d_c + d_r] f32, any strides: [normed latent ; rotated
  //   rope key] per token (rounded to bf16 for a bf16 cache).
  // Fails with kOutOfRange, changing nothing, when length() + T >
  // max_seq_len(); fails for a sparse-attention cache (its indexer keys
  // cannot be derived from the latent rows).
  Status append(const TensorView& rows);

 private:
  friend class LatentAttention;
  LatentCache() = default;
  void write_row(int64_t b, int64_t t, const float* x, int64_t stride);

  int64_t kv_lora_rank_ = 0;
  int64_t qk_rope_head_dim_ = 0;
  int64_t length_ = 0;
  Tensor storage_;  // [batch, max_seq_len, row]
  TensorView view_, scales_;
  Tensor index_storage_;  // sparse attention: codes, then scales
  TensorView index_keys_, index_scales_;
};

class LatentAttention {
 public:
  static Result<LatentAttention> create(const MlaConfig& config);

  const MlaConfig& config() const { return config_; }
  double softmax_scale() const { return softmax_scale_; }
  const Rope& rope() const { return rope_; }

  // Names this layer expects, without prefix (see the table above).
  std::vector<std::string> weight_names() const;

  // Copies every expected weight `prefix + name` from `weights`. The
  // projection matrices (*_proj*) keep a bf16 source as bf16, no f32 copy,
  // as AttentionLayer::load_weights; every other source dtype, and the two
  // norms, become f32. Strict: a missing name, a wrong shape or dtype, or
  // an unexpected name under `prefix` is an error, and then no weight
  // changes.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");
  bool has_weights() const { return loaded_; }

  // Views of the layer's own weights by unprefixed name, in the dtype they
  // are kept in (f32, or bf16 for projections loaded from bf16).
  Result<TensorView> weight(std::string_view name) const;

  // A latent cache for this layer; dtype kF32, kBF16, kI8 or kFp8E4M3.
  Result<LatentCache> new_cache(int64_t batch_size, int64_t max_seq_len,
                                DType dtype = DType::kF32) const;

  // Causal self-attention over x [batch, seq, hidden] f32 (contiguous) into
  // out (same shape, contiguous, must not overlap x). positions: empty =
  // (cache ? cache->length() : 0) + t; or [seq] shared by the batch; or
  // [batch*seq]; each >= 0 (RoPE only: visibility follows the cache order).
  // With a cache, the new tokens' latents are appended and the queries see
  // every cached token and the new ones up to themselves; a call that would
  // pass max_seq_len fails with kOutOfRange. Any failure leaves out and the
  // cache untouched.
  Status forward(const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions = {}, LatentCache* cache = nullptr,
                 const RunOptions& run = {}, MlaForm form = MlaForm::kAuto);

  // The form kAuto takes for `new_tokens` queries over `cached_tokens`
  // earlier tokens (docs/MLA.md explains the cost model).
  MlaForm choose_form(int64_t new_tokens, int64_t cached_tokens) const;

  // A pool in the latent layout (kv_lora_rank + qk_rope_head_dim values per
  // token and layer; with sparse attention also the indexer key,
  // PagedKVCacheSpec::index_head_dim) with num_layers layers, for forward_batch().
  Result<PagedKVCache> new_paged_cache(int64_t num_pages, int64_t page_size = 16,
                                       int64_t num_layers = 1, DType dtype = DType::kF32) const;

  // One continuous-batching step over a latent pool, as
  // AttentionLayer::forward_batch: x, out [total_tokens, hidden] f32
  // (contiguous), sequence seq_ids[s] owning rows [cu_seqlens_q[s],
  // cu_seqlens_q[s + 1]) = its reserved tokens that layer `layer_index`
  // has not written, at positions written(id, layer) + i. Attention runs in
  // the absorbed form over the latent pages (every step, decode or prompt);
  // projections are GEMMs over all rows, never the one-row GEMV. With
  // sparse attention the pool must carry indexer keys (index_head_dim as
  // the config's): the new tokens' keys are stored in their slots, and
  // when some sequence then holds more than index_topk tokens, each query
  // attends to its sequence's top-k only (the indexer over that sequence's
  // keys, gathered from its pages; the latent rows read in place through
  // the page table); otherwise dense attention as above. A failed call
  // changes neither out nor the pool.
  Status forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                       std::span<const int64_t> seq_ids, PagedKVCache& cache, int64_t layer_index,
                       const TensorView& out, const RunOptions& run = {});

 private:
  // q [B*T, H, d_qk] and the new latent rows kv_new [B*T, d_c + d_r] of x
  // [B, T, hidden] (contiguous), RoPE at positions ([T] or [B*T]); cq
  // [B*T, q_lora_rank] is scratch (unused without query compression).
  Status project(const float* x, int64_t B, int64_t T, std::span<const int64_t> positions,
                 const RunOptions& run, bool gemv_for_one_row, float* cq, float* q,
                 float* kv_new) const;
  // qa [rows, H, d_c + d_r] = [W_UK_h^T q_nope ; q_rope] from q [rows, H, d_qk].
  void absorb_queries(const float* q, int64_t rows, float* qa, const RunOptions& run) const;
  // o [rows, H, d_v] = W_UV_h oa_h from the latent outputs oa [rows, H, d_c].
  void expand_values(const float* oa, int64_t rows, float* o, const RunOptions& run,
                     bool gemv_for_one_row) const;

  // Sparse attention: the indexer keys of x's T tokens, quantized into
  // codes [B, T, Di] and scales [B, T, Di / 128] at the given strides
  // (batch, row; codes in bytes, scales in floats); ik [B*T, Di] is scratch.
  // gemv_for_one_row as in LinearOptions: forward_batch passes false, so
  // that a lone decode row rounds its projection as a batched one does.
  Status index_keys(const float* x, int64_t B, int64_t T, std::span<const int64_t> positions,
                    const RunOptions& run, float* ik, uint8_t* codes, int64_t codes_bs,
                    int64_t codes_rs, float* scales, int64_t scales_bs, int64_t scales_rs,
                    bool gemv_for_one_row = true) const;
  // forward_batch's sparse attention: stores the indexer keys of the new
  // rows (x [total, hidden], positions [total]) in the pool; when some
  // sequence holds more than index_topk tokens, selects each query's keys,
  // stores the new latent rows kv_new [total, d_c + d_r] and attends from
  // the absorbed queries qa [total, H, d_c + d_r] into oa [total, H, d_c],
  // setting *attended; else leaves the attention to the caller.
  Status attend_paged_sparse(const float* x, const float* cq, std::span<const int64_t> positions,
                             std::span<const int32_t> cu_seqlens_q,
                             std::span<const int64_t> seq_ids, PagedKVCache& cache, int64_t layer,
                             const float* qa, const float* kv_new, float* oa, const RunOptions& run,
                             bool* attended) const;
  // Sparse attention: indexer queries (codes [B*T, Hi, Di], scales
  // [B*T, Hi, Di / 128]) and head weights w [B*T, Hi] from x and the normed
  // compressed query cq [B*T, d_q]; iq [B*T, Hi, Di] is scratch;
  // gemv_for_one_row as for index_keys.
  Status index_queries(const float* x, const float* cq, int64_t B, int64_t T,
                       std::span<const int64_t> positions, const RunOptions& run, float* iq,
                       uint8_t* codes, float* scales, float* w, bool gemv_for_one_row = true) const;

  struct Weights {
    // Projections f32 or bf16 (as loaded), norms f32.
    Tensor q_a, q_a_norm, q_b, q;  // q_a/q_a_norm/q_b when q_lora_rank > 0, else q
    Tensor kv_a, kv_a_norm, kv_b, o;
    // Sparse attention's indexer (absent for dense MLA).
    Tensor idx_wq_b, idx_wk, idx_k_norm, idx_k_norm_bias, idx_weights_proj;
  };

  MlaConfig config_;
  double softmax_scale_ = 0.0;
  Rope rope_;
  Rope index_rope_;  // the indexer's: half-split, no amplitude factor
  Weights w_;
  bool loaded_ = false;
};

}  // namespace attnkit
