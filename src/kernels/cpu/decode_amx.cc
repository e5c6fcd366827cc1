// AMX QK for decode tiles of 5-16 packed rows (decode_amx.h). Compiled for
// AMX and AVX512_BF16 with target attributes; the plan takes it only where
// amx_bf16_available() and the active SIMD target is kAvx512Bf16.
#include "kernels/cpu/decode_amx.h"

#include <cstring>

#include "kernels/amx.h"
#include "kernels/cpu/fp8_bf16.h"
#include "kernels/cpu/x86_intrinsics.h"

namespace attnkit::kernels::cpu {

#if defined(ATTNKIT_AMX_BUILD)

#if defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq," \
                          "avx512bf16,avx512vbmi,fma"))),                                  \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target( \
    "amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma")
#endif

namespace {

// Prefetches the `bytes` of the row at p.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Prefetches the lines of up to 64 rows a slice at a time (issue(k, of):
// slice k of `of`), so that their misses spread over the work that
// follows: a tile's 128 prefetches issued at once wait for line fill
// buffers and held up the products behind them (under perf, a third of
// amx_qk_i8's time sat on those prefetches).
struct SpreadPrefetch {
  const char* row[64];
  int64_t rows = 0, lines = 0;  // per row
  void issue(int64_t k, int64_t of) const {
    const int64_t total = rows * lines;
    for (int64_t i = total * k / of; i < total * (k + 1) / of; ++i)
      _mm_prefetch(row[i / lines] + 64 * (i % lines), _MM_HINT_T0);
  }
};

// The 16 bf16 values of h widened (exactly) to fp32.
inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x rounded to bf16 pairs: hi = bf16(x), lo = bf16(x - hi), for 32 values
// (a: the first 16, b: the next); hi + lo is x within 2^-17 of |x|.
inline void split_bf16(__m512 a, __m512 b, __m512i* hi, __m512i* lo) {
  *hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  const __m512 ra = _mm512_sub_ps(a, widen(_mm512_castsi512_si256(*hi)));
  const __m512 rb = _mm512_sub_ps(b, widen(_mm512_extracti64x4_epi64(*hi, 1)));
  *lo = (__m512i)_mm512_cvtne2ps_pbh(rb, ra);
}

// Lanes c0 .. min(head_dim, c0 + 32) - 1 of a 32-lane step.
inline __mmask32 step_mask(int64_t c0, int64_t head_dim) {
  const int64_t left = head_dim - c0;
  return left >= 32 ? ~__mmask32{0} : left <= 0 ? 0 : (__mmask32{1} << left) - 1;
}

// Lanes c0 .. min(head_dim, c0 + 64) - 1 of a 64-lane step.
inline __mmask64 step_mask64(int64_t c0, int64_t head_dim) {
  const int64_t left = head_dim - c0;
  return left >= 64 ? ~__mmask64{0} : left <= 0 ? 0 : (__mmask64{1} << left) - 1;
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

// By fp8_bf16.h's byte lookups, in order (kd may end in half a block of
// 64), with 0x7f / 0xff as +-480 (kFp8Bf16Bytes480).
void amx_keys_fp8(const uint8_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                  int64_t kd, int64_t prefetch) {
  const Fp8Bf16Tables t = fp8_bf16_tables(kFp8Bf16Bytes480);
  const __m512i order = _mm512_load_si512(kFp8Bf16Order.at);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = k + r * stride;
    if (prefetch != 0) prefetch_row(row + prefetch, head_dim);
    uint16_t* out = dst + r * kd;
    for (int64_t c = 0; c < kd; c += 64) {
      __m512i first, second;
      fp8_bf16_words_in_order(t, order, _mm512_maskz_loadu_epi8(step_mask64(c, head_dim), row + c),
                              &first, &second);
      _mm512_storeu_si512(out + c, first);
      if (c + 32 < kd) _mm512_storeu_si512(out + c + 32, second);
    }
  }
}

// tmm0-3: C, 16 keys x 16 rows fp32 (int32 for amx_qk_i8); tmm4: A, 16
// keys x 32 dims bf16 (64 int8); tmm5 (and tmm6 for amx_qk_i8): B, 16 dim
// pairs (quads) x 16 rows. amx_pv / amx_pv_i8 hold the weights in tmm4 (and
// tmm6) and the values in tmm5 (and tmm7). Every tile 16 rows of 64 bytes.
constexpr AmxTileConfig tile_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

void amx_pack_q(const float* const* rows, int64_t count, int64_t head_dim, float scale, uint16_t* q,
                uint16_t* q_lo, int64_t kd) {
  std::memset(q, 0, static_cast<size_t>(16 * kd) * sizeof(uint16_t));
  if (q_lo != nullptr) std::memset(q_lo, 0, static_cast<size_t>(16 * kd) * sizeof(uint16_t));
  uint32_t* pairs = reinterpret_cast<uint32_t*>(q);  // [kd / 2][16]
  uint32_t* pairs_lo = reinterpret_cast<uint32_t*>(q_lo);
  const __m512 k = _mm512_set1_ps(scale);
  alignas(64) uint32_t word[16], word_lo[16];
  for (int64_t m = 0; m < count; ++m)
    for (int64_t c = 0; c < head_dim; c += 32) {
      const __mmask32 valid = step_mask(c, head_dim);
      const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid & 0xffff, rows[m] + c), k);
      const __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid >> 16, rows[m] + c + 16), k);
      __m512i hi, lo;
      split_bf16(a, b, &hi, &lo);
      _mm512_store_si512(word, hi);
      _mm512_store_si512(word_lo, lo);
      for (int64_t j = 0; j < 16; ++j) pairs[(c / 2 + j) * 16 + m] = word[j];
      if (pairs_lo != nullptr)
        for (int64_t j = 0; j < 16; ++j) pairs_lo[(c / 2 + j) * 16 + m] = word_lo[j];
    }
}

