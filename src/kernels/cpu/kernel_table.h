// The microkernels of one SIMD target, as plain function pointers, so that
// the tile loop (task_runner.h and its stage_*.cc files) exists once and every target runs the
// same algorithm. Each target's table is built in its own translation unit,
// compiled with that target's flags (see cmake/attnkit_simd.cmake).
//
// Layouts (fp32 unless said otherwise; `m` counts packed query rows, i.e.
// (query row, head of the group) pairs; m_pad and dv_pad are multiples of
// `lanes`):
//   qt   [m_pad / W][head_dim][W]           scaled queries, transposed, in column
//                                           blocks of W = qk_block_cols (each block
//                                           streams contiguously through L1)
//   qt2  [m_pad / W][ceil(head_dim / 2)][W][2] bf16 pairs (q[2i], q[2i+1]), q[head_dim] = 0
//   s    [nk][s_stride]                     scores, then softmax weights: key-major,
//                                           so the softmax runs down columns with no
//                                           horizontal reductions; s_stride >= m_pad is
//                                           an odd number of cache lines, so that a
//                                           column walk does not keep hitting the same
//                                           few L1 sets
//   o    [m][dv_pad]                        unnormalised outputs
//   k, v rows of the caller's tensors: element (n, c) at k[n * row_stride + c]
#pragma once

#include <cstdint>

namespace attnkit::kernels::cpu {

struct KernelTable {
  int lanes;          // fp32 lanes of one vector
  int qk_block_cols;  // W of the qt / qt2 layouts (a multiple of lanes)

  // s[n][m] = sum_d k[n][d] * qt[d][m] for n < nk, m < m_pad. The kernels
  // that read K or V rows take `prefetch`: when nonzero they also prefetch,
  // for each row read, the row that many elements further on (the rows the
  // tile loop reads next, which may lie in another tensor: QK fetches V, PV
  // the next K), so that decode, which reads every row once from DRAM, has
  // the next rows in flight; 0 = none.
  // `seen`: nullptr, or for each packed row m < m_pad the keys [seen[2m],
  // seen[2m + 1]) (0 <= first <= last <= nk; first == last: none) that it
  // sees; a column block may then leave the scores of keys none of its rows
  // sees unwritten (the caller masks them).
  void (*qk_f32)(const float* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                 const float* qt, int64_t m_pad, float* s, int64_t s_stride, int64_t prefetch,
                 const int64_t* seen);
  // s = cap * tanh(s / cap) for n < nk, m < m_pad.
  void (*softcap)(float* s, int64_t nk, int64_t m_pad, int64_t s_stride, float cap);
  // Online-softmax step over one tile, per column m < m_pad:
  //   new_max = max(row_max, max_n s[n][m]); alpha[m] = exp(row_max - new_max);
  //   s[n][m] = exp(s[n][m] - new_max); row_sum = row_sum * alpha + sum_n s[n][m].
  // Scores of -inf become weights of exactly 0; a column that has seen no
  // finite score keeps row_max = -inf and gets alpha = 0.
  void (*softmax)(float* s, int64_t nk, int64_t m_pad, int64_t s_stride, float* row_max,
                  float* row_sum, float* alpha);
  // o[m][c] = alpha[m] * o[m][c] + sum_n s[n][m] * v[n][c] for m < rows, c < dv_pad
  // (v is read for c < head_dim_v only; o's pad columns stay 0). `seen`:
  // as qk_f32's, for rows m < rows, whose weights are 0 outside their
  // ranges; a block of rows may skip the keys none of its rows sees, so V
  // must be finite there (0 * NaN would not be 0).
  void (*pv_f32)(const float* s, int64_t nk, int64_t s_stride, int64_t rows, const float* v,
                 int64_t v_row_stride, int64_t head_dim_v, float* o, int64_t dv_pad,
                 const float* alpha, int64_t prefetch, const int64_t* seen);
  // dst[n][c] = float(src[n][c]) for n < rows, c < cols (bf16 widening is
  // exact), prefetching as the kernels above.
  void (*widen_bf16)(const uint16_t* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                     float* dst, int64_t dst_row_stride, int64_t prefetch);

  // qt (one column block of width w) from `count` <= w query rows, each
  // contiguous: dst[c][x] = scale * rows[x][c], 0 for x >= count. nullptr
  // where the portable loop is used instead.
  void (*pack_q_f32)(const float* const* rows, int64_t count, int64_t head_dim, float scale,
                     float* dst, int64_t w);

