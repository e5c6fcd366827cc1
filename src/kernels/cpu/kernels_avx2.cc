// AVX2 + FMA microkernels (compiled with -mavx2 -mfma -mf16c; see
// cmake/attnkit_simd.cmake). bf16 K/V are widened to fp32 exactly; fp8 K/V
// are decoded through binary16 (F16C's vcvtph2ps).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/kernel_table.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
  // bf16 PV of up to 4 rows: 4 x 3 vectors, 12 accumulators, as QK's 3
  // keys x 4 rows.
  static constexpr int kPvFewRows = 4, kPvFewVecs = 3;

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
  static void store_masked(float* p, Mask m, F x) { _mm256_maskstore_ps(p, m, x); }
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
  // As V512::exp2_nonpos (2^t for t <= 0), 2^k built in the exponent
  // field: t is clamped to -127, whose k gives a zero field, i.e. 2^k = 0,
  // so -inf (and anything below -126.5) gives exactly 0 without the
  // compare and mask exp() needs. 15 operations where exp() of the
  // difference takes 21.
  static F exp2_nonpos(F t) {
    t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
    const F k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F f = _mm256_sub_ps(t, k);
    F p = _mm256_set1_ps(1.546973189853989e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3400432166235732e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61802560328756e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550327214206889e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265121359057e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472067106211e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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
  // First n (<= 8) bytes, the rest 0, without reading past them.
  static __m128i load_bytes8(const void* p, int64_t n) {
    uint64_t x = 0;
    std::memcpy(&x, p, static_cast<size_t>(n >= 8 ? 8 : n));
    return _mm_cvtsi64_si128(static_cast<long long>(x));
  }
  static F widen_i8(const int8_t* p, int64_t n) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p, n)));
  }
  static F widen_fp8(const uint8_t* p, int64_t n) { return fp8_to_f32(load_bytes8(p, n)); }
  // 16 whole codes as two vectors (out[0]: the first 8), with one 256-bit
  // sign-extend, shift and mask for both (6 instructions where two
  // widen_fp8 take 8-10).
  static void widen_fp8_pair(const uint8_t* p, F out[2]) {
    const __m256i h = _mm256_and_si256(
        _mm256_slli_epi16(
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7),
        _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
    out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  // 8 fp8 E4M3 codes (the low 8 bytes) as value * 2^-8 (kernel_table.h):
  // sign-extended to 16 bits and shifted left by 7, a code's sign lands on
  // bit 15 and its magnitude on bits 13..7, a binary16 with 2^-8 the value;
  // bit 14 (a copy of the sign) is cleared.
  static F fp8_to_f32(__m128i codes) {
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(codes), 7),
                                    _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
    return _mm256_cvtph_ps(h);
  }
};

// ---- S = K Q^T for 1-4 packed rows, the head dimension along the lanes --
// simd::qk_f32 puts packed rows along the lanes: a 1-token GQA 32/8 tile
// has 4 rows, so half of every 8-lane multiply-add was padding (on a Zen 3
// core the QK of a 64-key fp32 tile took 1.8 us, longer than reading its
// K from DRAM, 1.65 us, and bf16 decode was bound by it). Here each
// (key, row) pair sums over the head dimension in one vector: 3 keys x 4
// rows = 12 accumulators, 3 key vectors and one q row at a time per 8
// columns (7 loads per 12 FMAs, all 16 registers), then transposing
// reductions. With 2 keys (8 accumulators, exactly the FMA latency times
// its throughput, so any late load stalled a chain) the 64-key fp32 tile's
// QK took 1.07-1.27 us; with 3, 1.01-1.02 (decode_tile_bench
// --benchmark_filter=rows4/padded, 2026-11-24 at 06ff4eb and 2d9f2a5 on a
// Zen 3: docs/PERFORMANCE.md#decode-microkernels).

