// AMX form of the lightning indexer's scores (kernels/indexer_amx.h).
//
// Tiles: tmm0-3 accumulate C [16 keys][16 heads] fp32 for four blocks of
// 16 heads, tmm4 holds A = 16 key rows x 32 features (bf16, row-major as
// the keys lie, features in kernels/cpu/fp8_bf16.h's order), tmm5 one B
// tile of the query (32 features x 16 heads in pairs, the same order). A
// group of 16 keys meets 64 heads in 4 steps of 32 features: 4 A loads, 16
// B loads (the query, L1-resident) and 16 tdpbf16ps, each of 16 x 16 x 32
// multiply-adds.
#include "kernels/indexer_amx.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/amx.h"

#if defined(ATTNKIT_AMX_BUILD)
#define ATTNKIT_INDEXER_AMX 1
#include <cpuid.h>

#include "kernels/cpu/fp8_bf16.h"
#include "kernels/cpu/x86_intrinsics.h"
#endif

namespace attnkit::kernels {

#if defined(ATTNKIT_INDEXER_AMX)

namespace {

// The keys' decoding (kernels/cpu/fp8_bf16.h) looks bytes up with
// AVX512-VBMI's vpermi2b, which the CPUs with AMX have; checked all the same.
bool has_avx512_vbmi() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && ((c >> 1) & 1u) != 0;
}

}  // namespace

bool indexer_amx_available() {
  static const bool vbmi = has_avx512_vbmi();
  return vbmi && amx_bf16_available();
}

#if defined(__clang__)
#pragma clang attribute push(                                                            \
    __attribute__((                                                                      \
        target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma")
#endif

namespace {

// C (tmm0 .. tmm0 + blocks - 1) = the 16 keys at `keys` times `blocks` head
// blocks of q from head block j0, stored to s [16][ss] at column 16 j0;
// between(t) runs after step t's products are issued (see
// indexer_amx_scores).
template <int kBlocks, class Between>
void key_tile(const uint16_t* keys, const uint16_t* q, int64_t j0, float* s, int64_t ss,
              const Between& between) {
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
    between(t);
  }
  const int64_t stride = ss * static_cast<int64_t>(sizeof(float));
  if constexpr (kBlocks > 0) _tile_stored(0, s + 16 * j0, stride);
  if constexpr (kBlocks > 1) _tile_stored(1, s + 16 * (j0 + 1), stride);
  if constexpr (kBlocks > 2) _tile_stored(2, s + 16 * (j0 + 2), stride);
  if constexpr (kBlocks > 3) _tile_stored(3, s + 16 * (j0 + 3), stride);
}

constexpr int64_t kGroup = 16;  // keys per A tile

// Rows r0 + r, r in [r_begin, r_end), of keys [16][128] = the codes of
// those rows (row_stride apart) as bf16 in fp8_bf16_feature's order, rows
// at or past count 0.
void decode_rows(const cpu::Fp8Bf16Tables& t, const uint8_t* codes, int64_t row_stride, int64_t r0,
                 int64_t r_begin, int64_t r_end, int64_t count, uint16_t* keys) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    uint16_t* out = keys + r * kAmxIndexerDim;
    if (r0 + r >= count) {
      std::memset(out, 0, kAmxIndexerDim * sizeof(uint16_t));
      continue;
    }
    const uint8_t* row = codes + (r0 + r) * row_stride;
    // The same row four groups on: the codes are read from memory once, so
    // their lines are in flight well before they are needed. A hint,
    // harmless past the end.
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * kGroup * row_stride), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * kGroup * row_stride + 64), _MM_HINT_T0);
    cpu::fp8_bf16_decode64(t, row, out);
    cpu::fp8_bf16_decode64(t, row + 64, out + 64);
  }
}

