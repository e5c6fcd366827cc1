// AVX-512 microkernels (compiled with -mavx512f/bw/vl/dq/bf16/vnni -mfma;
// see cmake/attnkit_simd.cmake). Two tables: kAvx512 widens bf16 K/V to
// fp32 exactly; kAvx512Bf16 adds the vdpbf16ps kernels for bf16 K/V and
// vpdpwssd (AVX512_VNNI, which every CPU with AVX512_BF16 has) for int8.
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/cpu/kernel_table.h"

// ATTNKIT_AVX512_EMULATED: the second build of this file that tests and the
// attention fuzzer link, on emulated intrinsics (tests/common/
// avx512_emulation.h, force-included; cmake/attnkit_avx512_emulation.cmake).
#if defined(ATTNKIT_AVX512_EMULATED) ||                                             \
    (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&      \
     defined(__AVX512DQ__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && \
     defined(__FMA__))
#if !defined(ATTNKIT_AVX512_EMULATED)
#include "kernels/cpu/x86_intrinsics.h"
#endif

#include "kernels/cpu/simd_kernels.h"

namespace attnkit::kernels::cpu {
namespace {

struct V512 {
  using F = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  // 24 accumulators of 32 registers leave room for the loaded operands.
  // QK: 6 keys x 4 vectors = 6 broadcasts + 4 loads per 24 FMAs; PV: 6 rows
  // x 4 vectors = 6 broadcasts + 4 loads per 24 FMAs. Both stay under the
  // two loads per cycle that feed two FMAs per cycle (each measured at
  // 93-95 % of the FMA peak on L1-resident tiles, Zen 5). With fewer row
  // vectors (decode) at most 8 keys, so that a 64-key tile splits evenly
  // (the bf16 QK with one row vector takes kQk2OneVectorKeys).
  static constexpr int kQkVecs = 4, kQkAcc = 24, kQkMaxKeys = 8;
  static constexpr int kPvRows = 6, kPvVecs = 4;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static Mask mask_first(int64_t n) { return n >= 16 ? Mask(0xffff) : Mask((1u << n) - 1u); }
  static F load_masked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, Mask m, F x) { _mm512_mask_storeu_ps(p, m, x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F x) { return _mm512_abs_ps(x); }
  static F copysign(F mag, F sign) {
    const __m512i bit = _mm512_set1_epi32(int32_t(0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag),
                                               _mm512_and_si512(_mm512_castps_si512(sign), bit)));
  }
  static F ninf_to_zero(F x) {
    const Mask is_ninf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(x, is_ninf, _mm512_setzero_ps());
  }
  // exp(x) = 2^n p(r), x = n ln2 + r, |r| <= ln2 / 2; p is Cephes' expf
  // polynomial (about 1 ulp). scalef builds 2^n without integer tricks and
  // saturates to 0 / inf on its own. Inputs below -104 (where the result
  // underflows to 0) are clamped first so that -inf gives 0, not NaN; the
  // operand order keeps NaN a NaN.
  static F exp(F x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const F n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    F p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
  }
  // 2^t for t <= 0 (the softmax's (x - max) log2 e), -inf giving 0 and NaN
  // a NaN: 2^k p(f), k = round(t), f = t - k in [-1/2, 1/2], p a degree-6
  // fit of 2^f (at most 1.7 ulp in fp32). 10 operations where exp() of the
  // difference takes 14, with no second reduction step: t's own rounding
  // (half an ulp of t) only matters for the weights far below the row's
  // largest. For t below -126 (and -inf) the result is 0, not 2^t: scalef
  // with a subnormal or underflowing result takes a microcode assist, and
  // the masked keys of every causal diagonal tile (-inf) took one per
  // lane. Zeroed by the mask instead, causal GQA 32/8 s2048 fp32 prefill
  // took 0.95-0.97 of the time (CPU time, calls alternated in one process,
  // 1 and 2 threads; 2026-11-27, Intel Xeon family 6 model 167:
  // docs/PERFORMANCE.md#prefill), as it did with the FPU flushing
  // subnormals (MXCSR FTZ/DAZ). The weights dropped are below FLT_MIN, of a
  // row whose largest weight is 1.
  // f comes from one vreduceps (t minus t rounded to nearest, exact), k =
  // t - f (exact): the same f and k as vrndscaleps (2 uops on port 0) and a
  // subtraction gave, with no clamp of t, as the lanes it guarded (t below
  // -126: -inf, or so large that k is t itself) are the ones the mask
  // zeroes. Two uops fewer per score: causal GQA 32/8 s2048 fp32 prefill
  // took 0.97-0.99 of the time, bit-identical (CPU time, alternated in one
  // process; 2026-11-27, Intel Xeon family 6 model 167:
  // docs/PERFORMANCE.md#prefill).
  static F exp2_nonpos(F t) {
    const Mask normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // or NaN
    const F f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F k = _mm512_sub_ps(t, f);
    F p = _mm512_set1_ps(1.546973189853989e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3400432166235732e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61802560328756e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327214206889e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265121359057e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472067106211e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, k);
  }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static F widen_bf16(const uint16_t* p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask_first(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m128i load_bytes16(const void* p, int64_t n) {
    return n >= 16 ? _mm_loadu_si128(static_cast<const __m128i*>(p))
                   : _mm_maskz_loadu_epi8(mask_first(n), p);
  }
  static F widen_i8(const int8_t* p, int64_t n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(p, n)));
  }
  static F widen_fp8(const uint8_t* p, int64_t n) { return fp8_to_f32(load_bytes16(p, n)); }
  // 32 whole codes as two vectors (out[0]: the first 16), as V256's.
  static void widen_fp8_pair(const uint8_t* p, F out[2]) {
    const __m512i h = _mm512_and_si512(
        _mm512_slli_epi16(
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 7),
        _mm512_set1_epi16(static_cast<int16_t>(0xbf80)));
    out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  // 16 fp8 E4M3 codes as value * 2^-8, through binary16 as
  // V256::fp8_to_f32 (kernels_avx2.cc) widens 8.
  static F fp8_to_f32(__m128i codes) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7),
                                       _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
    return _mm512_cvtph_ps(h);
  }
};

// ---- vdpbf16ps kernels ---------------------------------------------------
// vdpbf16ps multiplies bf16 pairs exactly and adds both products to an fp32
// lane, so every reduction runs over pairs: head_dim pairs for QK (the q
// tile is packed as pairs and a key's pair is one 32-bit broadcast), key
// pairs for PV (weights and values are interleaved per tile below).

inline __m512i bcast_u32(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return _mm512_set1_epi32(static_cast<int32_t>(x));
}

// Interleaves the low and high 16 halves: (x0, x16, x1, x17, ...).
inline __m512i interleave_halves(__m512i x) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, x);
}