  // For tiles of at most qk_rows_max packed rows (0 = no such kernel; only
  // when m_pad == lanes): s = K Q^T with the head dimension along the lanes,
  // from q row-major, q[r * q_stride + c] = scale * q_r[c], rows r < 4
  // (rows past the tile's are 0, as are columns past head_dim up to a
  // multiple of 32). s is packed: s[n * 4 + r], four keys per 16 lanes, so
  // that the softmax works on whole vectors (softmax_rows4) instead of
  // vectors of which 12 lanes are padding.
  int qk_rows_max;
  void (*qk_rows_f32)(const float* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                      const float* q, int64_t q_stride, float* s, int64_t prefetch);
  // The online-softmax step of `softmax` for packed s[n * 4 + r], rows
  // r < 4; row_max, row_sum and alpha are read and written at [0, 4).
  void (*softmax_rows4)(float* s, int64_t nk, float* row_max, float* row_sum, float* alpha);

  // vdpbf16ps kernels; nullptr unless the target has AVX512_BF16.
  // As qk_f32 with bf16 keys and qt2 pairs.
  void (*qk_bf16)(const uint16_t* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                  const uint16_t* qt2, int64_t m_pad, float* s, int64_t s_stride, int64_t prefetch);
  // As pv_f32 with bf16 values; the weights are rounded to bf16. `pack`
  // holds pv_bf16_pack_elems(nk, s_stride, dv_pad) uint16s of scratch.
  void (*pv_bf16)(const float* s, int64_t nk, int64_t m_pad, int64_t s_stride, int64_t rows,
                  const uint16_t* v, int64_t v_row_stride, int64_t head_dim_v, float* o,
                  int64_t dv_pad, const float* alpha, uint16_t* pack, int64_t prefetch);
  // As pack_q_f32, into qt2's bf16 pairs (the odd tail pairs with 0).
  void (*pack_q_bf16)(const float* const* rows, int64_t count, int64_t head_dim, float scale,
                      uint16_t* dst, int64_t w);
  // As qk_rows_f32 with bf16 keys and bf16 q rows.
  void (*qk_rows_bf16)(const uint16_t* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                       const uint16_t* q, int64_t q_stride, float* s, int64_t prefetch);

  // bf16 K/V read where they lie and widened to fp32 in registers, for
  // targets without vdpbf16ps (exact, as widen_bf16); nullptr where the
  // tile loop widens a copy of the tile instead.
  // As qk_rows_f32 with bf16 keys (q stays fp32).
  void (*qk_rows_widen)(const uint16_t* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                        const float* q, int64_t q_stride, float* s, int64_t prefetch);
  // As pv_f32 with bf16 values (the weights stay fp32).
  void (*pv_widen)(const float* s, int64_t nk, int64_t s_stride, int64_t rows, const uint16_t* v,
                   int64_t v_row_stride, int64_t head_dim_v, float* o, int64_t dv_pad,
                   const float* alpha, int64_t prefetch, const int64_t* seen);