void amx_split_q(const int16_t* q16, int64_t qt, int64_t head_dim, int8_t* hi, int8_t* lo,
                 int64_t kd) {
  // Element (m, c) of an int8 B operand: 4 consecutive dims of row m in
  // one 32-bit lane, [c / 4][m][c % 4].
  // q16 rows are zero past head_dim up to qt (a multiple of 32), so whole
  // steps of 32 dims are split; dims past that up to kd stay 0.
  std::memset(hi, 0, static_cast<size_t>(16 * kd));
  std::memset(lo, 0, static_cast<size_t>(16 * kd));
  const __m512i half = _mm512_set1_epi16(128);
  alignas(32) uint32_t h4[8], l4[8];
  for (int64_t m = 0; m < 16; ++m)
    for (int64_t c = 0; c < head_dim; c += 32) {
      const __m512i v = _mm512_loadu_si512(q16 + m * qt + c);
      const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(v, half), 8);  // floor
      const __m512i l = _mm512_sub_epi16(v, _mm512_slli_epi16(h, 8));     // in [-128, 127]
      _mm256_store_si256(reinterpret_cast<__m256i*>(h4), _mm512_cvtepi16_epi8(h));
      _mm256_store_si256(reinterpret_cast<__m256i*>(l4), _mm512_cvtepi16_epi8(l));
      for (int64_t j = 0; j < 8; ++j) {
        std::memcpy(hi + (c / 4 + j) * 64 + m * 4, &h4[j], 4);
        std::memcpy(lo + (c / 4 + j) * 64 + m * 4, &l4[j], 4);
      }
    }
}

void amx_keys_copy_i8(const int8_t* k, int64_t stride, int64_t n, int64_t head_dim, int8_t* dst,
                      int64_t kd, int64_t prefetch) {
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = k + r * stride;
    if (prefetch != 0) prefetch_row(row + prefetch, head_dim);
    for (int64_t c = 0; c < kd; c += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * kd + c),
                          _mm256_maskz_loadu_epi8(step_mask(c, head_dim), row + c));
  }
}