// As simd::qk_block, over head-dimension pairs; qt2 rows are w pairs apart.
template <int KB, int MV>
inline void qk2_block(const uint16_t* k, int64_t ks, int64_t d, const uint16_t* qt2, int64_t w,
                      int64_t ss, float* s, int64_t pf) {
  __m512 acc[KB][MV];
#pragma GCC unroll 16
  for (int a = 0; a < KB; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) acc[a][b] = _mm512_setzero_ps();
  const int64_t pairs = d / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    if (pf != 0 && i % 16 == 0)  // one 64-byte line holds 16 pairs
#pragma GCC unroll 16
      for (int a = 0; a < KB; ++a) V512::prefetch(k + a * ks + pf + 2 * i);
    const uint16_t* qrow = qt2 + i * w * 2;
    __m512bh q[MV];
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) q[b] = (__m512bh)_mm512_loadu_si512(qrow + b * 32);
#pragma GCC unroll 16
    for (int a = 0; a < KB; ++a) {
      const __m512bh kk = (__m512bh)bcast_u32(k + a * ks + 2 * i);
#pragma GCC unroll 4
      for (int b = 0; b < MV; ++b) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], kk, q[b]);
    }
  }
  if (d & 1) {  // the last element pairs with 0; the key row is not read past d
    const uint16_t* qrow = qt2 + pairs * w * 2;
#pragma GCC unroll 16
    for (int a = 0; a < KB; ++a) {
      const __m512bh kk = (__m512bh)_mm512_set1_epi32(k[a * ks + d - 1]);
#pragma GCC unroll 4
      for (int b = 0; b < MV; ++b)
        acc[a][b] = _mm512_dpbf16_ps(acc[a][b], kk, (__m512bh)_mm512_loadu_si512(qrow + b * 32));
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < KB; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) _mm512_storeu_ps(s + a * ss + b * 16, acc[a][b]);
}

// Keys per block when the rows fill one vector (decode: up to 16 packed
// rows). A dependent chain of vdpbf16ps runs 1.5x as long as one of FMAs
// (6 cycles against 4 on Zen 5, measured), so two per cycle need 12
// independent accumulators, and the 8 keys of the fp32 kernels allowed
// two thirds of that rate (decode_tile_bench, 16 rows, bf16 QK per tile:
// 855-1061 ns with 8 keys, 752-982 with 16, runs alternated).
// 16 fit the registers and split a 64-key tile evenly.
constexpr int kQk2OneVectorKeys = 16;

// nk >= KB keys in blocks of KB; the last block overlaps, as in
// simd::qk_columns.
template <int KB, int MV>
inline void qk2_blocks(const uint16_t* k, int64_t ks, int64_t nk, int64_t d, const uint16_t* qt2,
                       int64_t w, int64_t ss, float* s, int64_t pf) {
  for (int64_t n = 0;; n += KB) {
    if (n + KB > nk) n = nk - KB;
    qk2_block<KB, MV>(k + n * ks, ks, d, qt2, w, ss, s + n * ss, pf);
    if (n + KB == nk) return;
  }
}

template <int MV>
inline void qk2_columns(const uint16_t* k, int64_t ks, int64_t nk, int64_t d, const uint16_t* qt2,
                        int64_t w, int64_t ss, float* s, int64_t pf) {
  constexpr int kb = V512::kQkAcc / MV < V512::kQkMaxKeys ? V512::kQkAcc / MV : V512::kQkMaxKeys;
  if constexpr (MV == 1) {
    if (nk >= kQk2OneVectorKeys)
      return qk2_blocks<kQk2OneVectorKeys, 1>(k, ks, nk, d, qt2, w, ss, s, pf);
  }
  if (nk >= kb) return qk2_blocks<kb, MV>(k, ks, nk, d, qt2, w, ss, s, pf);
  for (int64_t n = 0; n < nk; ++n) qk2_block<1, MV>(k + n * ks, ks, d, qt2, w, ss, s + n * ss, pf);
}

void qk_bf16(const uint16_t* k, int64_t ks, int64_t nk, int64_t d, const uint16_t* qt2,
             int64_t m_pad, float* s, int64_t ss, int64_t pf) {
  constexpr int64_t w = 64;  // the tables' qk_block_cols
  static_assert(V512::kQkVecs * V512::kLanes == w);
  const int64_t vecs = m_pad / 16, block = (d + 1) / 2 * w * 2;
  int64_t v = 0;
  for (; v + 4 <= vecs; v += 4)
    qk2_columns<4>(k, ks, nk, d, qt2 + v / 4 * block, w, ss, s + v * 16, v == 0 ? pf : 0);
  const uint16_t* tail = qt2 + v / 4 * block;
  pf = v == 0 ? pf : 0;
  switch (vecs - v) {
    case 3:
      return qk2_columns<3>(k, ks, nk, d, tail, w, ss, s + v * 16, pf);
    case 2:
      return qk2_columns<2>(k, ks, nk, d, tail, w, ss, s + v * 16, pf);
    case 1:
      return qk2_columns<1>(k, ks, nk, d, tail, w, ss, s + v * 16, pf);
    default:
      return;
  }
}

template <int MR, int CV>
inline void pv2_block(const uint16_t* pp, int64_t pairs, int64_t ss, const uint16_t* vp,
                      int64_t dv_pad, float* o, const float* alpha) {
  __m512 acc[MR][CV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dv_pad + c * 16), a);
  }
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh vv[CV];
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c)
      vv[c] = (__m512bh)_mm512_loadu_si512(vp + (i * dv_pad + c * 16) * 2);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh p = (__m512bh)bcast_u32(pp + (i * ss + r) * 2);
#pragma GCC unroll 4
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], p);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) _mm512_storeu_ps(o + r * dv_pad + c * 16, acc[r][c]);
}

template <int MR, int CV>
inline void pv2_rows(int64_t rows, const uint16_t* pp, int64_t pairs, int64_t ss,
                     const uint16_t* vp, int64_t dv_pad, float* o, const float* alpha) {
  if constexpr (MR >= 1) {
    if (rows == MR) return pv2_block<MR, CV>(pp, pairs, ss, vp, dv_pad, o, alpha);
    pv2_rows<MR - 1, CV>(rows, pp, pairs, ss, vp, dv_pad, o, alpha);
  }
}

template <int CV>
inline void pv2_columns(int64_t cvecs, int64_t rows, const uint16_t* pp, int64_t pairs, int64_t ss,
                        const uint16_t* vp, int64_t dv_pad, float* o, const float* alpha) {
  if constexpr (CV >= 1) {
    if (cvecs == CV) {
      int64_t m = 0;
      for (; m + 6 <= rows; m += 6)
        pv2_block<6, CV>(pp + m * 2, pairs, ss, vp, dv_pad, o + m * dv_pad, alpha + m);
      return pv2_rows<5, CV>(rows - m, pp + m * 2, pairs, ss, vp, dv_pad, o + m * dv_pad,
                             alpha + m);
    }
    pv2_columns<CV - 1>(cvecs, rows, pp, pairs, ss, vp, dv_pad, o, alpha);
  }
}

// ---- O = alpha O + P V for bf16 V and at most 16 rows (decode) -----------
// vdpbf16ps sums adjacent bf16 pairs, so P V needs (v[n][c], v[n+1][c])
// pairs: keys along the pair. pv_bf16 packs them into scratch per tile for
// prefill; for decode's few rows that packing costs more than the dot
// products. Here two V rows are paired in registers: unpacklo/hi_epi16
// interleave them within each 128-bit lane, so the accumulators hold columns in the order
// lo = {0-3, 8-11, 16-19, 24-27}, hi = {4-7, 12-15, 20-23, 28-31} of each
// 32 columns, and are put back in order once, when stored.

