// attnkit/attention.h — scaled dot-product attention with FlashAttention's
// semantics, for MHA, MQA and GQA alike.
//
// Contract of sdpa():
//   q    [batch, seqlen_q, num_heads,    head_dim]    f32
//   k    [batch, seqlen_k, num_kv_heads, head_dim]    f32, bf16, int8 or fp8_e4m3
//   v    [batch, seqlen_k, num_kv_heads, head_dim_v]  same dtype as k
// (int8 and fp8_e4m3 K/V come with their scales, options.k_scales /
// v_scales: as a KVCache stores them, kv_cache.h)
//   out  [batch, seqlen_q, num_heads,    head_dim_v]  f32, written
//   lse  [batch, num_heads, seqlen_q]                 f32, optional, written
//   probs[batch, num_heads, seqlen_q, seqlen_k]       f32, optional, written
// Any strides are accepted; out must not overlap the inputs.
//
// Grouping: num_heads % num_kv_heads == 0 and query head h reads kv head
// h / (num_heads / num_kv_heads). K and V are never copied per query head.
//
// Per batch b let L = seqlens_k[b] (or seqlen_k) be the number of valid keys.
// Query row i sits at key position p(i) = i + L - seqlen_q (bottom-right
// alignment, as FlashAttention >= 2.1 and its cache_seqlens). Key j is
// visible to row i when all of these hold:
//   j < L
//   causal            => j <= p(i)
//   window.left >= 0  => j >= p(i) - window.left
//   window.right >= 0 => j <= p(i) + window.right
//   chunk_size C > 0  => j / C == p(i) / C             (chunked local attention)
//   sparse pattern    => the pattern admits (p(i), j)   (see SparsePattern)
//   bool mask         => mask[b, h, i, j] is true
//
//   seqlen_q = 3, seqlen_k = 5, causal:      window (1, 0), not causal:
//          k: 0 1 2 3 4                       k: 0 1 2 3 4
//     q0 (p=2) x x x . .                q0 (p=2) . x x . .
//     q1 (p=3) x x x x .                q1 (p=3) . . x x .
//     q2 (p=4) x x x x x                q2 (p=4) . . . x x
//
// Score of a visible pair: s = softmax_scale * q.k; with softcap c > 0,
// s = c * tanh(s / c); then an additive mask is added. Scores of -inf count
// as masked. out[i] = sum_j softmax(s)_j v_j, accumulated in fp32 or wider.
// A row with no visible key gets out = 0, lse = -inf and probs = 0, never
// NaN. Masked keys are never read, so NaN or Inf in their K/V cannot leak.
//
// Sinks (gpt-oss; FlashAttention's and FlashInfer's `sinks`): with
// options.sinks, head h's logit sink_h joins every row's denominator and is
// then dropped: out[i] = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink_h)),
// and lse = log(sum_j e^(s_j) + e^(sink_h)), the denominator used (so
// out * e^lse is still the unnormalised sum: to split keys across calls and
// merge, pass the sinks to one call only). probs are the row's
// probabilities without the sink's, so they sum to less than 1. A row with
// no visible key gets out = 0 and lse = sink_h.
#pragma once

#include <cstdint>
#include <span>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

// Which implementation runs. kAuto takes the fast kernel where one exists
// for the case and the reference otherwise; ATTNKIT_BACKEND=reference in the
// environment forces the reference for every kAuto call in the process.
enum class Backend : uint8_t { kAuto, kReference, kFast };

// Inclusive sliding window, as FlashAttention's window_size: key j is
// visible from query position p when p - left <= j <= p + right; -1 means
// unlimited on that side.
struct WindowSize {
  int64_t left = -1;
  int64_t right = -1;
};

// The Sparse Transformer's factorised patterns (Child et al., 2019), with
// positions grouped into blocks of `block_size` tokens (1 = the paper's token
// level; 16, 32, ... = the block-sparse kernels' level). With a = query
// block, b = key block, l = stride (in blocks), c = summary (in blocks):
//   kStrided: |a - b| < l  or  (a - b) mod l == 0
//   kFixed:   a / l == b / l  or  b mod l >= l - c
// The pattern is the union of the paper's two heads' subsets; combine with
// `causal` for the autoregressive form. It is evaluated in closed form and
// never materialised.
struct SparsePattern {
  enum class Kind : uint8_t { kNone, kStrided, kFixed };
  Kind kind = Kind::kNone;
  int64_t block_size = 1;
  int64_t stride = 0;   // l >= 1
  int64_t summary = 1;  // c, kFixed only, 1 <= c <= l
};