void amx_qk_i8(const int8_t* keys, int64_t nk, int64_t key_stride, int64_t kd, const int8_t* hi,
               const int8_t* lo, const float* qf, const float* kscale, float* s, int64_t s_stride,
               int32_t* c32, int64_t prefetch) {
  const int64_t blocks = (nk + 15) / 16, pairs = (blocks + 1) / 2;
  SpreadPrefetch fetch;
  if (prefetch != 0) {
    fetch.rows = nk;
    fetch.lines = (kd + 63) / 64;
    for (int64_t r = 0; r < nk; ++r)
      fetch.row[r] = reinterpret_cast<const char*>(keys) + r * key_stride + prefetch;
  }
  const int64_t slices = pairs * ((kd + 63) / 64);
  const __m512 q_factor = _mm512_loadu_ps(qf);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    // tmm0 / tmm1: hi sums of the pair's two key blocks, tmm2 / tmm3: lo.
    const int8_t* a = keys + pair * 32 * key_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < kd; c += 64) {
      _tile_loadd(5, hi + c * 16, 64);
      _tile_loadd(6, lo + c * 16, 64);
      _tile_loadd(4, a + c, key_stride);
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(2, 4, 6);
      _tile_loadd(4, a + 16 * key_stride + c, key_stride);
      _tile_dpbssd(1, 4, 5);
      _tile_dpbssd(3, 4, 6);
      fetch.issue(pair * ((kd + 63) / 64) + c / 64, slices);
    }
    _tile_stored(0, c32, 64);
    _tile_stored(1, c32 + 256, 64);
    _tile_stored(2, c32 + 512, 64);
    _tile_stored(3, c32 + 768, 64);
    for (int64_t x = 0; x < 32 && pair * 32 + x < nk; ++x) {
      const int64_t n = pair * 32 + x;
      const __m512 h = _mm512_cvtepi32_ps(_mm512_loadu_si512(c32 + x * 16));
      const __m512 l = _mm512_cvtepi32_ps(_mm512_loadu_si512(c32 + 512 + x * 16));
      const __m512 sum = _mm512_fmadd_ps(h, _mm512_set1_ps(256.0f), l);
      _mm512_storeu_ps(s + n * s_stride,
                       _mm512_mul_ps(sum, _mm512_mul_ps(q_factor, _mm512_set1_ps(kscale[n]))));
    }
  }
}

void amx_tiles_begin() {
  // A constant in memory: GCC 12 dropped the stores that filled a local
  // configuration before ldtilecfg read it, which then faulted.
  alignas(64) static constexpr AmxTileConfig kConfig = tile_config();
  _tile_loadconfig(&kConfig);
}

void amx_tiles_end() { _tile_release(); }