// Tiles of up to this many rows pair V in registers; bigger ones (prefill)
// pack V pairs once per tile and reuse them across all their row blocks.
// At 16 rows (4-token GQA decode) the packing pass cost more than the
// unpacks it saves: docs/PERFORMANCE.md#decode-microkernels.
constexpr int64_t kPvPairInRegistersMaxRows = 16;

// (x0 = columns 0-15, x1 = 16-31) <-> (lo, hi) as above.
inline void to_pair_order(__m512 x0, __m512 x1, __m512* lo, __m512* hi) {
  const __m512i ilo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i ihi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  *lo = _mm512_permutex2var_ps(x0, ilo, x1);
  *hi = _mm512_permutex2var_ps(x0, ihi, x1);
}
inline void from_pair_order(__m512 lo, __m512 hi, __m512* x0, __m512* x1) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  *x0 = _mm512_permutex2var_ps(lo, i0, hi);
  *x1 = _mm512_permutex2var_ps(lo, i1, hi);
}

// The 16-bit lanes of columns [c0, c0 + 32) and [c0 + 32, c0 + 64) that lie
// below dv.
inline void column_masks32(int64_t dv, int64_t c0, __mmask32 mask[2]) {
  for (int q = 0; q < 2; ++q) {
    const int64_t valid = dv - (c0 + 32 * q);
    mask[q] = valid >= 32 ? ~__mmask32{0} : valid <= 0 ? 0 : (__mmask32{1} << valid) - 1;
  }
}

// Rows [0, kRows) of o, columns [c0, c0 + 64) (fewer at the end of dv:
// loads are masked to dv, stores stay within dv_pad); pp holds the
// (p[n][r], p[n+1][r]) pairs of every key pair as 32-bit words
// pp[pair * pp_stride + r]. kRows <= 6: 24 accumulators, 4 paired V
// vectors and a weight fit the 32 registers.
// kPrefetch: for pairs [pf_lo, pf_hi) the block also prefetches both rows
// whole (from column 0), pf further on.
template <int kRows, bool kPrefetch>
inline void pv_rows_bf16_block(const uint32_t* pp, int64_t pp_stride, int64_t pairs, int64_t nk,
                               const uint16_t* v, int64_t vs, int64_t dv, int64_t c0, float* o,
                               int64_t dv_pad, const float* alpha, int64_t pf, int64_t pf_lo,
                               int64_t pf_hi) {
  const int64_t halves = dv_pad - c0 >= 64 ? 2 : (dv_pad - c0 + 31) / 32;  // 32-column groups
  __mmask32 mask[2];
  column_masks32(dv, c0, mask);
  __m512 acc[kRows][4];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      if (q < halves) {
        const float* row = o + r * dv_pad + c0 + 32 * q;
        // dv_pad is a multiple of 16: the second 16 columns may not exist.
        const __m512 x0 = _mm512_loadu_ps(row);
        const __m512 x1 =
            c0 + 32 * q + 16 < dv_pad ? _mm512_loadu_ps(row + 16) : _mm512_setzero_ps();
        to_pair_order(_mm512_mul_ps(x0, a), _mm512_mul_ps(x1, a), &acc[r][2 * q],
                      &acc[r][2 * q + 1]);
      } else {
        acc[r][2 * q] = acc[r][2 * q + 1] = _mm512_setzero_ps();
      }
    }
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const bool second = 2 * i + 1 < nk;  // an odd tail pairs with zeros
    const uint16_t* v0 = v + 2 * i * vs + c0;
    if constexpr (kPrefetch)
      if (i >= pf_lo && i < pf_hi)
        for (int64_t c = 0; c < dv; c += 32) {  // 32 bf16 per 64-byte line
          V512::prefetch(v0 - c0 + pf + c);
          V512::prefetch(v0 - c0 + vs + pf + c);
        }
    __m512i w[4];
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const __m512i a = _mm512_maskz_loadu_epi16(mask[q], v0 + 32 * q);
      const __m512i b =
          second ? _mm512_maskz_loadu_epi16(mask[q], v0 + vs + 32 * q) : _mm512_setzero_si512();
      w[2 * q] = _mm512_unpacklo_epi16(a, b);
      w[2 * q + 1] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * pp_stride + r]));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], p);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      if (q >= halves) continue;
      __m512 x0, x1;
      from_pair_order(acc[r][2 * q], acc[r][2 * q + 1], &x0, &x1);
      float* row = o + r * dv_pad + c0 + 32 * q;
      _mm512_storeu_ps(row, x0);
      if (c0 + 32 * q + 16 < dv_pad) _mm512_storeu_ps(row + 16, x1);
    }
}

