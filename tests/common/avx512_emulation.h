// Tests and fuzzers only: force-included (-include) into a second
// compilation of src/kernels/cpu/kernels_avx512.cc, without any AVX-512
// flag, so that the AVX-512 kernels run, lane by lane in portable code, on
// a CPU without AVX-512 (cmake/attnkit_avx512_emulation.cmake). Their logic
// (tails, masks, layouts, the bf16 pair packing, the tile loop's use of
// them) is then tested on every machine, not only where the CI happens to
// land on an AVX-512 CPU; their speed is not.
//
// The intrinsics come from SIMDe (Debian's libsimde-dev), which implements
// them from their specifications. The few that SIMDe 0.7.4 lacks are below,
// written from Intel's pseudo-code. Masked loads and stores touch only the
// lanes on their mask: the hardware suppresses faults off the mask, and a
// sanitizer build of the emulation then reports any read the kernels make
// past a buffer, which the real instructions would hide.
#pragma once

#define ATTNKIT_AVX512_EMULATED 1
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnkit/tensor.h"

// Names SIMDe leaves without an alias.
typedef simde__mmask16 __mmask16;
typedef simde__mmask32 __mmask32;
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC

namespace attnkit_avx512_emulation {

template <class Vec, class Lane, int kLanes>
inline Vec masked_load(Vec src, uint64_t mask, const void* p) {
  Lane lanes[kLanes];
  std::memcpy(lanes, &src, sizeof lanes);
  for (int i = 0; i < kLanes; ++i)
    if ((mask >> i) & 1)
      std::memcpy(&lanes[i], static_cast<const char*>(p) + i * sizeof(Lane), sizeof(Lane));
  Vec out;
  std::memcpy(&out, lanes, sizeof lanes);
  return out;
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  return masked_load<simde__m512, float, 16>(simde_mm512_setzero_ps(), k, p);
}
inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
  return masked_load<simde__m512, float, 16>(src, k, p);
}
inline simde__m512i maskz_loadu_epi16(simde__mmask32 k, const void* p) {
  return masked_load<simde__m512i, uint16_t, 32>(simde_mm512_setzero_si512(), k, p);
}
inline simde__m256i maskz_loadu_epi16_256(simde__mmask16 k, const void* p) {
  return masked_load<simde__m256i, uint16_t, 16>(simde_mm256_setzero_si256(), k, p);
}

inline simde__m128i maskz_loadu_epi8_128(simde__mmask16 k, const void* p) {
  return masked_load<simde__m128i, uint8_t, 16>(simde_mm_setzero_si128(), k, p);
}
inline simde__m256i maskz_loadu_epi8_256(simde__mmask32 k, const void* p) {
  return masked_load<simde__m256i, uint8_t, 32>(simde_mm256_setzero_si256(), k, p);
}

template <class Lane, int kLanes, class Vec>
inline void masked_store(void* p, uint64_t mask, Vec a) {
  Lane lanes[kLanes];
  std::memcpy(lanes, &a, sizeof lanes);
  for (int i = 0; i < kLanes; ++i)
    if ((mask >> i) & 1)
      std::memcpy(static_cast<char*>(p) + i * sizeof(Lane), &lanes[i], sizeof(Lane));
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  masked_store<float, 16>(p, k, a);
}

// The conversions lane by lane: the first kLanes lanes of `a`, of type In,
// mapped through f into a vector of type Out lanes.
template <class Vec, class Out, class In, int kLanes, class From, class F>
inline Vec map_lanes(From a, F f) {
  In in[kLanes];
  Out out[kLanes];
  std::memcpy(in, &a, sizeof in);
  for (int i = 0; i < kLanes; ++i) out[i] = f(in[i]);
  Vec r;
  std::memcpy(&r, out, sizeof out);
  return r;
}

inline simde__m512i cvtepu16_epi32(simde__m256i a) {
  return map_lanes<simde__m512i, uint32_t, uint16_t, 16>(a, [](uint16_t x) { return x; });
}

inline simde__m512i cvtepi8_epi32(simde__m128i a) {
  return map_lanes<simde__m512i, int32_t, int8_t, 16>(a, [](int8_t x) { return x; });
}

inline simde__m512 cvtepi32_ps(simde__m512i a) {
  return map_lanes<simde__m512, float, int32_t, 16>(
      a, [](int32_t x) { return static_cast<float>(x); });
}

// VPMADDWD: lane i = a[2i] b[2i] + a[2i + 1] b[2i + 1] in int32 (wrapping
// only for -32768 * -32768 pairs, which the kernels never form).
inline simde__m512i madd_epi16(simde__m512i a, simde__m512i b) {
  int16_t x[32], y[32];
  int32_t out[16];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  for (int i = 0; i < 16; ++i)
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(int32_t{x[2 * i]} * y[2 * i]) +
                                  static_cast<uint32_t>(int32_t{x[2 * i + 1]} * y[2 * i + 1]));
  simde__m512i r;
  std::memcpy(&r, out, sizeof out);
  return r;
}