  // 8-bit K/V (kI8, kFp8E4M3; attention_params.h): rows of 1-byte codes.
  // int8 codes decode exactly to fp32; fp8 E4M3 codes are decoded through
  // binary16 (the magnitude bits moved to fp16's exponent and mantissa, one
  // vcvtph2ps), which gives value * 2^-8 exactly, subnormals included.
  // dst[n][c] = decode(src[n][c]) * scale[n * scale_stride + c / block] for
  // c < cols (block: 0 = the whole row, else a multiple of 16), 0 up to
  // dst_row_stride (a multiple of lanes), prefetching as widen_bf16; `fp8`
  // picks the code type.
  void (*dequant_f32)(const uint8_t* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                      const float* scale, int64_t scale_stride, int64_t block, bool fp8, float* dst,
                      int64_t dst_row_stride, int64_t prefetch);
  // As dequant_f32, rounded to bf16: the operands of the vdpbf16ps kernels;
  // nullptr unless qk_bf16 is set.
  void (*dequant_bf16)(const uint8_t* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                       const float* scale, int64_t scale_stride, int64_t block, bool fp8,
                       uint16_t* dst, int64_t dst_row_stride, int64_t prefetch);
  // For tiles of at most qk_rows_max packed rows, as qk_rows_f32 (packed
  // s[n * 4 + r]) with one scale per key row, kscale[n * kscale_stride]:
  // int8 keys against int16 query rows q16 (zero past the tile's rows and
  // past head_dim up to a multiple of 32), one factor per row qf[r]:
  //   s[n * 4 + r] = kscale[n * kscale_stride] * qf[r] * sum_c k[n][c] * q16[r][c]
  // summed exactly in int32 (the caller keeps head_dim * 127 * max|q16| below
  // 2^31); nullptr where the tile loop dequantizes a copy instead.
  void (*qk_rows_i8)(const int8_t* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                     const int16_t* q16, int64_t q_stride, const float* qf, const float* kscale,
                     int64_t kscale_stride, float* s, int64_t prefetch);
  // fp8 keys decoded exactly in registers against fp32 query rows:
  //   s[n * 4 + r] = kscale[n * kscale_stride] * sum_c e4m3(k[n][c]) * q[r][c]
  void (*qk_rows_fp8)(const uint8_t* k, int64_t k_row_stride, int64_t nk, int64_t head_dim,
                      const float* q, int64_t q_stride, const float* kscale, int64_t kscale_stride,
                      float* s, int64_t prefetch);
  // As pv_f32 with int8 (pv_i8) or fp8 (pv_fp8) values, one scale per value
  // row, vscale[n * vscale_stride], for tiles of fewer than
  // kCopyValuesMinRows rows: the codes are read where they lie. `pack`
  // holds pv_8bit_pack_elems(nk, s_stride, dv_pad) uint16s of scratch.
  // Tiles of at most pv_int_rows_max rows (0 = none) round each row's
  // weights, times the value scales, to int16 in steps of 2^-15 of the
  // row's largest in the tile (the products and their sums are then exact
  // in int32): relative to the output, at most 64 * 127 / 2 steps of a code
  // times its scale, i.e. 2^-10 of the largest |value| (bf16 weights round
  // by 2^-8). Other tiles and targets multiply in fp32.
  int pv_int_rows_max;
  void (*pv_i8)(const float* s, int64_t nk, int64_t s_stride, int64_t rows, const int8_t* v,
                int64_t v_row_stride, const float* vscale, int64_t vscale_stride,
                int64_t head_dim_v, float* o, int64_t dv_pad, const float* alpha, uint16_t* pack,
                int64_t prefetch, const int64_t* seen);
  void (*pv_fp8)(const float* s, int64_t nk, int64_t s_stride, int64_t rows, const uint8_t* v,
                 int64_t v_row_stride, const float* vscale, int64_t vscale_stride,
                 int64_t head_dim_v, float* o, int64_t dv_pad, const float* alpha, uint16_t* pack,
                 int64_t prefetch, const int64_t* seen);
  // As pv_i8, in fp32 for every row count (simd::pv_i8: the weights times
  // each key's scale, then one FMA chain per row and output column over the
  // keys in order, simd::pv_block): a row's bits do not depend on the rows
  // beside it, which batch-invariant plans need (task_plan.cc). The same
  // function as pv_i8 where pv_int_rows_max is 0.
  void (*pv_i8_f32)(const float* s, int64_t nk, int64_t s_stride, int64_t rows, const int8_t* v,
                    int64_t v_row_stride, const float* vscale, int64_t vscale_stride,
                    int64_t head_dim_v, float* o, int64_t dv_pad, const float* alpha,
                    uint16_t* pack, int64_t prefetch, const int64_t* seen);
};

// A row stride of at least `floats` (a multiple of the lanes) that is not
// an even number of 64-byte lines: a walk down a column of such rows spreads
// over all L1 sets instead of a few (a 1 KiB stride uses one set in 16).
inline int64_t odd_line_stride(int64_t floats) { return floats % 32 == 0 ? floats + 16 : floats; }

// The s row stride of a tile: 4 packed rows per key for qk_rows_*, else
// m_pad columns on an odd number of lines.
inline int64_t score_stride(int64_t m_pad, bool rows_qk) {
  return rows_qk ? 4 : odd_line_stride(m_pad);
}

inline int64_t pv_bf16_pack_elems(int64_t nk, int64_t s_stride, int64_t dv_pad) {
  return (nk + 1) / 2 * 2 * (s_stride + dv_pad);
}

// The 8-bit P V kernels' scratch: the scaled weights in fp32 (nk * s_stride),
// or the int16 weight pairs and each row's factor.
inline int64_t pv_8bit_pack_elems(int64_t nk, int64_t s_stride) {
  return 2 * ((nk + 1) / 2 * 2 * s_stride + 16);
}

// Per-target tables, defined in the per-target translation units (this
// header is included there, so it pulls in nothing but <cstdint>).
const KernelTable* scalar_kernel_table();
const KernelTable* avx2_kernel_table();        // nullptr if not compiled
const KernelTable* avx512_kernel_table();      // nullptr if not compiled
const KernelTable* avx512bf16_kernel_table();  // nullptr if not compiled

}  // namespace attnkit::kernels::cpu