// pp[pair][ss] (32-bit words) = the bf16 weight pairs (s[2 pair][m],
// s[2 pair + 1][m]) of columns m < m_pad; an odd last key pairs with 0.
inline void pack_weight_pairs(const float* s, int64_t nk, int64_t m_pad, int64_t ss, uint32_t* pp) {
  for (int64_t i = 0; i < (nk + 1) / 2; ++i) {
    const float* s0 = s + 2 * i * ss;
    for (int64_t m = 0; m < m_pad; m += 16) {
      const __m512 a = _mm512_loadu_ps(s0 + m);
      const __m512 b = 2 * i + 1 < nk ? _mm512_loadu_ps(s0 + ss + m) : _mm512_setzero_ps();
      _mm512_storeu_si512(pp + i * ss + m, interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

template <int kRows>
inline void pv_rows_bf16_any(int64_t rows, const uint32_t* pp, int64_t pp_stride, int64_t pairs,
                             int64_t nk, const uint16_t* v, int64_t vs, int64_t dv, int64_t c0,
                             float* o, int64_t dv_pad, const float* alpha, int64_t pf,
                             int64_t pf_lo, int64_t pf_hi) {
  if constexpr (kRows >= 1) {
    if (rows != kRows)
      return pv_rows_bf16_any<kRows - 1>(rows, pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad,
                                         alpha, pf, pf_lo, pf_hi);
    if (pf != 0)
      pv_rows_bf16_block<kRows, true>(pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad, alpha, pf,
                                      pf_lo, pf_hi);
    else
      pv_rows_bf16_block<kRows, false>(pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad, alpha, 0,
                                       0, 0);
  }
}

// Decode tiles: the weight pairs, rounded to bf16 as pv_bf16 rounds them,
// then blocks of up to 6 rows by 64 columns. Every block reads the whole
// tile, so the prefetch is shared out: block b of B fetches the whole rows
// of pairs [b pairs / B, (b + 1) pairs / B). Issued by the first block alone,
// a tile's lines were asked for in a sixth of the product (16 rows), and
// decode ran 2-8 % slower (GQA 32/8, 16K keys, 2 threads, both placements
// alternated call by call in one process; 2026-11-24 at d3bb6e7 on a Zen 5:
// docs/PERFORMANCE.md#prefetch).
void pv_rows_bf16(const float* s, int64_t nk, int64_t m_pad, int64_t ss, int64_t rows,
                  const uint16_t* v, int64_t vs, int64_t dv, float* o, int64_t dv_pad,
                  const float* alpha, uint16_t* pack, int64_t pf) {
  const int64_t pairs = (nk + 1) / 2;
  uint32_t* pp = reinterpret_cast<uint32_t*>(pack);
  int64_t pp_stride;
  if (rows <= 4) {  // 4 floats per key (s may be packed, ss = 4): pp [pair][4]
    pp_stride = 4;
    const __m128i order = _mm_setr_epi16(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < pairs; ++i) {
      const __m128 a = _mm_loadu_ps(s + 2 * i * ss);
      const __m128 b = 2 * i + 1 < nk ? _mm_loadu_ps(s + (2 * i + 1) * ss) : _mm_setzero_ps();
      const __m128i ab = (__m128i)_mm_cvtne2ps_pbh(b, a);  // a0-a3, b0-b3
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pp + 4 * i), _mm_permutexvar_epi16(order, ab));
    }
  } else {
    pp_stride = ss;
    pack_weight_pairs(s, nk, m_pad, ss, pp);
  }
  const int64_t blocks = (dv_pad + 63) / 64 * ((rows + 5) / 6);
  int64_t b = 0;
  for (int64_t c0 = 0; c0 < dv_pad; c0 += 64)  // the block offsets o and v by c0 itself
    for (int64_t m = 0; m < rows; m += 6, ++b)
      pv_rows_bf16_any<6>(rows - m < 6 ? rows - m : 6, pp + m, pp_stride, pairs, nk, v, vs, dv, c0,
                          o + m * dv_pad, dv_pad, alpha + m, pf, b * pairs / blocks,
                          (b + 1) * pairs / blocks);
}

void pv_bf16(const float* s, int64_t nk, int64_t m_pad, int64_t ss, int64_t rows, const uint16_t* v,
             int64_t vs, int64_t dv, float* o, int64_t dv_pad, const float* alpha, uint16_t* pack,
             int64_t pf) {
  if (rows <= kPvPairInRegistersMaxRows)
    return pv_rows_bf16(s, nk, m_pad, ss, rows, v, vs, dv, o, dv_pad, alpha, pack, pf);
  const int64_t pairs = (nk + 1) / 2;
  uint16_t* pp = pack;                   // [pairs][ss][2] weights
  uint16_t* vp = pack + pairs * 2 * ss;  // [pairs][dv_pad][2] values
  pack_weight_pairs(s, nk, m_pad, ss, reinterpret_cast<uint32_t*>(pp));
  for (int64_t i = 0; i < pairs; ++i) {
    const bool second = 2 * i + 1 < nk;  // an odd tail pairs with zeros
    const uint16_t* v0 = v + 2 * i * vs;
    if (pf != 0)
      for (int64_t c = 0; c < dv; c += 32) {  // 32 bf16 per 64-byte line
        V512::prefetch(v0 + pf + c);
        V512::prefetch(v0 + vs + pf + c);
      }
    for (int64_t c = 0; c < dv_pad; c += 16) {
      const __mmask16 mask = V512::mask_first(dv - c < 0 ? 0 : dv - c);
      const __m256i a = _mm256_maskz_loadu_epi16(mask, v0 + c);
      const __m256i b =
          second ? _mm256_maskz_loadu_epi16(mask, v0 + vs + c) : _mm256_setzero_si256();
      _mm512_storeu_si512(vp + (i * dv_pad + c) * 2,
                          interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
    }
  }
  const int64_t cvecs_total = dv_pad / 16;
  for (int64_t c = 0; c < cvecs_total; c += 4) {
    const int64_t cvecs = cvecs_total - c < 4 ? cvecs_total - c : 4;
    pv2_columns<4>(cvecs, rows, pp, pairs, ss, vp + c * 32, dv_pad, o + c * 16, alpha);
  }
}

// ---- packing q ----------------------------------------------------------

// Transposes a 16 x 16 block held as 16 row vectors (the usual unpack and
// 128-bit-lane shuffle network, 64 shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Loads scale * rows[x][c0 .. c0 + 16) for the 16 rows of group x0 (rows at
// or past `count` and columns at or past d read as 0) and transposes them:
// r[j] then holds column c0 + j of the 16 rows.
inline void load_transposed(const float* const* rows, int64_t x0, int64_t count, int64_t c0,
                            int64_t d, __m512 scale, __m512 r[16]) {
  const __mmask16 mask = V512::mask_first(d - c0);
  for (int i = 0; i < 16; ++i)
    r[i] = x0 + i < count ? _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, rows[x0 + i] + c0), scale)
                          : _mm512_setzero_ps();
  transpose16(r);
}

void pack_q_f32(const float* const* rows, int64_t count, int64_t d, float scale, float* dst,
                int64_t w) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 r[16];
  for (int64_t x0 = 0; x0 < w; x0 += 16)
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      load_transposed(rows, x0, count, c0, d, sc, r);
      for (int j = 0; j < 16 && c0 + j < d; ++j) _mm512_storeu_ps(dst + (c0 + j) * w + x0, r[j]);
    }
}

void pack_q_bf16(const float* const* rows, int64_t count, int64_t d, float scale, uint16_t* dst,
                 int64_t w) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 r[16];
  for (int64_t x0 = 0; x0 < w; x0 += 16)
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      load_transposed(rows, x0, count, c0, d, sc, r);
      for (int j = 0; j < 16 && c0 + j < d; j += 2) {
        const __m512i pairs = interleave_halves((__m512i)_mm512_cvtne2ps_pbh(r[j + 1], r[j]));
        _mm512_storeu_si512(dst + ((c0 + j) / 2 * w + x0) * 2, pairs);
      }
    }
}

// ---- S = K Q^T for up to 4 rows (decode) ----------------------------------
// With one vector of packed rows mostly empty (1-token decode: 1-4 rows),
// broadcasting every key element would spend an FMA per element on 16 lanes
// of which 4 or fewer matter. Here the head dimension runs along the lanes
// instead: 4 keys x 4 rows = 16 accumulators, then one transposing
// reduction (hsum16) turns them into the 16 scores. ~60 instead of ~140
// instructions per key and kv head.

// Lane i of the result = the sum of v[i]'s lanes (45 shuffles and adds),
// added as fp32 or, with kInt, as int32 (the shuffles move bits either way).
template <bool kInt = false>
inline __m512 hsum16(const __m512 v[16]) {
  auto add = [](__m512 a, __m512 b) {
    if constexpr (kInt)
      return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    else
      return _mm512_add_ps(a, b);
  };
  __m512 w[4];
  for (int q = 0; q < 4; ++q) {
    __m512 u[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 a = v[4 * q + 2 * h], b = v[4 * q + 2 * h + 1];
      u[h] = add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]));
    w[q] = add(_mm512_castpd_ps(lo),
               _mm512_castpd_ps(hi));  // lane 4L+j: source j, 128-bit lane L
  }
  const __m512 y =
      add(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xee));
  const __m512 z =
      add(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xee));
  return add(_mm512_shuffle_f32x4(y, z, 0x88), _mm512_shuffle_f32x4(y, z, 0xdd));
}

// Writes the scores of keys [0, keys) of a 4-key block, packed: hsum16
// leaves key a's row r in lane 4a + r, which is s[a * 4 + r].
inline void store_rows4(__m512 sums, int keys, float* s) {
  if (keys == 4)
    _mm512_storeu_ps(s, sums);
  else
    _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << (4 * keys)) - 1u), sums);
}
inline void store_rows4(const __m512 acc[16], int keys, float* s) {
  store_rows4(hsum16(acc), keys, s);
}