void amx_qk(const uint16_t* keys, int64_t nk, int64_t key_stride, int64_t kd, const uint16_t* q,
            const uint16_t* q_lo, const float* kscale, float* s, int64_t s_stride,
            int64_t prefetch) {
  const int64_t blocks = (nk + 15) / 16;
  SpreadPrefetch fetch;
  if (prefetch != 0) {
    fetch.rows = nk;
    fetch.lines = (kd * 2 + 63) / 64;
    for (int64_t r = 0; r < nk; ++r)
      fetch.row[r] = reinterpret_cast<const char*>(keys + r * key_stride + prefetch);
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t a_stride = key_stride * 2, c_stride = s_stride * 4, steps = kd / 32;
  for (int64_t c = 0; c < kd; c += 32) {
    _tile_loadd(5, q + c * 16, 64);
    if (q_lo != nullptr) {  // the queries' remainders too (exact keys)
      _tile_loadd(6, q_lo + c * 16, 64);
      _tile_loadd(4, keys + c, a_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(0, 4, 6);
      if (blocks > 1) {
        _tile_loadd(4, keys + 16 * key_stride + c, a_stride);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (blocks > 2) {
        _tile_loadd(4, keys + 32 * key_stride + c, a_stride);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(2, 4, 6);
      }
      if (blocks > 3) {
        _tile_loadd(4, keys + 48 * key_stride + c, a_stride);
        _tile_dpbf16ps(3, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      fetch.issue(c / 32, steps);
      continue;
    }
    _tile_loadd(4, keys + c, a_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (blocks > 1) {
      _tile_loadd(4, keys + 16 * key_stride + c, a_stride);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (blocks > 2) {
      _tile_loadd(4, keys + 32 * key_stride + c, a_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (blocks > 3) {
      _tile_loadd(4, keys + 48 * key_stride + c, a_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
    fetch.issue(c / 32, steps);
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

namespace {

// r[0..15] = the 16 x 16 block's columns: r[c][x] = in[x][c]. Unpacks
// interleave pairs of rows within 128-bit lanes, shuffles gather each
// lane's four columns of four rows, and two lane shuffles move lane L of
// four registers into one.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 i + e], lane L: rows 4 i .. 4 i + 3 at column 4 L + e.
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + e] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[8 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// 16 keys' weights from s (rows n0.. of the tile, zero from nk on), times
// their value scales, transposed: r[m][x] = weight of key n0 + x for row m.
inline void weights16(const float* s, int64_t n0, int64_t nk, int64_t s_stride, const float* vscale,
                      __m512* r) {
  for (int x = 0; x < 16; ++x) {
    const int64_t n = n0 + x;
    if (n >= nk) {
      r[x] = _mm512_setzero_ps();
      continue;
    }
    r[x] = _mm512_loadu_ps(s + n * s_stride);
    if (vscale != nullptr) r[x] = _mm512_mul_ps(r[x], _mm512_set1_ps(vscale[n]));
  }
  transpose16(r);
}

}  // namespace

namespace {

// The values of two keys (rows a and b; nullptr: none, zeros) at columns c
// .. c + 63 as AMX's pairs: out[2 x + r] = key r's value (a: 0) at column
// c + x, in four stores of 16 columns (those from dv_pad on skipped), zero
// past dv. bf16 values: loaded and interleaved word by word.
struct Bf16Values {
  __m512i first, second;
  Bf16Values() {
    alignas(64) static constexpr uint16_t kFirst[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    first = _mm512_load_si512(kFirst);
    second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  }
  void pairs64(const void* a, const void* b, int64_t c, int64_t dv, int64_t dv_pad,
               uint16_t* out) const {
    for (int64_t x = c; x < c + 64 && x < dv_pad; x += 32) {
      const __mmask32 m = step_mask(x, dv);
      const __m512i va = a != nullptr
                             ? _mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(a) + x)
                             : _mm512_setzero_si512();
      const __m512i vb = b != nullptr
                             ? _mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(b) + x)
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * x, _mm512_permutex2var_epi16(va, first, vb));
      if (x + 16 < dv_pad)
        _mm512_storeu_si512(out + 2 * x + 32, _mm512_permutex2var_epi16(va, second, vb));
    }
  }
};

// fp8 values: the two keys' codes interleaved byte by byte (vpermt2b)
// in the order that makes the decoder's in-lane unpacking (fp8_bf16_words)
// write the pairs in place: byte 16 L + j of a 32-column
// vector is key j % 2's code at column 4 L + j / 2 for j < 8 (the low
// unpack's words 8 L ..), 16 + 4 L + (j - 8) / 2 for j >= 8 (the high
// unpack's). About 9 instructions per 32 columns of two keys, where
// decoding each row then interleaving words took ~26.
struct PairOrder {
  uint8_t at[64];
};
constexpr PairOrder pair_order() {
  PairOrder o{};
  for (int q = 0; q < 64; ++q) {
    const int lane = q / 16, j = q % 16;
    const int column = j < 8 ? 4 * lane + j / 2 : 16 + 4 * lane + (j - 8) / 2;
    o.at[q] = static_cast<uint8_t>((j % 2) * 64 + column);  // vpermt2b: b's bytes from 64
  }
  return o;
}
alignas(64) constexpr PairOrder kPairOrder = pair_order();

struct Fp8Decoder {  // as amx_keys_fp8: 0x7f / 0xff as +-480
  Fp8Bf16Tables t = fp8_bf16_tables(kFp8Bf16Bytes480);
  void words(__m512i code, __m512i* first, __m512i* second) const {
    fp8_bf16_words(t, code, first, second);
  }
};
template <class Decoder>
struct CodeValues {
  Decoder d;
  __m512i order0, order1;  // columns c .. c + 31, c + 32 .. c + 63
  CodeValues() {
    order0 = _mm512_load_si512(kPairOrder.at);
    order1 = _mm512_add_epi8(order0, _mm512_set1_epi8(32));
  }
  void pairs64(const void* a, const void* b, int64_t c, int64_t dv, int64_t dv_pad,
               uint16_t* out) const {
    const __mmask64 m = step_mask64(c, dv);
    const __m512i ca = a != nullptr ? _mm512_maskz_loadu_epi8(m, static_cast<const uint8_t*>(a) + c)
                                    : _mm512_setzero_si512();
    const __m512i cb = b != nullptr ? _mm512_maskz_loadu_epi8(m, static_cast<const uint8_t*>(b) + c)
                                    : _mm512_setzero_si512();
    __m512i w0, w1;
    d.words(_mm512_permutex2var_epi8(ca, order0, cb), &w0, &w1);
    _mm512_storeu_si512(out + 2 * c, w0);
    if (c + 16 < dv_pad) _mm512_storeu_si512(out + 2 * c + 32, w1);
    if (c + 32 >= dv_pad) return;
    d.words(_mm512_permutex2var_epi8(ca, order1, cb), &w0, &w1);
    _mm512_storeu_si512(out + 2 * c + 64, w0);
    if (c + 48 < dv_pad) _mm512_storeu_si512(out + 2 * c + 96, w1);
  }
};

template <class Values>
void value_pairs(const void* const* rows, const int64_t* fetch, int64_t elem_bytes, int64_t nk,
                 int64_t dv, int64_t dv_pad, uint16_t* pairs) {
  // pairs[p][c][2] = (key 2 p, key 2 p + 1) at column c.
  const Values values;
  const int64_t steps = (nk + 31) / 32;
  for (int64_t n = 0; n < nk; ++n)
    if (fetch[n] != 0)
      prefetch_row(static_cast<const char*>(rows[n]) + fetch[n] * elem_bytes, dv * elem_bytes);
  for (int64_t p = 0; p < 16 * steps; ++p) {
    const void* a = 2 * p < nk ? rows[2 * p] : nullptr;
    const void* b = 2 * p + 1 < nk ? rows[2 * p + 1] : nullptr;
    for (int64_t c = 0; c < dv_pad; c += 64)
      values.pairs64(a, b, c, dv, dv_pad, pairs + p * 2 * dv_pad);
  }
}

// One step of amx_pv with split weights: C tiles 0 .. blocks - 1 += (tmm4
// + tmm6) times the values' B tiles at bt.
inline void pv_step_split(const uint16_t* bt, int64_t p_stride, int64_t blocks) {
  _tile_loadd(5, bt, p_stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(0, 6, 5);
  if (blocks > 1) {
    _tile_loadd(5, bt + 32, p_stride);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(1, 6, 5);
  }
  if (blocks > 2) {
    _tile_loadd(5, bt + 64, p_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(2, 6, 5);
  }
  if (blocks > 3) {
    _tile_loadd(5, bt + 96, p_stride);
    _tile_dpbf16ps(3, 4, 5);
    _tile_dpbf16ps(3, 6, 5);
  }
}

}  // namespace

void amx_value_pairs(const void* const* rows, const int64_t* fetch, int64_t nk, int64_t dv,
                     int64_t dv_pad, bool fp8, uint16_t* pairs) {
  if (fp8)
    value_pairs<CodeValues<Fp8Decoder>>(rows, fetch, 1, nk, dv, dv_pad, pairs);
  else
    value_pairs<Bf16Values>(rows, fetch, 2, nk, dv, dv_pad, pairs);
}

void amx_pv(const float* s, int64_t nk, int64_t s_stride, const float* vscale,
            const uint16_t* pairs, float* o, int64_t dv_pad, const float* alpha, uint16_t* w,
            bool split) {
  const int64_t steps = (nk + 31) / 32;
  const int64_t prow = 2 * dv_pad;
  // A: w[m][n], 64 keys a row, bf16 (split: their remainders from w + 1024).
  for (int64_t t = 0; t < steps; ++t) {
    __m512 first[16], second[16];
    weights16(s, 32 * t, nk, s_stride, vscale, first);
    weights16(s, 32 * t + 16, nk, s_stride, vscale, second);
    for (int m = 0; m < 16; ++m) {
      __m512i hi, lo;
      split_bf16(first[m], second[m], &hi, &lo);
      _mm512_storeu_si512(w + m * 64 + 32 * t, hi);
      if (split) _mm512_storeu_si512(w + 1024 + m * 64 + 32 * t, lo);
    }
  }
  // o *= alpha, rows whose alpha is not 1.
  for (int m = 0; m < 16; ++m) {
    if (alpha[m] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int64_t c = 0; c < dv_pad; c += 16)
      _mm512_storeu_ps(o + m * dv_pad + c, _mm512_mul_ps(_mm512_loadu_ps(o + m * dv_pad + c), a));
  }
  // C: o in blocks of 16 x 16, four at a time.
  const int64_t o_stride = dv_pad * 4, p_stride = prow * 2;
  for (int64_t c0 = 0; c0 < dv_pad; c0 += 64) {
    const int64_t blocks = dv_pad - c0 >= 64 ? 4 : (dv_pad - c0) / 16;
    float* oc = o + c0;
    _tile_loadd(0, oc, o_stride);
    if (blocks > 1) _tile_loadd(1, oc + 16, o_stride);
    if (blocks > 2) _tile_loadd(2, oc + 32, o_stride);
    if (blocks > 3) _tile_loadd(3, oc + 48, o_stride);
    for (int64_t t = 0; t < steps; ++t) {
      _tile_loadd(4, w + 32 * t, 128);
      const uint16_t* bt = pairs + 16 * t * prow + 2 * c0;
      if (split) {
        _tile_loadd(6, w + 1024 + 32 * t, 128);
        pv_step_split(bt, p_stride, blocks);
        continue;
      }
      _tile_loadd(5, bt, p_stride);
      _tile_dpbf16ps(0, 4, 5);
      if (blocks > 1) {
        _tile_loadd(5, bt + 32, p_stride);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (blocks > 2) {
        _tile_loadd(5, bt + 64, p_stride);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (blocks > 3) {
        _tile_loadd(5, bt + 96, p_stride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, oc, o_stride);
    if (blocks > 1) _tile_stored(1, oc + 16, o_stride);
    if (blocks > 2) _tile_stored(2, oc + 32, o_stride);
    if (blocks > 3) _tile_stored(3, oc + 48, o_stride);
  }
}

namespace {

// vpermb's order that turns four keys' 16 codes, one key per 128-bit lane,
// into AMX-INT8's B rows: byte 4 x + r = lane r's byte x.
struct QuadOrder {
  uint8_t at[64];
};
constexpr QuadOrder quad_order() {
  QuadOrder o{};
  for (int b = 0; b < 64; ++b) o.at[b] = static_cast<uint8_t>(16 * (b % 4) + b / 4);
  return o;
}
alignas(64) constexpr QuadOrder kQuadOrder = quad_order();

// 16 codes of row `row` (nullptr: none) from column c, zero from dv on.
inline __m128i codes16(const int8_t* row, int64_t c, int64_t dv) {
  if (row == nullptr || c >= dv) return _mm_setzero_si128();
  if (c + 16 <= dv) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
  return _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (dv - c)) - 1), row + c);
}

// Columns [c0, c0 + 32) of the quads (fewer at dv_pad's end; both
// blocks' 16 B rows), from the tile's rows r (nullptr past nk).
inline void quads32(const int8_t* const* r, int64_t c0, int64_t dv, int64_t dv_pad, __m512i order,
                    int8_t* quads) {
  for (int64_t c = c0; c < c0 + 32 && c < dv_pad; c += 16)
    for (int64_t p = 0; p < 16; ++p) {
      __m512i t = _mm512_castsi128_si512(codes16(r[4 * p], c, dv));
      t = _mm512_inserti32x4(t, codes16(r[4 * p + 1], c, dv), 1);
      t = _mm512_inserti32x4(t, codes16(r[4 * p + 2], c, dv), 2);
      t = _mm512_inserti32x4(t, codes16(r[4 * p + 3], c, dv), 3);
      _mm512_storeu_si512(quads + c * 64 + p * 64, _mm512_permutexvar_epi8(order, t));
    }
}

// The int32 sums of columns [c0, c0 + 32) into c: tmm0 / tmm1 the two
// blocks' hi sums (c, c + 256), tmm2 / tmm3 their lo sums (c + 512, c +
// 768). A: tmm4 (hi), tmm6 (lo).
inline void products32(const int8_t* quads, int64_t c0, bool two, int32_t* c) {
  _tile_zero(0);
  _tile_zero(2);
  _tile_loadd(5, quads + c0 * 64, 64);
  _tile_dpbssd(0, 4, 5);
  if (two) {
    _tile_zero(1);
    _tile_zero(3);
    _tile_loadd(7, quads + (c0 + 16) * 64, 64);
    _tile_dpbssd(1, 4, 7);
  }
  _tile_dpbssd(2, 6, 5);
  if (two) _tile_dpbssd(3, 6, 7);
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 512, 64);
  if (!two) return;
  _tile_stored(1, c + 256, 64);
  _tile_stored(3, c + 768, 64);
}

// o = alpha o + factor (256 hi + lo) over the columns products32 summed.
inline void accumulate32(const int32_t* c, int64_t c0, bool two, float* o, int64_t dv_pad,
                         const float* alpha, const float* factor) {
  for (int m = 0; m < 16; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]), f = _mm512_set1_ps(factor[m]);
    for (int b = 0; b < (two ? 2 : 1); ++b) {
      const __m512i sum =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c + b * 256 + m * 16), 8),
                           _mm512_loadu_si512(c + 512 + b * 256 + m * 16));
      float* row = o + m * dv_pad + c0 + 16 * b;
      _mm512_storeu_ps(
          row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, _mm512_mul_ps(_mm512_loadu_ps(row), a)));
    }
  }
}

// The weights as two int8 A operands (w: hi, w + 1024: lo), and each row's
// factor.
inline void weights_i8(const float* s, int64_t nk, int64_t s_stride, const float* vscale, int8_t* w,
                       float* factor) {
  // Each row's largest weight (all weights are >= 0) and the inverse of
  // its step.
  __m512 mx = _mm512_setzero_ps();
  for (int64_t n = 0; n < nk; ++n)
    mx = _mm512_max_ps(mx,
                       _mm512_mul_ps(_mm512_loadu_ps(s + n * s_stride), _mm512_set1_ps(vscale[n])));
  const __mmask16 some = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_maskz_div_ps(some, _mm512_set1_ps(float(kAmxQ16Max)), mx));
  _mm512_storeu_ps(factor, _mm512_mul_ps(mx, _mm512_set1_ps(1.0f / float(kAmxQ16Max))));
  const __m512i half = _mm512_set1_epi32(128);
  for (int64_t n0 = 0; n0 < 64; n0 += 16) {
    __m512 r[16];
    weights16(s, n0, nk, s_stride, vscale, r);
    for (int m = 0; m < 16; ++m) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(r[m], _mm512_set1_ps(inv[m])));
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, half), 8);  // floor((q + 128) / 256)
      const __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));     // in [-128, 127]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + m * 64 + n0), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(w + 1024 + m * 64 + n0), _mm512_cvtepi32_epi8(l));
    }
  }
}

}  // namespace

