// attnkit/sparse_attention.h — DeepSeek-V3.2's sparse attention (DSA): the
// lightning indexer and its top-k selection, for engine builders. Attention
// over the selected keys is sdpa() with AttentionOptions::key_indices
// (attnkit/attention.h); LatentAttention runs the whole layer when its
// MlaConfig sets index_n_heads (attnkit/latent_attention.h).
//
// Semantics follow DeepSeek's V3.2 inference code (inference/model.py,
// class Indexer, at its Nov-2025 fix). Per token, with Hi = index_n_heads
// and Di = index_head_dim:
//   iq_t  = wq_b(c^Q_t)                 [Hi, Di]  c^Q = MLA's normed compressed query
//   ik_t  = LayerNorm(wk x_t)           [Di]      one key shared by all indexer heads
//   RoPE on the first qk_rope_head_dim features of every iq_t,h and ik_t,
//     pairing (i, i + d_r/2) (half-split; the release paired (2i, 2i+1) and
//     the fix changed it to match how the indexer was trained), MLA's
//     frequencies (YaRN included) without any amplitude factor;
//   Hadamard: v <- H v / sqrt(Di), H Sylvester's (Di a power of two);
//   fp8 E4M3 per block of 128 values (indexer_quantize below);
//   w_t,h = weights_proj(x_t)_h * Hi^-1/2 * Di^-1/2.
// Score of key s for query t (both dequantized: code * block scale):
//   score(t, s) = sum_h w_t,h * ReLU(iq_t,h . ik_s)
// which equals the reference's sum_h w_h q_scale_h ReLU(codes . codes)
// k_scale_s when Di = 128 (scales are positive). Query t sees keys
// s <= S - T + t (bottom-right causal, as sdpa), and keeps the
// k = min(topk, visible) best.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

// Values per fp8 scale in the indexer's queries and keys.
inline constexpr int64_t kIndexerBlock = 128;

// Block fp8 quantization as DeepSeek's act_quant, row by row:
//   x      [rows, dim] f32, any strides, finite
//   codes  [rows, dim] fp8_e4m3, written
//   scales [rows, dim / 128] f32, written
// dim a multiple of 128. Per block: amax = max(max |x|, 1e-4); scale =
// amax / 448, rounded up to a power of two when ue8m0; code = E4M3(x /
// scale) (nearest, ties to even, saturating at 448). Non-finite x is
// refused, nothing written.
Status indexer_quantize(const TensorView& x, const TensorView& codes, const TensorView& scales,
                        bool ue8m0 = true);

struct IndexerOptions {
  Backend backend = Backend::kAuto;
  int num_threads = 0;  // 0 = ATTNKIT_NUM_THREADS or all cores
};

// Scores and top-k of the lightning indexer:
//   q_codes  [batch, seqlen_q, n_heads, head_dim]       fp8_e4m3
//   q_scales [batch, seqlen_q, n_heads, head_dim / 128] f32, > 0
//   weights  [batch, seqlen_q, n_heads]                 f32, finite (w_t,h above)
//   k_codes  [batch, seqlen_k, head_dim]                fp8_e4m3
//   k_scales [batch, seqlen_k, head_dim / 128]          f32, > 0
//   indices  [batch, seqlen_q, topk]                    int32, written
//   scores   [batch, seqlen_q, seqlen_k]                f32, optional, written
// Any strides. seqlen_q <= seqlen_k; query t sees keys s <= seqlen_k -
// seqlen_q + t. indices[b, t] holds the min(topk, visible) best keys in
// increasing key order, then -1. Selection: a higher score wins; equal
// scores go to the lower key index (a total order, so the set never
// depends on threads or SIMD width). The fast kernel scores in fp32, the
// reference in double, so keys whose scores differ by less than ~1e-6
// relative may be chosen differently by the two. scores holds every
// visible key's score and -inf elsewhere.
Status lightning_indexer_topk(const TensorView& q_codes, const TensorView& q_scales,
                              const TensorView& weights, const TensorView& k_codes,
                              const TensorView& k_scales, int64_t topk, const TensorView& indices,
                              const TensorView& scores = {}, const IndexerOptions& options = {});

}  // namespace attnkit
