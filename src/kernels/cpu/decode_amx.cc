// AMX QK for decode tiles of 5-16 packed rows (decode_amx.h). Compiled for
// AMX and AVX512_BF16 with target attributes; the plan takes it only where
// amx_bf16_available() and the active SIMD target is kAvx512Bf16.
#include "kernels/cpu/decode_amx.h"

#include "kernels/amx.h"

#if defined(ATTNKIT_AMX_BUILD)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's own AVX-512 headers trip -W(maybe-)uninitialized (GCC bug
// 105593: the `__m512 __Y = __Y;` idiom behind _mm512_undefined_ps).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

namespace attnkit::kernels::cpu {

#if defined(ATTNKIT_AMX_BUILD)

#if defined(__clang__)
#pragma clang attribute push(                                                     \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq," \
                          "avx512bf16,fma"))),                                    \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#endif

namespace {

// Prefetches the `bytes` of the row at p.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Lanes c0 .. min(head_dim, c0 + 32) - 1 of a 32-lane step.
inline __mmask32 step_mask(int64_t c0, int64_t head_dim) {
  const int64_t left = head_dim - c0;
  return left >= 32 ? ~__mmask32{0} : left <= 0 ? 0 : (__mmask32{1} << left) - 1;
}

}  // namespace

void amx_keys_bf16(const uint16_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                   int64_t kd, int64_t prefetch) {
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* row = k + r * stride;
    if (prefetch != 0) prefetch_row(row + prefetch, head_dim * 2);
    for (int64_t c = 0; c < kd; c += 32)
      _mm512_storeu_si512(dst + r * kd + c,
                          _mm512_maskz_loadu_epi16(step_mask(c, head_dim), row + c));
  }
}

void amx_keys_i8(const int8_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                 int64_t kd, int64_t prefetch) {
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = k + r * stride;
    if (prefetch != 0) prefetch_row(row + prefetch, head_dim);
    for (int64_t c = 0; c < kd; c += 32) {
      // |code| <= 128: exact in fp32 and in bf16.
      const __m256i codes = _mm256_maskz_loadu_epi8(step_mask(c, head_dim), row + c);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
      _mm512_storeu_si512(dst + r * kd + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// A code's magnitude bits m = e << 3 | f with e > 0 move into bf16's fields
// as (m << 4) + (120 << 7) (E4M3's exponent bias 7 becomes 127); e = 0 is f *
// 2^-9, from a table of eight (bf16 normals: 2^-9 is far above bf16's
// smallest normal).
void amx_keys_fp8(const uint8_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                  int64_t kd, int64_t prefetch) {
  alignas(64) static constexpr uint16_t kSubnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                                          0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i table = _mm512_load_si512(kSubnormal);
  const __m512i low7 = _mm512_set1_epi16(0x7f), sign = _mm512_set1_epi16(0x80);
  const __m512i bias = _mm512_set1_epi16(0x3C00), eight = _mm512_set1_epi16(8);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = k + r * stride;
    if (prefetch != 0) prefetch_row(row + prefetch, head_dim);
    for (int64_t c = 0; c < kd; c += 32) {
      const __m512i code =
          _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(step_mask(c, head_dim), row + c));
      const __m512i mag = _mm512_and_si512(code, low7);
      const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
      const __m512i small = _mm512_permutexvar_epi16(mag, table);  // low 5 bits index
      __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, eight), normal, small);
      v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(code, sign), 8));
      _mm512_storeu_si512(dst + r * kd + c, v);
    }
  }
}

// tmm0-3: C, 16 keys x 16 rows fp32; tmm4: A, 16 keys x 32 dims bf16;
// tmm5: B, 16 dim pairs x 16 rows x 2. Every tile 16 rows of 64 bytes.
constexpr AmxTileConfig tile_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

void amx_tiles_begin() {
  // A constant in memory: GCC 12 dropped the stores that filled a local
  // configuration before ldtilecfg read it, which then faulted.
  alignas(64) static constexpr AmxTileConfig kConfig = tile_config();
  _tile_loadconfig(&kConfig);
}

void amx_tiles_end() { _tile_release(); }

void amx_qk(uint16_t* keys, int64_t nk, int64_t kd, const uint16_t* q, const float* kscale,
            float* s, int64_t s_stride) {
  const int64_t blocks = (nk + 15) / 16;
  for (int64_t r = nk; r < blocks * 16; ++r)
    for (int64_t c = 0; c < kd; c += 32)
      _mm512_storeu_si512(keys + r * kd + c, _mm512_setzero_si512());
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = kd * 2, c_stride = s_stride * 4;
  for (int64_t c = 0; c < kd; c += 32) {
    _tile_loadd(5, q + c * 16, 64);
    _tile_loadd(4, keys + c, a_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (blocks > 1) {
      _tile_loadd(4, keys + 16 * kd + c, a_stride);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (blocks > 2) {
      _tile_loadd(4, keys + 32 * kd + c, a_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (blocks > 3) {
      _tile_loadd(4, keys + 48 * kd + c, a_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, s, c_stride);
  if (blocks > 1) _tile_stored(1, s + 16 * s_stride, c_stride);
  if (blocks > 2) _tile_stored(2, s + 32 * s_stride, c_stride);
  if (blocks > 3) _tile_stored(3, s + 48 * s_stride, c_stride);
  if (kscale == nullptr) return;
  for (int64_t n = 0; n < nk; ++n)
    _mm512_storeu_ps(s + n * s_stride,
                     _mm512_mul_ps(_mm512_loadu_ps(s + n * s_stride), _mm512_set1_ps(kscale[n])));
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build: never called (amx_bf16_available() is false)

void amx_keys_bf16(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) {}
void amx_keys_i8(const int8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) {}
void amx_keys_fp8(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) {}
void amx_qk(uint16_t*, int64_t, int64_t, const uint16_t*, const float*, float*, int64_t) {}
void amx_tiles_begin() {}
void amx_tiles_end() {}

#endif

}  // namespace attnkit::kernels::cpu
