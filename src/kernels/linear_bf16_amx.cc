// The bf16 stream GEMM on AMX tiles (linear_bf16.h's kernel "amx").
//
// Why: on AMX CPUs the vdpbf16ps stream kernel is bound by its arithmetic
// from about 8 rows up, and oneDNN's AMX matmul reorders W into its own
// blocked layout on every call, so a decode step of 16-32 rows read its
// bf16 weights at 0.5-0.6 of the memory's rate (docs/GEMM.md). Here W is
// read once, in place, by the tile loads.
//
// y^T = W x^T: A = 16 rows of W (16 output columns) by 32 of its depth,
// loaded as W lies (row stride depth * 2 bytes); B = x^T, prepared once per
// call as tdpbf16ps wants it: 16 pairs of depth by up to 16 rows of x, each
// pair one 32-bit lane; C = 16 output columns by those rows, fp32. A pass
// streams one block of 16 columns of W through the depth against up to
// four blocks of x's rows (four C tiles). Each y[m, n] is the same sequence
// of tile products over depth whatever the row count, the column blocks or
// the threads; products with a subnormal factor count as zero (as
// vdpbf16ps), which kernels::linear's contract allows, and so do x's fp32
// subnormals (the conversion reads them as zero, even the few that would
// round up to bf16's smallest normal).
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "kernels/amx.h"
#include "kernels/linear_bf16.h"

#if defined(ATTNKIT_AMX_BUILD)
#include <immintrin.h>

#include "kernels/linear_bf16_tiles.h"
#endif

namespace attnkit::kernels {

#if defined(ATTNKIT_AMX_BUILD)

#if defined(__clang__)
#pragma clang attribute push(                                                     \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,fma"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,fma")
#endif

namespace bf16_stream {
namespace {

constexpr int64_t kStep = 32;  // depth per tile product: 16 bf16 pairs

// x's rows per B tile: all of them up to 16, else blocks of 16 (the last
// padded with zero rows).
int64_t width(int64_t rows) { return rows < 16 ? rows : 16; }
int64_t row_blocks(int64_t rows) { return (rows + 15) / 16; }
int64_t steps(int64_t depth) { return (depth + kStep - 1) / kStep; }

// tmm0-3: C (16 rows of 4 * width bytes); tmm4: A (16 x 64 bytes); tmm5-7:
// B (16 rows of 4 * width bytes). One per width, made once: GCC 12
// has dropped the stores that fill a stack-local configuration before
// ldtilecfg (kernels/cpu/decode_amx.cc).
const AmxTileConfig& tile_config(int64_t mw) {
  static const auto configs = [] {
    std::array<AmxTileConfig, 17> c{};
    for (int w = 1; w <= 16; ++w)
      for (int t = 0; t < 8; ++t) {
        c[w].rows[t] = 16;
        c[w].colsb[t] = static_cast<uint16_t>(t == 4 ? 64 : 4 * w);
      }
    return c;
  }();
  return configs[mw];
}

int64_t xp_floats(int64_t rows, int64_t depth) {
  // One 32-bit lane (a pair of bf16) per float.
  return row_blocks(rows) * width(rows) * steps(depth) * 16;
}

// xp: for each block of width(rows) rows of x, for each step of 32 depth,
// a B tile: lane [r][m] = bf16(x[m, 32 s + 2 r]) | bf16(x[m, 32 s + 2 r + 1])
// << 16, zero past the depth and past the rows.
void prepare_x(const float* x, int64_t ldx, int64_t rows, int64_t depth, float* xp) {
  const int64_t mw = width(rows), s_count = steps(depth);
  uint32_t* out = reinterpret_cast<uint32_t*>(xp);
  std::memset(out, 0, static_cast<size_t>(xp_floats(rows, depth)) * sizeof(uint32_t));
  const int64_t whole = depth / kStep;
  // Lane r of a converted step goes to the tile's row r.
  const __m512i rows_at =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(mw)));
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * ldx;
    uint32_t* block = out + (m / mw) * s_count * 16 * mw + m % mw;
    // 32 values to 16 pairs (nearest even; a subnormal becomes zero, as the
    // tile products would count it).
    for (int64_t s = 0; s < whole; ++s) {
      const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + s * kStep + 16),
                                                 _mm512_loadu_ps(xr + s * kStep));
      _mm512_i32scatter_epi32(block + s * 16 * mw, rows_at, (__m512i)pairs, 4);
    }
    for (int64_t k = whole * kStep; k < depth; k += 2) {
      const uint32_t lo = round_to_bf16_bits(xr[k]);
      const uint32_t hi = k + 1 < depth ? round_to_bf16_bits(xr[k + 1]) : 0u;
      block[(k / kStep * 16 + k % kStep / 2) * mw] = lo | hi << 16;
    }
  }
}

// Calls f.template operator()<I>() for I = 0 .. N - 1 (tile registers are
// immediates: the loops over tiles unroll at compile time).
template <int N, class F>
void unroll(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f.template operator()<I>(), ...); }
  (std::make_integer_sequence<int, N>());
}