// Lanes 4a + r = kscale[a * kss] for keys a < keys (the others 0): the
// 8-bit kernels' per-key scales laid out as the packed scores. Built in
// registers: four scalar stores to the stack and a vector load of them
// stalled on store forwarding, and quantize_weight_pairs4 took 1.5x the
// time of a P V tile of 1-token int8 decode (decode_tile_bench).
inline __m512 key_scales4(const float* kscale, int64_t kss, int keys) {
  const __m128 k4 =
      _mm_setr_ps(kscale[0], keys > 1 ? kscale[kss] : 0.0f, keys > 2 ? kscale[2 * kss] : 0.0f,
                  keys > 3 ? kscale[3 * kss] : 0.0f);
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(k4));
}

// One block of kKeys (1-4) keys against the 4 query rows q[r * qs ...]:
// acc[a * 4 + r]. Keys and queries are fp32 (Elem = QElem = float, 16 per
// vector), bf16 pairs (both uint16_t, 32 per vector, vdpbf16ps), or bf16
// keys widened exactly to fp32 in registers against fp32 queries (Elem =
// uint16_t, QElem = float, 16 per vector: the avx512 target, which has no
// vdpbf16ps). The key count and the prefetch are template parameters and
// the chunk loop has no calls, so the 16 accumulators stay in registers (a
// version that took them through a lambda kept them on the stack, one
// store per FMA, and ran QK at half speed). The last chunk is loaded under
// `tail`, the others whole.
template <int kKeys, bool kPrefetch, class Elem, class QElem>
inline void rows4_block(const Elem* k, int64_t ks, int64_t chunks, __mmask32 tail, const QElem* q,
                        int64_t qs, float* s, int64_t pf) {
  constexpr int kPer = 64 / sizeof(QElem);  // elements per vector
  constexpr bool kWiden = sizeof(Elem) == 2 && sizeof(QElem) == 4;
  constexpr bool kFp8 = sizeof(Elem) == 1;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  auto fma = [](__m512 a, __m512i kv, __m512i qv) {
    if constexpr (sizeof(QElem) == 2)
      return _mm512_dpbf16_ps(a, (__m512bh)kv, (__m512bh)qv);
    else
      return _mm512_fmadd_ps(_mm512_castsi512_ps(kv), _mm512_castsi512_ps(qv), a);
  };
  int64_t c = 0;
  if constexpr (kFp8) {
    // fp8 keys two chunks (32 codes) at a time: one 512-bit sign-extend,
    // shift and mask make 32 binary16 values (V512::fp8_to_f32 makes 16),
    // whose halves are widened when used; q is read by the FMAs (memory
    // operands), so the keys' vectors and the 16 accumulators stay in
    // registers. 6 instructions of decoding per 32 codes where 10 were
    // (docs/PERFORMANCE.md#fp8-decode).
    for (; c + 2 <= chunks; c += 2) {
      const __mmask32 mask = c + 2 == chunks ? 0xffffu | (tail << 16) : ~__mmask32{0};
      __m512i kh[kKeys];
#pragma GCC unroll 4
      for (int a = 0; a < kKeys; ++a) {
        const Elem* row = k + a * ks + c * kPer;
        if constexpr (kPrefetch)
          if (c % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
        const __m256i b = _mm256_maskz_loadu_epi8(mask, row);
        kh[a] = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                 _mm512_set1_epi16(static_cast<int16_t>(0xbf80)));
      }
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half)
#pragma GCC unroll 4
        for (int a = 0; a < kKeys; ++a) {
          const __m512 kv = _mm512_cvtph_ps(half == 0 ? _mm512_castsi512_si256(kh[a])
                                                      : _mm512_extracti64x4_epi64(kh[a], 1));
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r)
            acc[a * 4 + r] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + r * qs + (c + half) * kPer),
                                             acc[a * 4 + r]);
        }
    }
  }
  for (; c < chunks; ++c) {
    const bool last = c + 1 == chunks;
    __m512i qv[4], kv[kKeys];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) qv[r] = _mm512_loadu_si512(q + r * qs + c * kPer);
#pragma GCC unroll 4
    for (int a = 0; a < kKeys; ++a) {
      const Elem* row = k + a * ks + c * kPer;
      // A widened chunk is half a line, an fp8 chunk a quarter: one
      // prefetch per line.
      if constexpr (kPrefetch)
        if (kFp8 ? c % 4 == 0 : !kWiden || c % 2 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
      if constexpr (kFp8) {
        const __m128i b = last ? _mm_maskz_loadu_epi8(__mmask16(tail), row)
                               : _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        kv[a] = _mm512_castps_si512(V512::fp8_to_f32(b));
      } else if constexpr (kWiden) {
        const __m256i h = last ? _mm256_maskz_loadu_epi16(__mmask16(tail), row)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        kv[a] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
      } else if constexpr (sizeof(Elem) == 2) {
        kv[a] = last ? _mm512_maskz_loadu_epi16(tail, row) : _mm512_loadu_si512(row);
      } else {
        kv[a] = last ? _mm512_castps_si512(_mm512_maskz_loadu_ps(__mmask16(tail), row))
                     : _mm512_loadu_si512(row);
      }
    }
#pragma GCC unroll 4
    for (int a = 0; a < kKeys; ++a)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[a * 4 + r] = fma(acc[a * 4 + r], kv[a], qv[r]);
  }
  // A copy for the reduction: were acc's own address taken, GCC would keep
  // acc in memory and store it after every FMA.
  __m512 sums[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sums[i] = acc[i];
  store_rows4(sums, kKeys, s);
}

// S = K Q^T for nk keys in blocks of 4 (a last block of 1-3 keys alone).
template <bool kPrefetch, class Elem, class QElem>
inline void rows4_keys(const Elem* k, int64_t ks, int64_t nk, int64_t chunks, __mmask32 tail,
                       const QElem* q, int64_t qs, float* s, int64_t pf) {
  int64_t n = 0;
  for (; n + 4 <= nk; n += 4)
    rows4_block<4, kPrefetch>(k + n * ks, ks, chunks, tail, q, qs, s + n * 4, pf);
  switch (nk - n) {
    case 3:
      return rows4_block<3, kPrefetch>(k + n * ks, ks, chunks, tail, q, qs, s + n * 4, pf);
    case 2:
      return rows4_block<2, kPrefetch>(k + n * ks, ks, chunks, tail, q, qs, s + n * 4, pf);
    case 1:
      return rows4_block<1, kPrefetch>(k + n * ks, ks, chunks, tail, q, qs, s + n * 4, pf);
    default:
      return;
  }
}

// KernelTable::qk_rows_f32 (float keys and queries), qk_rows_bf16 (bf16
// pairs), qk_rows_widen (bf16 keys, fp32 queries) and, unscaled, the fp8
// keys of qk_rows_fp8.
template <class Elem, class QElem>
void qk_rows(const Elem* k, int64_t ks, int64_t nk, int64_t d, const QElem* q, int64_t qs, float* s,
             int64_t pf) {
  constexpr int64_t kPer = 64 / sizeof(QElem);
  const int64_t chunks = (d + kPer - 1) / kPer;
  const int64_t last = d - (chunks - 1) * kPer;
  const __mmask32 tail = last >= 32 ? ~__mmask32{0} : (__mmask32{1} << last) - 1;
  if (pf != 0)
    rows4_keys<true>(k, ks, nk, chunks, tail, q, qs, s, pf);
  else
    rows4_keys<false>(k, ks, nk, chunks, tail, q, qs, s, pf);
}