// Lane i of the result = the sum of v[i]'s lanes.
inline __m256 hsum8(const __m256 v[8]) {
  // hadd(a, b) = a01 a23 b01 b23 | a45 a67 b45 b67; twice gives the 128-bit
  // halves' sums of four sources, and the halves are then added.
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return V256::widen_bf16(p, 8); }
inline __m256 load8(const uint8_t* p) { return V256::widen_fp8(p, 8); }
inline __m256 load_tail(const float* p, int64_t n) {
  return _mm256_maskload_ps(p, V256::mask_first(n));
}
inline __m256 load_tail(const uint16_t* p, int64_t n) { return V256::widen_bf16(p, n); }
inline __m256 load_tail(const uint8_t* p, int64_t n) { return V256::widen_fp8(p, n); }

// Lane i of the result (i < 4) = the sum of v[i]'s lanes.
inline __m128 hsum4(const __m256 v[4]) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Keys [0, kKeys) (1 to 3) of a block against the 4 rows q[r * qs ...]:
// acc[a * 4 + r], stored packed as s[a * 4 + r]. The last d % 8 columns are
// loaded under a mask (q is zero past d, up to its row's multiple of 32).
// One prefetch per 64-byte line of K. No calls or lambdas in the loop, so
// that acc stays in registers.
template <int kKeys, bool kPrefetch, class Elem>
inline void rows4_block(const Elem* k, int64_t ks, int64_t d, const float* q, int64_t qs, float* s,
                        int64_t pf) {
  constexpr int64_t kLine = 64 / sizeof(Elem);
  __m256 acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  int64_t c = 0;
  if constexpr (std::is_same_v<Elem, uint8_t>) {
    // fp8 keys 16 codes at a time: one 256-bit sign-extend, shift and mask
    // make 16 binary16 values (V256::fp8_to_f32), of which each half is
    // widened when used, and the q vectors are FMA memory operands, so that
    // 12 accumulators, the 3 keys' binary16 vectors and one widened half
    // fit the 16 registers. Per 16 columns of 3 keys: 18 instructions of
    // decoding where 8 columns at a time took 30 (callgrind, 1-token fp8
    // decode: docs/PERFORMANCE.md#fp8-decode).
    for (; c + 16 <= d; c += 16) {
      __m256i kh[kKeys];
#pragma GCC unroll 3
      for (int a = 0; a < kKeys; ++a) {
        const Elem* row = k + a * ks + c;
        if (kPrefetch && c % kLine == 0)
          _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
        const __m256i x =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
        kh[a] = _mm256_and_si256(_mm256_slli_epi16(x, 7),
                                 _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
      }
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half)
#pragma GCC unroll 3
        for (int a = 0; a < kKeys; ++a) {
          const __m256 kv = _mm256_cvtph_ps(half == 0 ? _mm256_castsi256_si128(kh[a])
                                                      : _mm256_extracti128_si256(kh[a], 1));
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r)
            acc[a * 4 + r] =
                _mm256_fmadd_ps(kv, _mm256_loadu_ps(q + r * qs + c + 8 * half), acc[a * 4 + r]);
        }
    }
  }
  for (; c < d; c += 8) {
    const bool tail = c + 8 > d;
    __m256 kv[kKeys];
#pragma GCC unroll 3
    for (int a = 0; a < kKeys; ++a) {
      const Elem* row = k + a * ks + c;
      if (kPrefetch && c % kLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
      kv[a] = tail ? load_tail(row, d - c) : load8(row);
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * qs + c);
#pragma GCC unroll 3
      for (int a = 0; a < kKeys; ++a) acc[a * 4 + r] = _mm256_fmadd_ps(kv[a], qv, acc[a * 4 + r]);
    }
  }
  // Copies for the reductions, as in the AVX-512 kernel: taking acc's own
  // address would keep it in memory.
  if constexpr (kKeys == 1) {
    const __m256 sums[4] = {acc[0], acc[1], acc[2], acc[3]};
    _mm_storeu_ps(s, hsum4(sums));
  } else {
    const __m256 sums[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
    _mm256_storeu_ps(s, hsum8(sums));
    if constexpr (kKeys == 3) {
      const __m256 last[4] = {acc[8], acc[9], acc[10], acc[11]};
      _mm_storeu_ps(s + 8, hsum4(last));
    }
  }
}