// The reduction of 16 keys' head scores s [16][ss] to score[n] = ks[n *
// ks_stride] * sum_h w_h ReLU(s[n][h]), NaN -> -inf, in two parts so that
// it can run between the products: reduce_quad(i) for keys 4i .. 4i + 3,
// then reduce_finish. Each key's 16-lane partial sums are reduced across
// lanes for all 16 keys at once (a transpose by unpack and shuffle, 15
// adds), not one key at a time. kBlocks > 0: blocks is kBlocks (64 heads:
// 4), so the loops unroll.
//
// Per 128-bit lane, the lane's sums of keys 4i .. 4i + 3 (via pairs: per
// lane, [a0+a2, b0+b2, a1+a3, b1+b3]).
template <int kBlocks>
__m512 reduce_quad(const float* s, int64_t ss, int64_t any_blocks, const float* w, int64_t i) {
  const int64_t blocks = kBlocks > 0 ? kBlocks : any_blocks;
  const __m512 zero = _mm512_setzero_ps();
  // sum_j w_j max(0, row_j) in 16 lanes. max(0, x) keeps a NaN x (vmaxps
  // returns its second operand when either is NaN), so a NaN head score
  // reaches the total.
  const auto lanes = [&](const float* row) {
    __m512 acc = _mm512_mul_ps(_mm512_max_ps(zero, _mm512_loadu_ps(row)), _mm512_loadu_ps(w));
    for (int64_t j = 1; j < blocks; ++j)
      acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(row + 16 * j)),
                            _mm512_loadu_ps(w + 16 * j), acc);
    return acc;
  };
  const float* r = s + 4 * i * ss;
  const __m512 v0 = lanes(r), v1 = lanes(r + ss), v2 = lanes(r + 2 * ss), v3 = lanes(r + 3 * ss);
  const __m512 p0 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 p1 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  return _mm512_add_ps(_mm512_shuffle_ps(p0, p1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// score[n], n < count (<= 16), from the four quads; the lanes of the keys
// whose scale is not finite and > 0 or-ed into *bad.
void reduce_finish(const __m512* q, const float* ks, int64_t ks_stride, int64_t count, float* score,
                   __mmask16* bad) {
  // Lanes: add lane pairs, twice; lane i of the result holds keys 4i .. 4i + 3.
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
  __m512 scale;
  if (ks_stride == 1) {
    scale = _mm512_maskz_loadu_ps(live, ks);
  } else {
    alignas(64) float g[kGroup] = {};
    for (int64_t n = 0; n < count; ++n) g[n] = ks[n * ks_stride];
    scale = _mm512_load_ps(g);
  }
  // Finite and > 0: bits - 1 < 0x7f7fffff as unsigned (0 and -0 wrap or
  // land above it, as do negatives, infinities and NaNs).
  *bad |= _mm512_mask_cmpge_epu32_mask(
      live, _mm512_sub_epi32(_mm512_castps_si512(scale), _mm512_set1_epi32(1)),
      _mm512_set1_epi32(0x7f7fffff));
  const __m512 total = _mm512_mul_ps(sum, scale);
  const __mmask16 nan = _mm512_cmp_ps_mask(total, total, _CMP_UNORD_Q);
  _mm512_mask_storeu_ps(
      score, live,
      _mm512_mask_blend_ps(nan, total, _mm512_set1_ps(-std::numeric_limits<float>::infinity())));
}

// C = the 16 keys at `keys` times every head block, stored to s [16][ss];
// between(t) after step t of the first four head blocks.
template <class Between>
void multiply_group(const uint16_t* keys, const uint16_t* q, int64_t blocks, float* s, int64_t ss,
                    const Between& between) {
  const auto none = [](int64_t) {};
  for (int64_t j0 = 0; j0 < blocks; j0 += 4) {
    const bool first = j0 == 0;
    switch (blocks - j0) {
      case 1:
        first ? key_tile<1>(keys, q, j0, s, ss, between) : key_tile<1>(keys, q, j0, s, ss, none);
        break;
      case 2:
        first ? key_tile<2>(keys, q, j0, s, ss, between) : key_tile<2>(keys, q, j0, s, ss, none);
        break;
      case 3:
        first ? key_tile<3>(keys, q, j0, s, ss, between) : key_tile<3>(keys, q, j0, s, ss, none);
        break;
      default:
        first ? key_tile<4>(keys, q, j0, s, ss, between) : key_tile<4>(keys, q, j0, s, ss, none);
        break;
    }
  }
}

// By groups of 16 keys: the tile unit multiplies group g while the vector
// units, after each of g's four steps of products, decode four rows of
// group g + 1 and reduce four keys of group g - 1 (decoded keys and head
// scores each in two scratch slots). The work is spread between the
// products because of the decoding's stores, which in one batch behind
// the products did not overlap them: in a loop test here, 16 products
// took 100 ns a group, 137 ns with 64 stores after them, 105 ns with the
// stores in four batches between them, while arithmetic overlapped them
// freely. (A store leaves the store buffer only after it retires, so
// behind every tdpbf16ps issued before it: 64 of them fill the buffer.)
template <int kBlocks>
bool scores_by_groups(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                      int64_t blocks, const float* w, const float* ks, int64_t ks_stride,
                      uint16_t* keys, float* s, float* score) {
  const cpu::Fp8Bf16Tables tables = cpu::fp8_bf16_tables();
  const int64_t ss = blocks * 16, groups = (count + kGroup - 1) / kGroup;
  const auto key_slot = [&](int64_t g) { return keys + (g % 2) * kGroup * kAmxIndexerDim; };
  const auto score_slot = [&](int64_t g) { return s + (g % 2) * kGroup * ss; };
  __mmask16 bad = 0;
  const auto finish = [&](int64_t g, const __m512* quads) {
    reduce_finish(quads, ks + g * kGroup * ks_stride, ks_stride,
                  std::min(kGroup, count - g * kGroup), score + g * kGroup, &bad);
  };
  __m512 quads[4];
  decode_rows(tables, codes, code_stride, 0, 0, kGroup, count, key_slot(0));
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* next = key_slot(g + 1);
    const float* prev = score_slot(g + 1);  // group g - 1's
    const int64_t r0 = (g + 1) * kGroup;
    const auto between = [&](int64_t t) {
      if (r0 < count) decode_rows(tables, codes, code_stride, r0, 4 * t, 4 * t + 4, count, next);
      if (g > 0) quads[t] = reduce_quad<kBlocks>(prev, ss, blocks, w, t);
    };
    multiply_group(key_slot(g), q, blocks, score_slot(g), ss, between);
    if (g > 0) finish(g - 1, quads);
  }
  _tile_release();
  for (int64_t t = 0; t < 4; ++t)
    quads[t] = reduce_quad<kBlocks>(score_slot(groups - 1), ss, blocks, w, t);
  finish(groups - 1, quads);
  return bad == 0;
}

}  // namespace

bool indexer_amx_scores(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                        int64_t heads, const float* w, const float* ks, int64_t ks_stride,
                        uint16_t* keys, float* s, float* score) {
  if (count <= 0) return true;
  // A constant, initialised once: GCC 12 has dropped the stores that fill a
  // stack-local configuration before ldtilecfg (kernels/cpu/decode_amx.cc).
  static const AmxTileConfig cfg = [] {
    AmxTileConfig c;
    for (int r = 0; r < 6; ++r) {
      c.rows[r] = 16;
      c.colsb[r] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
  const int64_t blocks = (heads + 15) / 16;
  return (blocks == 4 ? scores_by_groups<4> : scores_by_groups<0>)(codes, code_stride, count, q,
                                                                   blocks, w, ks, ks_stride, keys,
                                                                   s, score);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build

bool indexer_amx_available() { return false; }

bool indexer_amx_scores(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                        const float*, int64_t, uint16_t*, float*, float*) {
  return true;
}

#endif

}  // namespace attnkit::kernels