// The tile intrinsics take their registers as literal tokens (GCC pastes
// them into the asm); these map the unrolled indices onto them. C tiles
// tmm0-3, A tmm4, B tmm5-7 (in turn, so that a load need not wait for the
// product before it to have read its register).
template <int J>
void zero_c() {
  if constexpr (J == 0) _tile_zero(0);
  if constexpr (J == 1) _tile_zero(1);
  if constexpr (J == 2) _tile_zero(2);
  if constexpr (J == 3) _tile_zero(3);
}
template <int J>
void store_c(void* p, int64_t stride) {
  if constexpr (J == 0) _tile_stored(0, p, stride);
  if constexpr (J == 1) _tile_stored(1, p, stride);
  if constexpr (J == 2) _tile_stored(2, p, stride);
  if constexpr (J == 3) _tile_stored(3, p, stride);
}
template <int J>
void load_b_and_multiply(const void* p, int64_t stride) {
  if constexpr (J == 0) {
    _tile_loadd(5, p, stride);
    _tile_dpbf16ps(0, 4, 5);
  }
  if constexpr (J == 1) {
    _tile_loadd(6, p, stride);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (J == 2) {
    _tile_loadd(7, p, stride);
    _tile_dpbf16ps(2, 4, 7);
  }
  if constexpr (J == 3) {
    _tile_loadd(5, p, stride);
    _tile_dpbf16ps(3, 4, 5);
  }
}

struct Call {
  const uint16_t* w;  // W's rows of this call
  int64_t depth, cols;
  const uint32_t* xp;
  int64_t mw, s_count, rows;
  const float* bias;
  float* y;
  int64_t ldy;
};

// 16 columns of W from n0 against MB blocks of x's rows from b0: W's 16
// rows are read once for up to 64 rows of x. One block of columns at a
// time: 16 rows of W streamed side by side is what the hardware
// prefetchers keep up with (32 or 64 measured slower, with or without
// software prefetch; docs/GEMM.md).
template <int MB>
void pass(const Call& k, int64_t n0, int64_t b0) {
  const int64_t whole = k.depth / kStep, b_tile = 16 * k.mw;
  const int64_t valid = std::min<int64_t>(16, k.cols - n0);
  // Fewer than 16 columns left, or the last step of a depth that is not a
  // multiple of 32: W's piece is copied into `edge`, zero past W's end (a
  // NaN read past it would poison the zero lanes of x).
  alignas(64) uint16_t edge[16 * kStep];
  alignas(64) float c[16 * 16];
  unroll<MB>([&]<int J>() { zero_c<J>(); });
  const uint16_t* a = k.w + n0 * k.depth;
  for (int64_t s = 0; s < k.s_count; ++s, a += kStep) {
    if (valid == 16 && s < whole) {
      _tile_loadd(4, a, k.depth * 2);
    } else {
      const int64_t n = std::min<int64_t>(kStep, k.depth - s * kStep);
      std::memset(edge, 0, sizeof edge);
      for (int64_t r = 0; r < valid; ++r)
        std::memcpy(edge + r * kStep, a + r * k.depth, static_cast<size_t>(n) * 2);
      amx_buffer_written();
      _tile_loadd(4, edge, kStep * 2);
    }
    const uint32_t* b = k.xp + (b0 * k.s_count + s) * b_tile;
    unroll<MB>([&]<int J>() { load_b_and_multiply<J>(b + J * k.s_count * b_tile, 4 * k.mw); });
  }
  unroll<MB>([&]<int J>() {
    store_c<J>(c, 4 * k.mw);
    for (int64_t m = 0; m < k.mw; ++m) {
      const int64_t row = (b0 + J) * k.mw + m;
      if (row >= k.rows) break;
      float* yr = k.y + row * k.ldy + n0;
      for (int64_t r = 0; r < valid; ++r)
        yr[r] = k.bias != nullptr ? c[r * k.mw + m] + k.bias[n0 + r] : c[r * k.mw + m];
    }
  });
}

void run(const float* xp, int64_t rows, int64_t depth, const uint16_t* w, int64_t cols,
         const float* bias, float* y, int64_t ldy) {
  const int64_t mw = width(rows), blocks = row_blocks(rows);
  const Call k{w,    depth, cols, reinterpret_cast<const uint32_t*>(xp), mw, steps(depth), rows,
               bias, y,     ldy};
  _tile_loadconfig(&tile_config(mw));
  for (int64_t n0 = 0; n0 < cols; n0 += 16)
    for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
      // Past 64 rows the next pass reads the same 16 rows of W from L2.
      switch (std::min<int64_t>(4, blocks - b0)) {
        case 1:
          pass<1>(k, n0, b0);
          break;
        case 2:
          pass<2>(k, n0, b0);
          break;
        case 3:
          pass<3>(k, n0, b0);
          break;
        default:
          pass<4>(k, n0, b0);
      }
    }
  _tile_release();
}

}  // namespace

extern const Bf16StreamKernel kAmx = {"amx", prepare_x, run, xp_floats, 16};

}  // namespace bf16_stream

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const Bf16StreamKernel* bf16_stream_amx_kernel() {
  return amx_bf16_available() ? &bf16_stream::kAmx : nullptr;
}

#else

const Bf16StreamKernel* bf16_stream_amx_kernel() { return nullptr; }

#endif

}  // namespace attnkit::kernels