template <bool kPrefetch, class Elem>
void rows4_keys(const Elem* k, int64_t ks, int64_t nk, int64_t d, const float* q, int64_t qs,
                float* s, int64_t pf) {
  int64_t n = 0;
  for (; n + 3 <= nk; n += 3) rows4_block<3, kPrefetch>(k + n * ks, ks, d, q, qs, s + n * 4, pf);
  if (nk - n == 2)
    rows4_block<2, kPrefetch>(k + n * ks, ks, d, q, qs, s + n * 4, pf);
  else if (nk - n == 1)
    rows4_block<1, kPrefetch>(k + n * ks, ks, d, q, qs, s + n * 4, pf);
}

template <class Elem>
void qk_rows(const Elem* k, int64_t ks, int64_t nk, int64_t d, const float* q, int64_t qs, float* s,
             int64_t pf) {
  if (pf != 0)
    rows4_keys<true>(k, ks, nk, d, q, qs, s, pf);
  else
    rows4_keys<false>(k, ks, nk, d, q, qs, s, pf);
}

// The online-softmax step on packed 4-row scores (as the AVX-512 kernel's
// softmax_rows4): lane 4a + r of a vector is key a's row r, two keys per
// vector, and a row's two lanes are combined by swapping the 128-bit halves.
inline __m256 across_halves_max(__m256 x) {
  return V256::max(x, _mm256_permute2f128_ps(x, x, 0x01));
}

void softmax_rows4(float* s, int64_t nk, float* row_max, float* row_sum, float* alpha) {
  const int64_t vecs = (nk + 1) / 2;
  const bool half = nk % 2 == 1;  // the last vector holds one key
  const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
  // Lanes past the last key read as -inf: no effect on the max, weight 0.
  auto load = [&](int64_t j) {
    return half && j + 1 == vecs ? _mm256_insertf128_ps(ninf, _mm_loadu_ps(s + 8 * j), 0)
                                 : _mm256_loadu_ps(s + 8 * j);
  };
  const __m256 old_max = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(row_max));
  __m256 mx0 = old_max, mx1 = old_max;
  int64_t j = 0;
  for (; j + 2 <= vecs; j += 2) {
    mx0 = V256::max(load(j), mx0);
    mx1 = V256::max(load(j + 1), mx1);
  }
  if (j < vecs) mx0 = V256::max(load(j), mx0);
  const __m256 new_max = across_halves_max(V256::max(mx0, mx1));
  // As in simd::softmax: a row with no finite score yet shifts by 0.
  const __m256 shift = V256::ninf_to_zero(new_max);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  for (j = 0; j < vecs; ++j) {
    const __m256 p = V256::exp(_mm256_sub_ps(load(j), shift));
    if (half && j + 1 == vecs)
      _mm_storeu_ps(s + 8 * j, _mm256_castps256_ps128(p));
    else
      _mm256_storeu_ps(s + 8 * j, p);
    if (j & 1)
      sum1 = _mm256_add_ps(sum1, p);
    else
      sum0 = _mm256_add_ps(sum0, p);
  }
  const __m256 sums = _mm256_add_ps(sum0, sum1);
  const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
  const __m128 a = _mm256_castps256_ps128(V256::exp(_mm256_sub_ps(old_max, shift)));
  _mm_storeu_ps(row_sum, _mm_fmadd_ps(_mm_loadu_ps(row_sum), a, sum));
  _mm_storeu_ps(row_max, _mm256_castps256_ps128(new_max));
  _mm_storeu_ps(alpha, a);
}