// fp8 keys decoded to value * 2^-8 against fp32 rows, then the scores
// times 2^8 and each key's scale.
void qk_rows_fp8(const uint8_t* k, int64_t ks, int64_t nk, int64_t d, const float* q, int64_t qs,
                 const float* kscale, int64_t kss, float* s, int64_t pf) {
  qk_rows(k, ks, nk, d, q, qs, s, pf);
  int64_t n = 0;
  for (; n + 4 <= nk; n += 4)
    _mm512_storeu_ps(s + 4 * n, _mm512_mul_ps(_mm512_loadu_ps(s + 4 * n),
                                              _mm512_mul_ps(key_scales4(kscale + n * kss, kss, 4),
                                                            _mm512_set1_ps(256.0f))));
  for (; n < nk; ++n)
    _mm_storeu_ps(s + 4 * n,
                  _mm_mul_ps(_mm_loadu_ps(s + 4 * n), _mm_set1_ps(256.0f * kscale[n * kss])));
}

// ---- S = K Q^T for up to 4 rows over int8 keys ----------------------------
// int8 keys widened to int16 (vpmovsxbw, 32 codes per vector) against int16
// query rows: vpmaddwd multiplies 32 pairs and sums adjacent products into
// 16 int32 lanes, so a vector of key codes needs no conversion to float and
// covers twice the columns of an fp32 or widened-bf16 vector. The int32
// sums are exact (the caller bounds head_dim * 127 * max|q16| < 2^31); the
// per-key scale and per-row factor apply once, to the reduced scores.
// kVnni: vpdpwssd (AVX512_VNNI) does vpmaddwd's work and the add in one
// instruction.
template <bool kVnni>
inline __m512i dot_add(__m512i acc, __m512i a, __m512i b) {
  if constexpr (kVnni)
    return _mm512_dpwssd_epi32(acc, a, b);
  else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

template <int kKeys, bool kPrefetch, bool kVnni>
inline void rows4_i8_block(const int8_t* k, int64_t ks, int64_t chunks, __mmask32 tail,
                           const int16_t* q, int64_t qs, __m512 rf, const float* kscale,
                           int64_t kss, float* s, int64_t pf) {
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; ++c) {
    const bool last = c + 1 == chunks;
    __m512i qv[4], kv[kKeys];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) qv[r] = _mm512_loadu_si512(q + r * qs + c * 32);
#pragma GCC unroll 4
    for (int a = 0; a < kKeys; ++a) {
      const int8_t* row = k + a * ks + c * 32;
      if constexpr (kPrefetch)  // a chunk is half a line
        if (c % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(row + pf), _MM_HINT_T0);
      const __m256i b = last ? _mm256_maskz_loadu_epi8(tail, row)
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      kv[a] = _mm512_cvtepi8_epi16(b);
    }
#pragma GCC unroll 4
    for (int a = 0; a < kKeys; ++a)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[a * 4 + r] = dot_add<kVnni>(acc[a * 4 + r], kv[a], qv[r]);
  }
  __m512 sums[16];  // a copy for the reduction, as in rows4_block
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sums[i] = _mm512_castsi512_ps(acc[i]);
  const __m512 dots = _mm512_cvtepi32_ps(_mm512_castps_si512(hsum16<true>(sums)));
  store_rows4(_mm512_mul_ps(_mm512_mul_ps(dots, rf), key_scales4(kscale, kss, kKeys)), kKeys, s);
}

template <bool kPrefetch, bool kVnni>
inline void rows4_i8_keys(const int8_t* k, int64_t ks, int64_t nk, int64_t chunks, __mmask32 tail,
                          const int16_t* q, int64_t qs, __m512 rf, const float* kscale, int64_t kss,
                          float* s, int64_t pf) {
  int64_t n = 0;
  for (; n + 4 <= nk; n += 4)
    rows4_i8_block<4, kPrefetch, kVnni>(k + n * ks, ks, chunks, tail, q, qs, rf, kscale + n * kss,
                                        kss, s + n * 4, pf);
  switch (nk - n) {
    case 3:
      return rows4_i8_block<3, kPrefetch, kVnni>(k + n * ks, ks, chunks, tail, q, qs, rf,
                                                 kscale + n * kss, kss, s + n * 4, pf);
    case 2:
      return rows4_i8_block<2, kPrefetch, kVnni>(k + n * ks, ks, chunks, tail, q, qs, rf,
                                                 kscale + n * kss, kss, s + n * 4, pf);
    case 1:
      return rows4_i8_block<1, kPrefetch, kVnni>(k + n * ks, ks, chunks, tail, q, qs, rf,
                                                 kscale + n * kss, kss, s + n * 4, pf);
    default:
      return;
  }
}

template <bool kVnni>
void qk_rows_i8(const int8_t* k, int64_t ks, int64_t nk, int64_t d, const int16_t* q, int64_t qs,
                const float* qf, const float* kscale, int64_t kss, float* s, int64_t pf) {
  const int64_t chunks = (d + 31) / 32;
  const int64_t last = d - (chunks - 1) * 32;
  const __mmask32 tail = last >= 32 ? ~__mmask32{0} : (__mmask32{1} << last) - 1;
  const __m512 rf = _mm512_broadcast_f32x4(_mm_loadu_ps(qf));  // lane 4a + r: row r's factor
  if (pf != 0)
    rows4_i8_keys<true, kVnni>(k, ks, nk, chunks, tail, q, qs, rf, kscale, kss, s, pf);
  else
    rows4_i8_keys<false, kVnni>(k, ks, nk, chunks, tail, q, qs, rf, kscale, kss, s, pf);
}

// ---- O = alpha O + P V for int8 V and at most 16 rows (decode) -----------
// simd::pv over int8 codes spends two conversions (vpmovsxbd, vcvtdq2ps) per
// 16 values beside the multiply-adds. Here the weights, times each key's
// value scale, are rounded to int16 per row (kernel_table.h gives the
// bound) and multiplied with the codes in int32: two V rows are widened to
// int16 and interleaved (as pv_rows_bf16 pairs bf16 rows), and one
// vpmaddwd (vpdpwssd) takes a key pair for 16 columns. Accumulator lanes
// follow pv_rows_bf16's pair order.

// Keys per rounding: 32 pairs of 2 * 127 * 32767 stay below 2^31 in a
// lane; the kernel rounds and flushes per chunk of this many keys.
constexpr int64_t kPvIntChunkKeys = 64;

