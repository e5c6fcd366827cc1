// The bf16 stream GEMM for AVX2 + FMA (compiled with -mavx2 -mfma -mf16c;
// cmake/attnkit_simd.cmake): 16 bf16 weights per load, widened exactly to
// two fp32 vectors in registers by a shift (the even-indexed ones, low
// halves of the 32-bit lanes) and a mask (the odd-indexed ones, already in
// the high halves): two integer ops per 16 weights and no shuffle, against
// prepared x rows whose chunks hold the even and odd values apart.
#include "kernels/linear_bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "kernels/linear_bf16_tiles.h"

namespace attnkit::kernels::bf16_stream {
namespace {

struct V256 {
  using Raw = __m256i;
  using Part = __m256;
  using Acc = __m256;
  static constexpr int kChunk = 16, kParts = 2;
  // 16 registers. One row: 4 columns, 4 FMA chains (each 2 FMAs per chunk,
  // enough to keep memory the limit). More rows: 3 x 3 tiles, 9
  // accumulators + 3 widened weights + 1 x vector + the mask. With 4 x 3
  // (12 accumulators) GCC has no register left for x and reads it from
  // memory for every FMA, 30 loads per 24 FMAs: 0.58 of oneDNN's f32 rate
  // at M = 32 against 0.77 for 3 x 3 (thread-CPU time, one thread, both
  // capped to AVX2, Xeon model 167).
  static constexpr int kNrOne = 4, kMr = 3, kNr = 3;

  static Raw load_w(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static Part part(Raw raw, int i) {
    return i == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))
                  : _mm256_castsi256_ps(
                        _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static Part load_x(const float* row, int64_t k, int i) {
    return _mm256_loadu_ps(row + k + 8 * i);
  }
  static Acc mac(Acc acc, Part w, Part x) { return _mm256_fmadd_ps(w, x, acc); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static float hsum(Acc a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float x_value(const float* row, int64_t k) { return row[k]; }
};

}  // namespace

extern const Bf16StreamKernel kAvx2 = {"avx2", prepare_x_split<8>, run<V256>};

}  // namespace attnkit::kernels::bf16_stream
#endif