// ---- S = K Q^T for 1-4 packed rows over 8-bit keys -------------------------
// As rows4_block, one scale per key row applied to the sums. int8 keys:
// 16 codes widened to int16 (vpmovsxbw) and multiplied with int16 query rows
// by vpmaddwd, which sums adjacent products into int32 lanes: 16 columns per
// instruction where the fp32 path does 8, with no conversion of the keys to
// float. fp8 keys are decoded to fp32 (fp8_to_f32) against fp32 rows.

// Lane i of the result (i < 8) = the sum of v[i]'s int32 lanes.
inline __m256i hsum8_i32(const __m256i v[8]) {
  const __m256i ab =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                          _mm256_permute2x128_si256(ab, cd, 0x31));
}
inline __m128i hsum4_i32(const __m256i v[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Scores of keys a, a + 1 (lanes 4a' + r) times their key scales and the
// rows' factors rf (rows 0-3 in both halves).
inline __m256 scale_pair(__m256 sums, const float* kscale, int64_t kss, __m256 rf) {
  const __m256 ks = _mm256_set_m128(_mm_set1_ps(kscale[kss]), _mm_set1_ps(kscale[0]));
  return _mm256_mul_ps(_mm256_mul_ps(sums, ks), rf);
}

template <int kKeys, bool kPrefetch>
inline void rows4_i8_block(const int8_t* k, int64_t ks, int64_t d, const int16_t* q, int64_t qs,
                           const float* kscale, int64_t kss, __m256 rf, float* s, int64_t pf) {
  __m256i acc[12];
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t c = 0; c < d; c += 16) {
    __m256i kv[kKeys];
#pragma GCC unroll 3
    for (int a = 0; a < kKeys; ++a) {
      const int8_t* row = k + a * ks + c;
      if (kPrefetch && c % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
      __m128i b;
      if (c + 16 <= d) {
        b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
      } else {  // q is 0 past d; the key row is not read past it
        alignas(16) int8_t tmp[16] = {};
        std::memcpy(tmp, row, static_cast<size_t>(d - c));
        b = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      kv[a] = _mm256_cvtepi8_epi16(b);
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * qs + c));
#pragma GCC unroll 3
      for (int a = 0; a < kKeys; ++a)
        acc[a * 4 + r] = _mm256_add_epi32(acc[a * 4 + r], _mm256_madd_epi16(kv[a], qv));
    }
  }
  if constexpr (kKeys == 1) {
    const __m256i sums[4] = {acc[0], acc[1], acc[2], acc[3]};
    _mm_storeu_ps(s,
                  _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(hsum4_i32(sums)), _mm_set1_ps(kscale[0])),
                             _mm256_castps256_ps128(rf)));
  } else {
    const __m256i sums[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
    _mm256_storeu_ps(s, scale_pair(_mm256_cvtepi32_ps(hsum8_i32(sums)), kscale, kss, rf));
    if constexpr (kKeys == 3) {
      const __m256i last[4] = {acc[8], acc[9], acc[10], acc[11]};
      _mm_storeu_ps(s + 8, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(hsum4_i32(last)),
                                                 _mm_set1_ps(kscale[2 * kss])),
                                      _mm256_castps256_ps128(rf)));
    }
  }
}

template <bool kPrefetch>
void rows4_i8_keys(const int8_t* k, int64_t ks, int64_t nk, int64_t d, const int16_t* q, int64_t qs,
                   const float* kscale, int64_t kss, __m256 rf, float* s, int64_t pf) {
  int64_t n = 0;
  for (; n + 3 <= nk; n += 3)
    rows4_i8_block<3, kPrefetch>(k + n * ks, ks, d, q, qs, kscale + n * kss, kss, rf, s + n * 4,
                                 pf);
  if (nk - n == 2)
    rows4_i8_block<2, kPrefetch>(k + n * ks, ks, d, q, qs, kscale + n * kss, kss, rf, s + n * 4,
                                 pf);
  else if (nk - n == 1)
    rows4_i8_block<1, kPrefetch>(k + n * ks, ks, d, q, qs, kscale + n * kss, kss, rf, s + n * 4,
                                 pf);
}

