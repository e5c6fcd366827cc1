// AVX2 + FMA microkernels (compiled with -mavx2 -mfma; see
// cmake/attnkit_simd.cmake). bf16 K/V are widened to fp32 exactly.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/kernel_table.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "kernels/cpu/simd_kernels.h"

namespace attnkit::kernels::cpu {
namespace {

struct V256 {
  using F = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  // 16 registers: 12 accumulators + 2 loaded rows/columns + 1 broadcast.
  static constexpr int kQkVecs = 2, kQkAcc = 12, kQkMaxKeys = 12;
  static constexpr int kPvRows = 6, kPvVecs = 2;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Mask mask_first(int64_t n) {
    const int32_t c = static_cast<int32_t>(n > 8 ? 8 : n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load_masked(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F copysign(F mag, F sign) {
    const F bit = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)));
    return _mm256_or_ps(mag, _mm256_and_ps(sign, bit));
  }
  static F ninf_to_zero(F x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ), x);
  }
  // As V512::exp, with 2^n built in the exponent field: x is clamped to
  // [-87.3, 88.7] where 2^n is a normal float, and lanes that were below
  // -87.3 are zeroed afterwards (so -inf gives exactly 0). Operand order
  // keeps NaN a NaN through the clamps.
  static F exp(F x) {
    const F lo = _mm256_set1_ps(-87.33654f);
    const F tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.72283f), _mm256_max_ps(lo, x));
    const F n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    F p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // n = 128 (x near 88.7) would overflow the exponent field: split 2^n
    // into 2^(n - 1) * 2.
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    const F y = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    return _mm256_andnot_ps(tiny, y);
  }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static F widen_bf16(const uint16_t* p, int64_t n) {
    __m128i h;
    if (n >= 8) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      uint16_t tmp[8] = {};
      if (n > 0) std::memcpy(tmp, p, static_cast<size_t>(n) * sizeof(uint16_t));
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

constexpr KernelTable kAvx2Table = {
    V256::kLanes,
    V256::kQkVecs* V256::kLanes,
    simd::qk_f32<V256>,
    simd::softcap<V256>,
    simd::softmax<V256>,
    simd::pv_f32<V256>,
    simd::widen_bf16<V256>,
    nullptr,
    0,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

const KernelTable* avx2_kernel_table() { return &kAvx2Table; }

}  // namespace attnkit::kernels::cpu

#else  // the compiler was not given the AVX2 flags

namespace attnkit::kernels::cpu {
const KernelTable* avx2_kernel_table() { return nullptr; }
}  // namespace attnkit::kernels::cpu

#endif