// pp[pair * pp_stride + r] = the int16 weight pair of keys (2 pair, 2 pair
// + 1) of row r < rows (an odd last key pairs with 0), factor[r] = the
// value of one step: weights s[n * ss + r] * vscale[n * vss].
inline void quantize_weight_pairs(const float* s, int64_t nk, int64_t ss, int64_t rows,
                                  const float* vscale, int64_t vss, uint32_t* pp, int64_t pp_stride,
                                  float* factor) {
  const __mmask16 live = V512::mask_first(rows);
  __m512 mx = _mm512_setzero_ps();
  for (int64_t n = 0; n < nk; ++n)  // weights are >= 0
    mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + n * ss),
                                         _mm512_set1_ps(vscale[n * vss])));
  // 32767 steps up to the row's largest weight; a row without one gets
  // factor 0 (non-finite weights and scales never reach here: the tile
  // loop sends such tiles to its slow path).
  const __mmask16 some = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(some, _mm512_set1_ps(32767.0f), mx);
  _mm512_mask_storeu_ps(factor, live, _mm512_mul_ps(mx, _mm512_set1_ps(1.0f / 32767)));
  auto q16 = [&](int64_t n) {
    if (n >= nk) return _mm512_setzero_si512();
    const __m512 w =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + n * ss), _mm512_set1_ps(vscale[n * vss]));
    return _mm512_cvtps_epi32(_mm512_mul_ps(w, inv));  // to nearest, <= 32767
  };
  for (int64_t i = 0; 2 * i < nk; ++i) {
    const __m512i lo = q16(2 * i), hi = q16(2 * i + 1);
    const __m512i pair =
        _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
    _mm512_mask_storeu_epi32(pp + i * pp_stride, live, pair);
  }
}

// Every 128-bit quarter gets op over all four quarters, lane by lane.
template <class Op>
inline __m512 across_quarters(__m512 x, Op op) {
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  return op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
}

// As quantize_weight_pairs for the packed weights of 1-4 rows, s[n * 4 +
// r] (qk_rows_*'s layout; pp_stride 4): 4 keys per vector, the rows' largest
// weights taken across the vector's quarters, a pair of keys' words put
// together by one 16-bit permute.
inline void quantize_weight_pairs4(const float* s, int64_t nk, const float* vscale, int64_t vss,
                                   uint32_t* pp, float* factor) {
  const int64_t vecs = (nk + 3) / 4;
  auto weights = [&](int64_t j) {
    const int keys = static_cast<int>(nk - 4 * j < 4 ? nk - 4 * j : 4);
    return _mm512_mul_ps(_mm512_maskz_loadu_ps(V512::mask_first(4 * keys), s + 16 * j),
                         key_scales4(vscale + 4 * j * vss, vss, keys));
  };
  __m512 mx = _mm512_setzero_ps();
  for (int64_t j = 0; j < vecs; ++j) mx = _mm512_max_ps(mx, weights(j));
  mx = across_quarters(mx, V512::max);
  const __mmask16 some = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(some, _mm512_set1_ps(32767.0f), mx);
  _mm_storeu_ps(factor, _mm512_castps512_ps128(_mm512_mul_ps(mx, _mm512_set1_ps(1.0f / 32767))));
  // int16 lanes (key a, row r) at 4a + r -> words (k0 r, k1 r) of 2 pairs.
  const __m256i order = _mm256_setr_epi16(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (int64_t j = 0; j < vecs; ++j) {
    const __m256i q = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(weights(j), inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + 8 * j), _mm256_permutexvar_epi16(order, q));
  }
}

// Rows [0, kRows) of o, columns [c0, c0 + 64) (fewer at the end of dv), as
// pv_rows_bf16_block: kRows <= 6 keeps 24 accumulators, 4 paired V vectors
// and a weight in the 32 registers. o = alpha o + factor * (the int32 sums).
template <int kRows, bool kPrefetch, bool kVnni>
inline void pv_i8_block(const uint32_t* pp, int64_t pp_stride, int64_t pairs, int64_t nk,
                        const int8_t* v, int64_t vs, int64_t dv, int64_t c0, float* o,
                        int64_t dv_pad, const float* alpha, const float* factor, int64_t pf,
                        int64_t pf_lo, int64_t pf_hi) {
  const int64_t halves = dv_pad - c0 >= 64 ? 2 : (dv_pad - c0 + 31) / 32;
  __mmask32 mask[2];
  column_masks32(dv, c0, mask);
  __m512i acc[kRows][4];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t i = 0; i < pairs; ++i) {
    const bool second = 2 * i + 1 < nk;
    const int8_t* v0 = v + 2 * i * vs + c0;
    if constexpr (kPrefetch)
      if (i >= pf_lo && i < pf_hi)
        for (int64_t c = 0; c < dv; c += 64) {
          V512::prefetch(v0 - c0 + pf + c);
          V512::prefetch(v0 - c0 + vs + pf + c);
        }
    __m512i w[4];
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const __m512i a = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask[q], v0 + 32 * q));
      const __m512i b =
          second ? _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask[q], v0 + vs + 32 * q))
                 : _mm512_setzero_si512();
      w[2 * q] = _mm512_unpacklo_epi16(a, b);
      w[2 * q + 1] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pp[i * pp_stride + r]));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = dot_add<kVnni>(acc[r][j], w[j], p);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]), f = _mm512_set1_ps(factor[r]);
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      if (q >= halves) continue;
      __m512 x0, x1;
      from_pair_order(_mm512_cvtepi32_ps(acc[r][2 * q]), _mm512_cvtepi32_ps(acc[r][2 * q + 1]), &x0,
                      &x1);
      float* row = o + r * dv_pad + c0 + 32 * q;
      _mm512_storeu_ps(row, _mm512_fmadd_ps(x0, f, _mm512_mul_ps(_mm512_loadu_ps(row), a)));
      if (c0 + 32 * q + 16 < dv_pad)
        _mm512_storeu_ps(row + 16,
                         _mm512_fmadd_ps(x1, f, _mm512_mul_ps(_mm512_loadu_ps(row + 16), a)));
    }
  }
}

template <int kRows, bool kVnni>
inline void pv_i8_any(int64_t rows, const uint32_t* pp, int64_t pp_stride, int64_t pairs,
                      int64_t nk, const int8_t* v, int64_t vs, int64_t dv, int64_t c0, float* o,
                      int64_t dv_pad, const float* alpha, const float* factor, int64_t pf,
                      int64_t pf_lo, int64_t pf_hi) {
  if constexpr (kRows >= 1) {
    if (rows != kRows)
      return pv_i8_any<kRows - 1, kVnni>(rows, pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad,
                                         alpha, factor, pf, pf_lo, pf_hi);
    if (pf != 0)
      pv_i8_block<kRows, true, kVnni>(pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad, alpha,
                                      factor, pf, pf_lo, pf_hi);
    else
      pv_i8_block<kRows, false, kVnni>(pp, pp_stride, pairs, nk, v, vs, dv, c0, o, dv_pad, alpha,
                                       factor, 0, 0, 0);
  }
}

