// DeepSeek sparse attention's kernels: the lightning indexer with its top-k
// selection, and attention over per-query key indices. Each has a
// reference twin in double (Backend::kReference) and a fast fp32 form; the
// API layer (src/ops/sparse_attention.cc, src/ops/sdpa.cc) validates and
// fills the params. Both run functions fail only when scratch cannot be
// allocated, before anything is written.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "kernels/attention_params.h"

namespace attnkit::kernels {

// Strides in elements of a rank-3 view.
struct Strides3 {
  int64_t batch = 0, row = 0, col = 1;
};

struct IndexerParams {
  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, n_heads = 0, head_dim = 0;
  const uint8_t* q_codes = nullptr;  // [batch, seqlen_q, n_heads, head_dim] fp8
  Strides4 q_codes_stride;
  const float* q_scales = nullptr;  // [batch, seqlen_q, n_heads, head_dim / 128]
  Strides4 q_scales_stride;
  const float* weights = nullptr;  // [batch, seqlen_q, n_heads]
  Strides3 weights_stride;
  const uint8_t* k_codes = nullptr;  // [batch, seqlen_k, head_dim] fp8
  Strides3 k_codes_stride;
  const float* k_scales = nullptr;  // [batch, seqlen_k, head_dim / 128]
  Strides3 k_scales_stride;
  int64_t topk = 0;
  int32_t* indices = nullptr;  // [batch, seqlen_q, topk]
  Strides3 indices_stride;
  float* scores = nullptr;  // [batch, seqlen_q, seqlen_k], optional
  Strides3 scores_stride;
  int num_threads = 0;
  // Set (by lightning_indexer_topk, for one query row): k_scales are not
  // yet checked. run_indexer then checks that each is finite and > 0 before
  // it writes anything (a decode step, on the fast backend: as its scoring
  // reads them, instead of in a pass of their own on the calling thread)
  // and, on a bad one, sets *k_scales_bad and returns Ok with nothing
  // written.
  bool* k_scales_bad = nullptr;
};

Status run_indexer(const IndexerParams& params, Backend backend);

// Per-query key indices for attention: row i of batch item b attends to the
// logical keys idx[b * batch + i * row + n * col], n < topk, -1 = none
// (validated: each in [0, keys_of(b)), and <= the row's position when
// causal). Keys are read in place through params.key_row().
struct KeyIndices {
  const int32_t* data = nullptr;
  Strides3 stride;
  int64_t topk = 0;
};

// Attention of params (scale, softcap, lse; no mask, window, chunk, sparse
// pattern, sinks or probs) over the keys `indices` names.
Status run_sparse_attention(const AttentionParams& params, const KeyIndices& indices,
                            Backend backend);

// DeepSeek's block fp8 quantization of n values x[i * stride] (n a multiple
// of 128), as indexer_quantize (attnkit/sparse_attention.h) documents.
void indexer_quantize_row(const float* x, int64_t stride, int64_t n, bool ue8m0, uint8_t* codes,
                          float* scales);

// The fast indexer's top-k: out[n * out_stride], n < topk, = the indices
// of the min(topk, visible) best of score[0 .. visible) in increasing
// order, then -1; best = higher score, equal scores (-0 = +0) by lower
// index; a NaN score counts as -inf. The same set as std::nth_element
// under that order (the reference's select), found in O(visible) by a
// radix select on the scores' bits: a histogram of the top 11 bits over
// every score gives the k-th's first digit; one pass keeps the scores at
// or above it (in index order: every chosen one among them), and
// histograms of the next 11 and last 10 bits over those give the k-th
// score; the kept scores above it and, equal to it, the lowest indices
// are the choice. hist: nullptr, or `sets` histograms of kTopkHistogram
// counts whose add_topk_histogram calls covered score[0 .. visible)
// exactly once (gathered while the scores were computed, on the threads
// that computed them: the first pass is then not made here). The pass
// that keeps the candidates runs on stretches of the scores that depend
// on `visible` and the SIMD target alone (AVX-512: 16 scores at a time),
// on up to num_threads threads (parallel_for); each stretch compacts into
// its own part of the scratch, so the output is the same for any thread
// count. scratch: 2 * visible int32s (the candidates' indices, then their
// keys); worker_hist: num_threads * kTopkWorkerHistogram counts.
inline constexpr int64_t kTopkHistogram = 4 * 2048;
inline constexpr int64_t kTopkWorkerHistogram = 2048;
void add_topk_histogram(const float* score, int64_t n, uint32_t* hist);
void select_topk_scores(const float* score, int64_t visible, int64_t topk, const uint32_t* hist,
                        int64_t sets, int num_threads, uint32_t* worker_hist, int32_t* scratch,
                        int32_t* out, int64_t out_stride);

// x <- H x / sqrt(n) in place, H Sylvester's Hadamard matrix of order n (a
// power of two).
void hadamard_inplace(float* x, int64_t n);

}  // namespace attnkit::kernels