void amx_pv_i8(const void* const* rows, const int64_t* fetch, int64_t nk, int64_t dv,
               int64_t dv_pad, const float* s, int64_t s_stride, const float* vscale, float* o,
               const float* alpha, int8_t* quads, int8_t* w, int32_t* c32) {
  const int8_t* r[64];
  SpreadPrefetch ahead;
  ahead.lines = (dv + 63) / 64;
  for (int64_t n = 0; n < 64; ++n) {
    r[n] = n < nk ? static_cast<const int8_t*>(rows[n]) : nullptr;
    if (n < nk && fetch[n] != 0)
      ahead.row[ahead.rows++] = reinterpret_cast<const char*>(r[n]) + fetch[n];
  }
  const __m512i order = _mm512_load_si512(kQuadOrder.at);
  alignas(64) float factor[16];
  // A pipeline over 32 columns at a time, so that no tile load reads what
  // the vector unit stored just before (a tile load waits for those
  // stores to commit) and no vector load what a tile store just wrote:
  // the quads of step j + 2 are laid out while step j's products run,
  // and step j - 1's sums are applied after them.
  const int64_t steps = (dv_pad + 31) / 32;
  quads32(r, 0, dv, dv_pad, order, quads);
  ahead.issue(0, steps + 2);
  weights_i8(s, nk, s_stride, vscale, w, factor);
  ahead.issue(1, steps + 2);
  if (steps > 1) quads32(r, 32, dv, dv_pad, order, quads);
  _tile_loadd(4, w, 64);
  _tile_loadd(6, w + 1024, 64);
  for (int64_t j = 0; j < steps; ++j) {
    products32(quads, 32 * j, 32 * j + 16 < dv_pad, c32 + (j % 2) * 1024);
    ahead.issue(j + 2, steps + 2);
    if (j + 2 < steps) quads32(r, 32 * (j + 2), dv, dv_pad, order, quads);
    if (j > 0)
      accumulate32(c32 + ((j - 1) % 2) * 1024, 32 * (j - 1), 32 * (j - 1) + 16 < dv_pad, o, dv_pad,
                   alpha, factor);
  }
  accumulate32(c32 + ((steps - 1) % 2) * 1024, 32 * (steps - 1), 32 * (steps - 1) + 16 < dv_pad, o,
               dv_pad, alpha, factor);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build: never called (amx_bf16_available() is false)

void amx_keys_bf16(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) {}
void amx_keys_fp8(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) {}
void amx_qk(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
            const float*, float*, int64_t, int64_t) {}
void amx_value_pairs(const void* const*, const int64_t*, int64_t, int64_t, int64_t, bool,
                     uint16_t*) {}
void amx_pv(const float*, int64_t, int64_t, const float*, const uint16_t*, float*, int64_t,
            const float*, uint16_t*, bool) {}
void amx_pack_q(const float* const*, int64_t, int64_t, float, uint16_t*, uint16_t*, int64_t) {}
void amx_split_q(const int16_t*, int64_t, int64_t, int8_t*, int8_t*, int64_t) {}
void amx_keys_copy_i8(const int8_t*, int64_t, int64_t, int64_t, int8_t*, int64_t, int64_t) {}
void amx_qk_i8(const int8_t*, int64_t, int64_t, int64_t, const int8_t*, const int8_t*, const float*,
               const float*, float*, int64_t, int32_t*, int64_t) {}
void amx_pv_i8(const void* const*, const int64_t*, int64_t, int64_t, int64_t, const float*, int64_t,
               const float*, float*, const float*, int8_t*, int8_t*, int32_t*) {}
void amx_tiles_begin() {}
void amx_tiles_end() {}

#endif

}  // namespace attnkit::kernels::cpu
