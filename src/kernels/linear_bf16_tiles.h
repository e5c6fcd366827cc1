// The bf16 stream GEMM's tile loop (linear_bf16.h), written once over a
// SIMD traits class V and included by each target's translation unit
// (linear_bf16_avx2.cc, linear_bf16_avx512.cc), which compiles it with
// that target's flags.
//
// V provides:
//   kChunk        weights per step and per row (one raw load of W)
//   kParts        how many (W part, x part) products one chunk makes:
//                 2 for widening targets (the even and odd bf16 of each
//                 32-bit lane, widened by a shift and a mask: no shuffle),
//                 1 for vdpbf16ps (which takes the pairs as they lie)
//   Raw, Acc      the raw W chunk and an accumulator
//   load_w(p), part(raw, i), load_x(p, i), mac(acc, w, x), zero(), hsum(acc)
//   kNrOne        columns per tile for one row
//   kMr, kNr      rows and columns per tile for more rows
//   x_value(p, k) the rounded x[k] of a prepared row (the tail k >= a
//                 multiple of kChunk, where rows keep their natural order)
//   kMainTile     true where V::main_tile(xp, ldxp, w, ldw, whole, acc)
//                 computes the whole chunks of a full kMr x kNr tile itself
//                 (hand-allocated registers, linear_bf16_avx2.cc), with the
//                 same operations in the same order as the loop below, so a
//                 row's bits do not depend on which tile computed it
//
// Tiles are MR rows (<= kMr) by NR columns of W: each chunk of W's NR rows is
// loaded once and multiplied with the MR x rows, so W crosses the memory
// bus once per call and each loaded W vector serves MR rows. The loop over
// columns is outside the loop over row groups: a tile's NR rows of W
// (NR * depth * 2 bytes, 24-96 KiB for depth 4096) stay in L1/L2 while
// every row group uses them.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnkit::kernels::bf16_stream {

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float -> bf16 (nearest even; NaN stays a quiet NaN), as float_to_bf16.
inline uint16_t round_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// xp for widening targets: x rounded to bf16, as f32; each chunk of
// 2 * L values (L = fp32 lanes) holds the even-indexed ones first, then
// the odd-indexed ones, matching part(raw, 0) and part(raw, 1); the tail
// past the last whole chunk keeps its order.
template <int L>
void prepare_x_split(const float* x, int64_t ldx, int64_t rows, int64_t depth, float* xp) {
  constexpr int64_t kChunk = 2 * L;
  const int64_t whole = depth - depth % kChunk;
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * ldx;
    float* out = xp + m * depth;
    for (int64_t k = 0; k < whole; k += kChunk)
      for (int j = 0; j < L; ++j) {
        out[k + j] = bf16_bits_to_float(round_to_bf16_bits(xr[k + 2 * j]));
        out[k + L + j] = bf16_bits_to_float(round_to_bf16_bits(xr[k + 2 * j + 1]));
      }
    for (int64_t k = whole; k < depth; ++k) out[k] = bf16_bits_to_float(round_to_bf16_bits(xr[k]));
  }
}

// One MR x NR tile: rows x[0, MR) (row stride ldxp floats) against W rows
// w[0, NR) (row stride depth), written to y (row stride ldy).
template <class V, int MR, int NR>
void tile(const float* xp, int64_t ldxp, int64_t depth, const uint16_t* w, const float* bias,
          float* y, int64_t ldy) {
  typename V::Acc acc[MR][NR];
  const int64_t whole = depth - depth % V::kChunk;
  if constexpr (V::kMainTile && MR == V::kMr && NR == V::kNr) {
    V::main_tile(xp, ldxp, w, depth, whole, acc);
  } else {
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = V::zero();
    for (int64_t k = 0; k < whole; k += V::kChunk) {
      typename V::Raw raw[NR];
      for (int n = 0; n < NR; ++n) raw[n] = V::load_w(w + n * depth + k);
      for (int i = 0; i < V::kParts; ++i) {
        typename V::Part wp[NR];
        for (int n = 0; n < NR; ++n) wp[n] = V::part(raw[n], i);
        for (int m = 0; m < MR; ++m) {
          const typename V::Part xv = V::load_x(xp + m * ldxp, k, i);
          for (int n = 0; n < NR; ++n) acc[m][n] = V::mac(acc[m][n], wp[n], xv);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = V::hsum(acc[m][n]);
      for (int64_t k = whole; k < depth; ++k)
        s += V::x_value(xp + m * ldxp, k) * bf16_bits_to_float(w[n * depth + k]);
      y[m * ldy + n] = bias != nullptr ? s + bias[n] : s;
    }
}

template <class V, int MR, int NR>
void columns(const float* xp, int64_t depth, const uint16_t* w, int64_t cols, const float* bias,
             float* y, int64_t ldy) {
  int64_t n = 0;
  for (; n + NR <= cols; n += NR)
    tile<V, MR, NR>(xp, depth, depth, w + n * depth, bias ? bias + n : nullptr, y + n, ldy);
  // The last cols % NR columns, one at a time: the same operations per
  // element as inside a tile.
  for (; n < cols; ++n)
    tile<V, MR, 1>(xp, depth, depth, w + n * depth, bias ? bias + n : nullptr, y + n, ldy);
}

// The rows left after the whole groups of V::kMr: one tile of `left` (<
// kMr) rows, picked among the instantiations below MR.
template <class V, int NR, int MR>
void left_rows(int64_t left, const float* xp, int64_t depth, const uint16_t* w, int64_t ncols,
               const float* bias, float* y, int64_t ldy) {
  if constexpr (MR >= 1) {
    if (left == MR) {
      columns<V, MR, NR>(xp, depth, w, ncols, bias, y, ldy);
      return;
    }
    left_rows<V, NR, MR - 1>(left, xp, depth, w, ncols, bias, y, ldy);
  }
}

// A panel of NR columns for every row group (kMr rows, then those left).
template <class V, int NR>
void row_groups(const float* xp, int64_t rows, int64_t depth, const uint16_t* w, int64_t ncols,
                const float* bias, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + V::kMr <= rows; m += V::kMr)
    columns<V, V::kMr, NR>(xp + m * depth, depth, w, ncols, bias, y + m * ldy, ldy);
  left_rows<V, NR, V::kMr - 1>(rows - m, xp + m * depth, depth, w, ncols, bias, y + m * ldy, ldy);
}

// The whole block: for one row, kNrOne columns per tile (independent FMA
// chains that hide the FMA latency); for more, panels of kNr columns of W,
// each used by every row group while it is in cache.
template <class V>
void run(const float* xp, int64_t rows, int64_t depth, const uint16_t* w, int64_t cols,
         const float* bias, float* y, int64_t ldy) {
  if (rows == 1) {
    columns<V, 1, V::kNrOne>(xp, depth, w, cols, bias, y, ldy);
    return;
  }
  for (int64_t n = 0; n < cols; n += V::kNr) {
    const int64_t nc = cols - n < V::kNr ? cols - n : V::kNr;
    row_groups<V, V::kNr>(xp, rows, depth, w + n * depth, nc, bias ? bias + n : nullptr, y + n,
                          ldy);
  }
}

}  // namespace attnkit::kernels::bf16_stream
