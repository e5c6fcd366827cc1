// AMX form of the lightning indexer's scores (kernels/indexer_amx.h).
//
// Tiles: tmm0-3 accumulate C [16 keys][16 heads] fp32 for four blocks of
// 16 heads, tmm4 holds A = 16 key rows x 32 features (bf16, row-major as
// the keys lie), tmm5 one B tile of the query (32 features x 16 heads in
// pairs). A key tile of 16 rows meets 64 heads in 4 steps of 32 features:
// 4 A loads, 16 B loads (the query, L1-resident) and 16 tdpbf16ps, each of
// 16 x 16 x 32 multiply-adds.
#include "kernels/indexer_amx.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/amx.h"

#if defined(ATTNKIT_AMX_BUILD)
#define ATTNKIT_INDEXER_AMX 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's own AVX-512 headers trip -W(maybe-)uninitialized (GCC bug
// 105593: the `__m512 __Y = __Y;` idiom behind _mm512_undefined_ps).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#endif

namespace attnkit::kernels {

#if defined(ATTNKIT_INDEXER_AMX)

bool indexer_amx_available() { return amx_bf16_available(); }

#if defined(__clang__)
#pragma clang attribute push(                                                            \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,fma"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,fma")
#endif

namespace {

// C (tmm0 .. tmm0 + blocks - 1) = the 16 keys at `keys` times `blocks` head
// blocks of q from head block j0, stored to s [16][ss] at column 16 j0.
template <int kBlocks>
void key_tile(const uint16_t* keys, const uint16_t* q, int64_t j0, float* s, int64_t ss) {
  if constexpr (kBlocks > 0) _tile_zero(0);
  if constexpr (kBlocks > 1) _tile_zero(1);
  if constexpr (kBlocks > 2) _tile_zero(2);
  if constexpr (kBlocks > 3) _tile_zero(3);
  constexpr int64_t kRowBytes = kAmxIndexerDim * 2, kPairRowBytes = 64;
  for (int64_t t = 0; t < 4; ++t) {
    _tile_loadd(4, keys + t * 32, kRowBytes);
    const uint16_t* b = q + ((j0 * 4 + t) * 16) * 32;
    constexpr int64_t kBlock = 4 * 16 * 32;  // one head block's B tiles
    if constexpr (kBlocks > 0) {
      _tile_loadd(5, b, kPairRowBytes);
      _tile_dpbf16ps(0, 4, 5);
    }
    if constexpr (kBlocks > 1) {
      _tile_loadd(5, b + kBlock, kPairRowBytes);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (kBlocks > 2) {
      _tile_loadd(5, b + 2 * kBlock, kPairRowBytes);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (kBlocks > 3) {
      _tile_loadd(5, b + 3 * kBlock, kPairRowBytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  const int64_t stride = ss * static_cast<int64_t>(sizeof(float));
  if constexpr (kBlocks > 0) _tile_stored(0, s + 16 * j0, stride);
  if constexpr (kBlocks > 1) _tile_stored(1, s + 16 * (j0 + 1), stride);
  if constexpr (kBlocks > 2) _tile_stored(2, s + 16 * (j0 + 2), stride);
  if constexpr (kBlocks > 3) _tile_stored(3, s + 16 * (j0 + 3), stride);
}

// keys [round_up(count, 16)][128] = the values of `count` rows of 128 E4M3
// codes (row_stride apart) as bf16, rows past count 0; returns bit r set
// for each row r that holds a NaN code (0x7f, 0xff). Exact, subnormals
// included: a code's magnitude bits m = e << 3 | f with e > 0 move into
// bf16's fields as (m << 4) + (120 << 7) (the exponent bias 7 becomes
// 127); e = 0 is f * 2^-9, from a table of eight.
uint64_t decode_keys(const uint8_t* codes, int64_t row_stride, int64_t count, uint16_t* keys) {
  alignas(64) static constexpr uint16_t kSubnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                                          0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i table = _mm512_load_si512(kSubnormal);
  const __m512i low7 = _mm512_set1_epi16(0x7f), sign = _mm512_set1_epi16(0x80);
  const __m512i bias = _mm512_set1_epi16(0x3C00), eight = _mm512_set1_epi16(8);
  uint64_t nan_rows = 0;
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row = codes + r * row_stride;
    // The same row of the next tile of 64 keys (what the caller scores
    // next; a hint, harmless past the end): a decode step reads every key
    // from memory once, so the next lines are in flight while this tile
    // is multiplied.
    _mm_prefetch(reinterpret_cast<const char*>(row + 64 * row_stride), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + 64 * row_stride + 64), _MM_HINT_T0);
    __mmask32 nan = 0;
    for (int64_t c = 0; c < kAmxIndexerDim; c += 32) {
      const __m512i code =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
      const __m512i mag = _mm512_and_si512(code, low7);
      const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
      const __m512i small = _mm512_permutexvar_epi16(mag, table);  // low 5 bits index
      __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, eight), normal, small);
      v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(code, sign), 8));
      nan |= _mm512_cmpeq_epi16_mask(mag, low7);
      _mm512_storeu_si512(keys + r * kAmxIndexerDim + c, v);
    }
    if (nan != 0) nan_rows |= uint64_t{1} << r;
  }
  const int64_t padded = (count + 15) / 16 * 16;
  std::memset(keys + count * kAmxIndexerDim, 0,
              static_cast<size_t>((padded - count) * kAmxIndexerDim) * sizeof(uint16_t));
  return nan_rows;
}

}  // namespace

void indexer_amx_scores(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                        int64_t heads, const float* w, const float* ks, int64_t ks_stride,
                        uint16_t* keys, float* s, float* score) {
  const uint64_t nan_rows = decode_keys(codes, code_stride, count, keys);
  AmxTileConfig cfg;
  for (int r = 0; r < 6; ++r) {
    cfg.rows[r] = 16;
    cfg.colsb[r] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t blocks = (heads + 15) / 16, ss = blocks * 16;
  for (int64_t n0 = 0; n0 < count; n0 += 16) {
    const uint16_t* k = keys + n0 * kAmxIndexerDim;
    float* st = s + n0 * ss;
    for (int64_t j0 = 0; j0 < blocks; j0 += 4) {
      switch (blocks - j0) {
        case 1:
          key_tile<1>(k, q, j0, st, ss);
          break;
        case 2:
          key_tile<2>(k, q, j0, st, ss);
          break;
        case 3:
          key_tile<3>(k, q, j0, st, ss);
          break;
        default:
          key_tile<4>(k, q, j0, st, ss);
          break;
      }
    }
  }
  _tile_release();
  // score = ks * sum_h w_h ReLU(dot_h); max(0, x) keeps a NaN x (vmaxps
  // returns its second operand when either is NaN), so NaN reaches -inf,
  // as does a key with a NaN code (its bf16 pattern above is 480).
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t n = 0; n < count; ++n) {
    __m512 acc = zero;
    for (int64_t j = 0; j < blocks; ++j)
      acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(s + n * ss + 16 * j)),
                            _mm512_loadu_ps(w + 16 * j), acc);
    const float total = _mm512_reduce_add_ps(acc) * ks[n * ks_stride];
    score[n] = std::isnan(total) || ((nan_rows >> n) & 1u) != 0
                   ? -std::numeric_limits<float>::infinity()
                   : total;
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build

bool indexer_amx_available() { return false; }

void indexer_amx_scores(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                        const float*, int64_t, uint16_t*, float*, float*) {}

#endif

}  // namespace attnkit::kernels