void qk_rows_i8(const int8_t* k, int64_t ks, int64_t nk, int64_t d, const int16_t* q, int64_t qs,
                const float* qf, const float* kscale, int64_t kss, float* s, int64_t pf) {
  const __m128 f = _mm_loadu_ps(qf);
  const __m256 rf = _mm256_set_m128(f, f);
  if (pf != 0)
    rows4_i8_keys<true>(k, ks, nk, d, q, qs, kscale, kss, rf, s, pf);
  else
    rows4_i8_keys<false>(k, ks, nk, d, q, qs, kscale, kss, rf, s, pf);
}

// fp8 keys: rows4_keys' fp32 loop on keys decoded to value * 2^-8, then the
// scores times 2^8 and each key's scale.
void qk_rows_fp8(const uint8_t* k, int64_t ks, int64_t nk, int64_t d, const float* q, int64_t qs,
                 const float* kscale, int64_t kss, float* s, int64_t pf) {
  if (pf != 0)
    rows4_keys<true>(k, ks, nk, d, q, qs, s, pf);
  else
    rows4_keys<false>(k, ks, nk, d, q, qs, s, pf);
  for (int64_t n = 0; n < nk; ++n)
    _mm_storeu_ps(s + 4 * n,
                  _mm_mul_ps(_mm_loadu_ps(s + 4 * n), _mm_set1_ps(256.0f * kscale[n * kss])));
}

// ---- q into the qt layout -------------------------------------------------
// The portable loop reads one column of 16 rows at a time; a prefill's q
// rows of one column block lie a token's row apart (16 KiB under 32 heads of
// 128), all in the same few L1 sets, so most of its loads missed L1 and it
// took ~4 % of an MHA prefill's samples (perf, Zen 3). Here each row is read
// 8 columns at a time and 8 x 8 blocks are transposed in registers: 1.6 %,
// and whole calls (s1024 causal, 2 threads, medians of 30 alternated pairs)
// took 0.96-0.99 of the time for MHA, 0.98 for GQA 32/8, 0.99 for MQA.

// r[j] <- column j of the 8 rows r[0..8).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

void pack_q_f32(const float* const* rows, int64_t count, int64_t d, float scale, float* dst,
                int64_t w) {
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 r[8];
  for (int64_t x0 = 0; x0 < w; x0 += 8)
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      const __m256i mask = V256::mask_first(d - c0);
      for (int i = 0; i < 8; ++i)
        r[i] = x0 + i < count ? _mm256_mul_ps(_mm256_maskload_ps(rows[x0 + i] + c0, mask), sc)
                              : _mm256_setzero_ps();
      transpose8(r);
      for (int j = 0; j < 8 && c0 + j < d; ++j) _mm256_storeu_ps(dst + (c0 + j) * w + x0, r[j]);
    }
}

constexpr KernelTable kAvx2Table = {
    V256::kLanes,
    V256::kQkVecs* V256::kLanes,
    simd::qk_f32<V256>,
    simd::softcap<V256>,
    simd::softmax<V256>,
    simd::pv_f32<V256>,
    simd::widen_bf16<V256>,
    pack_q_f32,
    4,
    qk_rows<float>,
    softmax_rows4,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    qk_rows<uint16_t>,  // bf16 keys, fp32 q
    simd::pv_widen<V256>,
    simd::dequant_f32<V256>,
    nullptr,
    qk_rows_i8,
    qk_rows_fp8,
    0,
    simd::pv_i8<V256>,
    simd::pv_fp8<V256>,
    simd::pv_i8<V256>,
};

}  // namespace

const KernelTable* avx2_kernel_table() { return &kAvx2Table; }

}  // namespace attnkit::kernels::cpu

#else  // the compiler was not given the AVX2 flags

namespace attnkit::kernels::cpu {
const KernelTable* avx2_kernel_table() { return nullptr; }
}  // namespace attnkit::kernels::cpu

#endif