// KernelTable::pv_i8: the integer product for up to 16 rows, else simd's.
// Blocks of up to 6 rows by 64 columns share the prefetch out by pairs, as
// pv_rows_bf16's do.
template <bool kVnni>
void pv_i8(const float* s, int64_t nk, int64_t ss, int64_t rows, const int8_t* v, int64_t vs,
           const float* vscale, int64_t vss, int64_t dv, float* o, int64_t dv_pad,
           const float* alpha, uint16_t* pack, int64_t pf, const int64_t* seen) {
  if (rows > 16)
    return simd::pv_i8<V512>(s, nk, ss, rows, v, vs, vscale, vss, dv, o, dv_pad, alpha, pack, pf,
                             seen);
  float* factor = reinterpret_cast<float*>(pack);
  uint32_t* pp = reinterpret_cast<uint32_t*>(pack) + 16;
  const int64_t pp_stride = rows <= 4 ? 4 : 16;
  static constexpr float kOnes[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  for (int64_t k0 = 0; k0 < nk; k0 += kPvIntChunkKeys) {
    const int64_t n = nk - k0 < kPvIntChunkKeys ? nk - k0 : kPvIntChunkKeys, pairs = (n + 1) / 2;
    if (ss == 4)
      quantize_weight_pairs4(s + k0 * ss, n, vscale + k0 * vss, vss, pp, factor);
    else
      quantize_weight_pairs(s + k0 * ss, n, ss, rows, vscale + k0 * vss, vss, pp, pp_stride,
                            factor);
    const int8_t* vk = v + k0 * vs;
    const int64_t blocks = (dv_pad + 63) / 64 * ((rows + 5) / 6);
    int64_t b = 0;
    for (int64_t c0 = 0; c0 < dv_pad; c0 += 64)
      for (int64_t m = 0; m < rows; m += 6, ++b)
        pv_i8_any<6, kVnni>(rows - m < 6 ? rows - m : 6, pp + m, pp_stride, pairs, n, vk, vs, dv,
                            c0, o + m * dv_pad, dv_pad, k0 == 0 ? alpha + m : kOnes, factor + m, pf,
                            b * pairs / blocks, (b + 1) * pairs / blocks);
  }
}

// KernelTable::dequant_bf16: dequant_f32's values rounded to bf16.
void dequant_bf16(const uint8_t* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                  const float* scale, int64_t scale_stride, int64_t block, bool fp8, uint16_t* dst,
                  int64_t dst_row_stride, int64_t pf) {
  const float unit = fp8 ? 256.0f : 1.0f;
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* row = src + n * src_row_stride;
    const float* sc = scale + n * scale_stride;
    if (pf != 0)
      for (int64_t c = 0; c < cols; c += 64) V512::prefetch(row + pf + c);
    for (int64_t c = 0; c < dst_row_stride; c += 16) {
      const int64_t valid = cols - c < 0 ? 0 : cols - c;
      __m512 x = _mm512_setzero_ps();
      if (valid > 0) {
        x = fp8 ? V512::widen_fp8(row + c, valid)
                : V512::widen_i8(reinterpret_cast<const int8_t*>(row) + c, valid);
        x = _mm512_mul_ps(x, _mm512_set1_ps(sc[block > 0 ? c / block : 0] * unit));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + n * dst_row_stride + c),
                          (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// ---- the online-softmax step on packed 4-row scores -----------------------
// simd::softmax on s[n][16] with 4 live rows spends 16 lanes of max, exp and
// sum per key on 4 values. Packed, lane 4a + r of a vector is key a's row r,
// so a vector holds 4 keys and every lane counts: a row's values sit in the
// same lane of each 128-bit quarter, and two quarter swaps reduce them.

void softmax_rows4(float* s, int64_t nk, float* row_max, float* row_sum, float* alpha) {
  const int64_t vecs = (nk + 3) / 4;
  // Lanes past the last key read as -inf: no effect on the max, weight 0.
  const __mmask16 tail = V512::mask_first(nk * 4 - (vecs - 1) * 16);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto load = [&](int64_t j) {
    return j + 1 < vecs ? _mm512_loadu_ps(s + 16 * j)
                        : _mm512_mask_loadu_ps(ninf, tail, s + 16 * j);
  };
  const __m512 old_max = _mm512_broadcast_f32x4(_mm_loadu_ps(row_max));
  __m512 mx0 = old_max, mx1 = old_max;
  int64_t j = 0;
  for (; j + 2 <= vecs; j += 2) {
    mx0 = V512::max(load(j), mx0);
    mx1 = V512::max(load(j + 1), mx1);
  }
  if (j < vecs) mx0 = V512::max(load(j), mx0);
  const __m512 new_max = across_quarters(V512::max(mx0, mx1), V512::max);
  // As in simd::softmax: a row with no finite score yet shifts by 0.
  const __m512 shift = V512::ninf_to_zero(new_max);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (j = 0; j < vecs; ++j) {
    const __m512 p = V512::exp(_mm512_sub_ps(load(j), shift));
    if (j + 1 < vecs)
      _mm512_storeu_ps(s + 16 * j, p);
    else
      _mm512_mask_storeu_ps(s + 16 * j, tail, p);
    if (j & 1)
      sum1 = _mm512_add_ps(sum1, p);
    else
      sum0 = _mm512_add_ps(sum0, p);
  }
  const __m512 sum = across_quarters(V512::add(sum0, sum1), V512::add);
  const __m128 a = _mm512_castps512_ps128(V512::exp(_mm512_sub_ps(old_max, shift)));
  _mm_storeu_ps(row_sum, _mm_fmadd_ps(_mm_loadu_ps(row_sum), a, _mm512_castps512_ps128(sum)));
  _mm_storeu_ps(row_max, _mm512_castps512_ps128(new_max));
  _mm_storeu_ps(alpha, a);
}

constexpr KernelTable kAvx512Table = {
    V512::kLanes,
    V512::kQkVecs* V512::kLanes,
    simd::qk_f32<V512>,
    simd::softcap<V512>,
    simd::softmax<V512>,
    simd::pv_f32<V512>,
    simd::widen_bf16<V512>,
    pack_q_f32,
    4,
    qk_rows<float, float>,
    softmax_rows4,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    qk_rows<uint16_t, float>,
    simd::pv_widen<V512>,
    simd::dequant_f32<V512>,
    nullptr,
    qk_rows_i8<false>,
    qk_rows_fp8,
    16,
    pv_i8<false>,
    simd::pv_fp8<V512>,
    simd::pv_i8<V512>,
};

constexpr KernelTable kAvx512Bf16Table = {
    V512::kLanes,
    V512::kQkVecs* V512::kLanes,
    simd::qk_f32<V512>,
    simd::softcap<V512>,
    simd::softmax<V512>,
    simd::pv_f32<V512>,
    simd::widen_bf16<V512>,
    pack_q_f32,
    4,
    qk_rows<float, float>,
    softmax_rows4,
    qk_bf16,
    pv_bf16,
    pack_q_bf16,
    qk_rows<uint16_t, uint16_t>,
    nullptr,
    nullptr,
    simd::dequant_f32<V512>,
    dequant_bf16,
    qk_rows_i8<true>,
    qk_rows_fp8,
    16,
    pv_i8<true>,
    simd::pv_fp8<V512>,
    simd::pv_i8<V512>,
};

}  // namespace

#if defined(ATTNKIT_AVX512_EMULATED)
const KernelTable* emulated_avx512_kernel_table() { return &kAvx512Table; }
const KernelTable* emulated_avx512bf16_kernel_table() { return &kAvx512Bf16Table; }
#else
const KernelTable* avx512_kernel_table() { return &kAvx512Table; }
const KernelTable* avx512bf16_kernel_table() { return &kAvx512Bf16Table; }
#endif

}  // namespace attnkit::kernels::cpu

#else  // the compiler was not given the AVX-512 flags

namespace attnkit::kernels::cpu {
const KernelTable* avx512_kernel_table() { return nullptr; }
const KernelTable* avx512bf16_kernel_table() { return nullptr; }
}  // namespace attnkit::kernels::cpu

#endif