struct AttentionOptions {
  // Multiplies q.k; 0 means the default 1/sqrt(head_dim).
  float softmax_scale = 0.0f;
  bool causal = false;
  WindowSize window_size;
  // Logit soft-capping (Gemma-2): 0 = off, else > 0.
  float softcap = 0.0f;
  // [batch] number of valid keys per batch item, each in [0, seqlen_k].
  // Empty = every item uses seqlen_k.
  std::span<const int32_t> seqlens_k;
  // Optional explicit mask, rank 4 and broadcastable to
  // [batch, num_heads, seqlen_q, seqlen_k] (size-1 dims broadcast):
  // dtype kBool = keep where true; dtype kF32 = additive bias.
  TensorView mask;
  SparsePattern sparse;
  // Chunked local attention (Llama 4): query position p sees key j only
  // when j / chunk_size == p / chunk_size. 0 = off, else > 0.
  int64_t chunk_size = 0;
  // [num_heads] f32, contiguous or strided: one learned sink logit per query
  // head, each finite (see the contract above). Absent = no sinks.
  TensorView sinks;
  // 8-bit K/V (k.dtype int8 or fp8_e4m3; sdpa only): the fp32 scale of
  // every row, [batch, seqlen_k, num_kv_heads, 1] each, any strides: element
  // (b, j, h, c) of k is code * k_scales[b, j, h, 0], the code the int8 or
  // the E4M3 value (v likewise). kv_cache_scales_view() gives them for
  // buffers in a KVCache's layout. Absent otherwise.
  TensorView k_scales, v_scales;
  // Attention over per-query key indices (FlashMLA's sparse interface,
  // DeepSeek-V3.2's DSA; sdpa only): [batch, seqlen_q, topk] int32, any
  // strides. Row i of batch item b attends to exactly the keys
  // key_indices[b, i, :] names (each in [0, L), L = seqlens_k[b] or
  // seqlen_k, and <= p(i) when causal; -1 = an unused slot; a key named
  // twice counts twice). Keys are read in place, never gathered. With
  // key_indices, mask, sparse, window_size, chunk_size, sinks and probs
  // must be absent (the indices are the visibility). Absent = dense.
  TensorView key_indices;
  Backend backend = Backend::kAuto;
  // Worker threads; 0 = ATTNKIT_NUM_THREADS or all available cores.
  int num_threads = 0;
};

Status sdpa(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
            const AttentionOptions& options = {}, const TensorView& lse = {},
            const TensorView& probs = {});

// Attention over a batch of sequences of different lengths packed along
// one token axis, as FlashAttention's flash_attn_varlen_func:
//   q    [total_q, num_heads,    head_dim]    f32
//   k    [total_k, num_kv_heads, head_dim]    f32 or bf16
//   v    [total_k, num_kv_heads, head_dim_v]  same dtype as k
//   out  [total_q, num_heads,    head_dim_v]  f32, written
//   lse  [num_heads, total_q]                 f32, optional, written
//   probs[n, num_heads, max_seqlen_q, max_seqlen_k]  f32, optional, written
//        (entries past a sequence's own lengths are 0)
// cu_seqlens_q and cu_seqlens_k hold n + 1 offsets: sequence s has query
// rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and key rows [cu_seqlens_k[s],
// cu_seqlens_k[s + 1]); each starts at 0, never decreases and ends at
// total_q (total_k). Every sequence is an sdpa() batch item of its own
// lengths: bottom-right causal alignment, windows, softcap, the sparse
// pattern and masks apply per sequence; a mask broadcasts to [n, num_heads,
// max_seqlen_q, max_seqlen_k] with the sequence's own row and key indices.
// options.seqlens_k must be empty (cu_seqlens_k gives the key counts).
Status sdpa_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                   std::span<const int32_t> cu_seqlens_q, std::span<const int32_t> cu_seqlens_k,
                   const TensorView& out, const AttentionOptions& options = {},
                   const TensorView& lse = {}, const TensorView& probs = {});

// Merges two partial attentions over disjoint key sets into the attention
// over their union (FlashInfer's merge_state):
//   out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m))
//   lse = m + log(e^(lse_a - m) + e^(lse_b - m)),  m = max(lse_a, lse_b)
// out_a/out_b/out [batch, seqlen_q, num_heads, head_dim_v] f32;
// lse_a/lse_b/lse [batch, num_heads, seqlen_q] f32. out may alias out_a and
// lse may alias lse_a. Rows with lse = -inf on both sides give out = 0.
Status merge_attention_states(const TensorView& out_a, const TensorView& lse_a,
                              const TensorView& out_b, const TensorView& lse_b,
                              const TensorView& out, const TensorView& lse);

}  // namespace attnkit