// VCVTPS2DQ under the default rounding (to nearest, ties to even); the
// kernels convert only values within int32's range.
inline simde__m512i cvtps_epi32(simde__m512 a) {
  return map_lanes<simde__m512i, int32_t, float, 16>(
      a, [](float x) { return static_cast<int32_t>(std::nearbyint(x)); });
}

// VPMOVDW: each int32 lane's low 16 bits.
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  return map_lanes<simde__m256i, int16_t, int32_t, 16>(
      a, [](int32_t x) { return static_cast<int16_t>(x); });
}

inline void mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i a) {
  masked_store<int32_t, 16>(p, k, a);
}

// VCVTPH2PS, exact (subnormals, Inf and NaN included).
inline simde__m512 cvtph_ps(simde__m256i a) {
  return map_lanes<simde__m512, float, uint16_t, 16>(a, attnkit::f16_to_float);
}

// VCVTNE2PS2BF16's conversion: round to nearest even; denormal inputs
// become a signed zero; NaN stays a (quiet) NaN.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t exponent = u & 0x7f800000u, mantissa = u & 0x007fffffu;
  if (exponent == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (exponent == 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | (mantissa != 0 ? 0x0040u : 0u));
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Words [0, n) from b, [n, 2n) from a: the low half holds the second
// operand, as in the instruction.
template <class Bh, class F, int n>
inline Bh cvtne2ps_pbh(F a, F b) {
  float fa[n], fb[n];
  uint16_t out[2 * n];
  std::memcpy(fa, &a, sizeof fa);
  std::memcpy(fb, &b, sizeof fb);
  for (int i = 0; i < n; ++i) {
    out[i] = to_bf16(fb[i]);
    out[n + i] = to_bf16(fa[i]);
  }
  Bh r;
  std::memcpy(&r, out, sizeof out);
  return r;
}

// vreduceps with 0 fraction bits: x minus x rounded to an integer (to
// nearest, ties to even: the rounding mode bits of imm8 are 0 wherever it is
// used); 0 for infinities, whose lanes the kernels mask.
inline simde__m512 reduce_ps(simde__m512 a, int imm8) {
  (void)imm8;
  return map_lanes<simde__m512, float, float, 16>(a, [](float x) {
    if (std::isinf(x)) return 0.0f;
    return x - std::nearbyint(x);
  });
}

inline simde__m256bh cvtneps_pbh(simde__m512 a) {
  return map_lanes<simde__m256bh, uint16_t, float, 16>(a, to_bf16);
}

}  // namespace attnkit_avx512_emulation

#define _mm512_maskz_loadu_ps(k, p) attnkit_avx512_emulation::maskz_loadu_ps(k, p)
#define _mm512_mask_loadu_ps(src, k, p) attnkit_avx512_emulation::mask_loadu_ps(src, k, p)
#define _mm512_maskz_loadu_epi16(k, p) attnkit_avx512_emulation::maskz_loadu_epi16(k, p)
#define _mm256_maskz_loadu_epi16(k, p) attnkit_avx512_emulation::maskz_loadu_epi16_256(k, p)
#define _mm512_mask_storeu_ps(p, k, a) attnkit_avx512_emulation::mask_storeu_ps(p, k, a)
#define _mm512_cvtepu16_epi32(a) attnkit_avx512_emulation::cvtepu16_epi32(a)
#define _mm512_cvtne2ps_pbh(a, b) \
  attnkit_avx512_emulation::cvtne2ps_pbh<simde__m512bh, simde__m512, 16>(a, b)
#define _mm_cvtne2ps_pbh(a, b) \
  attnkit_avx512_emulation::cvtne2ps_pbh<simde__m128bh, simde__m128, 4>(a, b)
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4(a, b, imm8)
#define _mm_maskz_loadu_epi8(k, p) attnkit_avx512_emulation::maskz_loadu_epi8_128(k, p)
#define _mm256_maskz_loadu_epi8(k, p) attnkit_avx512_emulation::maskz_loadu_epi8_256(k, p)
#define _mm512_cvtepi8_epi32(a) attnkit_avx512_emulation::cvtepi8_epi32(a)
#define _mm512_cvtepi32_ps(a) attnkit_avx512_emulation::cvtepi32_ps(a)
#undef _mm512_madd_epi16  // SIMDe 0.7.4 defines it with the masked form's four arguments
#define _mm512_madd_epi16(a, b) attnkit_avx512_emulation::madd_epi16(a, b)
#define _mm512_cvtph_ps(a) attnkit_avx512_emulation::cvtph_ps(a)
#define _mm512_cvtps_epi32(a) attnkit_avx512_emulation::cvtps_epi32(a)
#define _mm512_cvtepi32_epi16(a) attnkit_avx512_emulation::cvtepi32_epi16(a)
#define _mm512_mask_storeu_epi32(p, k, a) attnkit_avx512_emulation::mask_storeu_epi32(p, k, a)
#define _mm512_cvtneps_pbh(a) attnkit_avx512_emulation::cvtneps_pbh(a)
#define _mm512_reduce_ps(a, imm8) attnkit_avx512_emulation::reduce_ps(a, imm8)
