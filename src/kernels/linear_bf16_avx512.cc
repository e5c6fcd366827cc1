// The bf16 stream GEMM for AVX-512 (compiled with the AVX-512 flags of
// cmake/attnkit_simd.cmake), two kernels:
//   avx512      32 bf16 weights per load widened exactly to two fp32
//               vectors by a shift and a mask (as the AVX2 kernel, twice
//               the width), fp32 FMAs
//   avx512bf16  vdpbf16ps on the weights as they lie and x rounded to bf16
//               pairs: one instruction per 32 multiply-adds, no widening.
//               It flushes products below fp32's normal range to zero, as
//               kernels::linear's contract allows.
#include "kernels/linear_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "kernels/linear_bf16_tiles.h"

namespace attnkit::kernels::bf16_stream {
namespace {

float hsum512(__m512 a) {
  // A fixed order (not _mm512_reduce_add_ps, whose order is the
  // compiler's), so the bits depend on nothing but the inputs; through
  // memory, as GCC 12 warns about its own 512-to-256-bit casts.
  alignas(64) float t[16];
  _mm512_store_ps(t, a);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

struct V512 {
  using Raw = __m512i;
  using Part = __m512;
  using Acc = __m512;
  static constexpr int kChunk = 32, kParts = 2;
  // 32 registers: 6 rows x 4 columns = 24 accumulators + 4 widened weights
  // + 1 x vector; one row: 8 columns, 8 FMA chains.
  static constexpr int kNrOne = 8, kMr = 6, kNr = 4;
  static constexpr bool kMainTile = false;

  static Raw load_w(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Part part(Raw raw, int i) {
    // maskz with every lane: the plain shift's undefined source makes
    // GCC 12 warn (maybe-uninitialized) in its own header.
    return i == 0 ? _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, raw, 16))
                  : _mm512_castsi512_ps(
                        _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Part load_x(const float* row, int64_t k, int i) {
    return _mm512_loadu_ps(row + k + 16 * i);
  }
  static Acc mac(Acc acc, Part w, Part x) { return _mm512_fmadd_ps(w, x, acc); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static float hsum(Acc a) { return hsum512(a); }
  static float x_value(const float* row, int64_t k) { return row[k]; }
};

// x rows as packed bf16 in the first half of each row's depth floats.
const uint16_t* bf16_row(const float* row) { return reinterpret_cast<const uint16_t*>(row); }

struct V512Bf16 {
  using Raw = __m512bh;
  using Part = __m512bh;
  using Acc = __m512;
  static constexpr int kChunk = 32, kParts = 1;
  static constexpr int kNrOne = 8, kMr = 4, kNr = 4;
  static constexpr bool kMainTile = false;

  static Raw load_w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Part part(Raw raw, int) { return raw; }
  static Part load_x(const float* row, int64_t k, int) {
    return (__m512bh)_mm512_loadu_si512(bf16_row(row) + k);
  }
  static Acc mac(Acc acc, Part w, Part x) { return _mm512_dpbf16_ps(acc, x, w); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static float hsum(Acc a) { return hsum512(a); }
  static float x_value(const float* row, int64_t k) { return bf16_bits_to_float(bf16_row(row)[k]); }
};

// x rounded to bf16, packed in natural order (vdpbf16ps pairs k = 2j, 2j+1
// as W's memory holds them) in the first half of each row's depth floats.
void prepare_x_bf16(const float* x, int64_t ldx, int64_t rows, int64_t depth, float* xp) {
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* out = reinterpret_cast<uint16_t*>(xp + m * depth);
    for (int64_t k = 0; k < depth; ++k) out[k] = round_to_bf16_bits(x[m * ldx + k]);
  }
}

}  // namespace

extern const Bf16StreamKernel kAvx512 = {"avx512", prepare_x_split<16>, run<V512>,
                                         bf16_stream_xp_dense, 1};
extern const Bf16StreamKernel kAvx512Bf16 = {"avx512bf16", prepare_x_bf16, run<V512Bf16>,
                                             bf16_stream_xp_dense, 1};

}  // namespace attnkit::kernels::bf16_stream
#endif
