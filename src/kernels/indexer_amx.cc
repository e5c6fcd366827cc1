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
#include "kernels/topk_order.h"
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
// between(u), u = 0 .. 15, runs right after product u of the 16 that four
// head blocks take (with fewer blocks, a step's four units follow its
// products; see scores_by_groups for why one unit a product).
template <int kBlocks, class Between>
[[gnu::always_inline]] inline void key_tile(const uint16_t* keys, const uint16_t* q, int64_t j0,
                                            float* s, int64_t ss, const Between& between) {
  if constexpr (kBlocks > 0) _tile_zero(0);
  if constexpr (kBlocks > 1) _tile_zero(1);
  if constexpr (kBlocks > 2) _tile_zero(2);
  if constexpr (kBlocks > 3) _tile_zero(3);
  constexpr int64_t kRowBytes = kAmxIndexerDim * 2, kPairRowBytes = 64;
  // The units of step t that follow its product j.
  const auto after = [&](int64_t t, int64_t j) {
    for (int64_t u = t * 4 + j * 4 / kBlocks; u < t * 4 + (j + 1) * 4 / kBlocks; ++u) between(u);
  };
  for (int64_t t = 0; t < 4; ++t) {
    _tile_loadd(4, keys + t * 32, kRowBytes);
    const uint16_t* b = q + ((j0 * 4 + t) * 16) * 32;
    constexpr int64_t kBlock = 4 * 16 * 32;  // one head block's B tiles
    if constexpr (kBlocks > 0) {
      _tile_loadd(5, b, kPairRowBytes);
      _tile_dpbf16ps(0, 4, 5);
      after(t, 0);
    }
    if constexpr (kBlocks > 1) {
      _tile_loadd(5, b + kBlock, kPairRowBytes);
      _tile_dpbf16ps(1, 4, 5);
      after(t, 1);
    }
    if constexpr (kBlocks > 2) {
      _tile_loadd(5, b + 2 * kBlock, kPairRowBytes);
      _tile_dpbf16ps(2, 4, 5);
      after(t, 2);
    }
    if constexpr (kBlocks > 3) {
      _tile_loadd(5, b + 3 * kBlock, kPairRowBytes);
      _tile_dpbf16ps(3, 4, 5);
      after(t, 3);
    }
  }
  const int64_t stride = ss * static_cast<int64_t>(sizeof(float));
  if constexpr (kBlocks > 0) _tile_stored(0, s + 16 * j0, stride);
  if constexpr (kBlocks > 1) _tile_stored(1, s + 16 * (j0 + 1), stride);
  if constexpr (kBlocks > 2) _tile_stored(2, s + 16 * (j0 + 2), stride);
  if constexpr (kBlocks > 3) _tile_stored(3, s + 16 * (j0 + 3), stride);
}

constexpr int64_t kGroup = 16;  // keys per A tile

// out [128] = the key's codes `row` as bf16 in fp8_bf16_feature's order;
// the codes `ahead` bytes on are asked for (a hint, harmless past the
// end): the codes are read from memory once, so their lines are in flight
// well before they are needed.
[[gnu::always_inline]] inline void decode_row(const cpu::Fp8Bf16Tables& t, const uint8_t* row,
                                              int64_t ahead, uint16_t* out) {
  _mm_prefetch(reinterpret_cast<const char*>(row + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + ahead + 64), _MM_HINT_T0);
  __m512i c0 = _mm512_loadu_si512(row), c1 = _mm512_loadu_si512(row + 64);
  // Held in registers: GCC would load the codes again for each instruction
  // that reads them (vpermi2b overwrites its index operand), 3 loads for 1
  // beside the tile loads (4-5 % of the scoring's time, one thread).
  asm("" : "+v"(c0), "+v"(c1));
  __m512i f0, s0, f1, s1;
  cpu::fp8_bf16_words(t, c0, &f0, &s0);
  cpu::fp8_bf16_words(t, c1, &f1, &s1);
  _mm512_storeu_si512(out, f0);
  _mm512_storeu_si512(out + 32, s0);
  _mm512_storeu_si512(out + 64, f1);
  _mm512_storeu_si512(out + 96, s1);
}

// Key n's row of keys [16][128] (rows code_stride apart from codes): its
// codes decoded, or 0 at or past count.
[[gnu::always_inline]] inline void decode_or_zero(const cpu::Fp8Bf16Tables& t, const uint8_t* codes,
                                                  int64_t code_stride, int64_t n, int64_t count,
                                                  uint16_t* out) {
  if (n < count)
    decode_row(t, codes + n * code_stride, 4 * kGroup * code_stride, out);
  else
    std::memset(out, 0, kAmxIndexerDim * sizeof(uint16_t));
}

// The reduction of 16 keys' head scores s [16][ss] to score[n] = ks[n *
// ks_stride] * sum_h w_h ReLU(s[n][h]), NaN -> -inf, in three parts so that
// it can run beside the products: key_lanes for each key, quad for keys
// 4i .. 4i + 3, reduce_finish for the 16. Each key's 16-lane partial sums
// are reduced across lanes for all 16 keys at once (a transpose by unpack
// and shuffle, 15 adds), not one key at a time.
//
// Head weights: in registers for 64 heads (kBlocks 4), else read from w.
template <int kBlocks>
struct HeadWeights {
  explicit HeadWeights(const float* w) {
    for (int j = 0; j < kBlocks; ++j) reg[j] = _mm512_loadu_ps(w + 16 * j);
  }
  __m512 block(const float*, int64_t j) const { return reg[j]; }
  __m512 reg[kBlocks];
};
template <>
struct HeadWeights<0> {
  explicit HeadWeights(const float*) {}
  __m512 block(const float* w, int64_t j) const { return _mm512_loadu_ps(w + 16 * j); }
};

// sum_j w_j max(0, row_j) in 16 lanes, row = one key's head scores. max(0,
// x) keeps a NaN x (vmaxps returns its second operand when either is NaN),
// so a NaN head score reaches the total.
template <int kBlocks>
[[gnu::always_inline]] inline __m512 key_lanes(const float* row, int64_t any_blocks,
                                               const HeadWeights<kBlocks>& hw, const float* w) {
  const int64_t blocks = kBlocks > 0 ? kBlocks : any_blocks;
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc = _mm512_mul_ps(_mm512_max_ps(zero, _mm512_loadu_ps(row)), hw.block(w, 0));
  for (int64_t j = 1; j < blocks; ++j)
    acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(row + 16 * j)), hw.block(w, j), acc);
  return acc;
}

// Per 128-bit lane, the lane's sums of the four keys' lanes v (via pairs:
// per lane, [a0+a2, b0+b2, a1+a3, b1+b3]).
[[gnu::always_inline]] inline __m512 quad(const __m512* v) {
  const __m512 p0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 p1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(p0, p1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// score[n], n < count (<= 16), from the four quads, each counted in hist
// (when not null) by its first digit; the lanes of the keys whose scale is
// not finite and > 0 or-ed into *bad.
void reduce_finish(const __m512* q, const float* ks, int64_t ks_stride, int64_t count, float* score,
                   uint32_t* hist, __mmask16* bad) {
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
  const __m512 out =
      _mm512_mask_blend_ps(nan, total, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  _mm512_mask_storeu_ps(score, live, out);
  if (hist == nullptr) return;
  // The select's first digit (top 11 bits of the order key), lane l into
  // the l % 4-th of the four interleaved histograms, as add_topk_histogram
  // counts (the select adds the four).
  alignas(64) uint32_t bin[kGroup];
  _mm512_store_si512(bin, _mm512_srli_epi32(order_keys16(out), 21));
  for (int64_t l = 0; l < count; ++l) ++hist[(l % 4) * 2048 + bin[l]];
}

// C = the 16 keys at `keys` times every head block, stored to s [16][ss];
// between(u) after product u of the first four head blocks.
template <int kBlocks, class Between>
[[gnu::always_inline]] inline void multiply_group(const uint16_t* keys, const uint16_t* q,
                                                  int64_t blocks, float* s, int64_t ss,
                                                  const Between& between) {
  if constexpr (kBlocks == 4) {
    key_tile<4>(keys, q, 0, s, ss, between);
    return;
  }
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
// units decode group g + 1 and reduce group g - 1 (decoded keys and head
// scores each in two scratch slots), one key of each right after each of
// g's 16 products. The instructions must be interleaved that finely in
// the program, not left to the out-of-order core: with a step's work for
// 4 keys between products, the decoding did not overlap them (one thread,
// 16K keys in cache: 16 products alone ~100 ns a group, decoding alone
// ~85, reduction ~45; all three 200-230 ns in 4-key steps, 160-175 in
// 1-key steps with the row decoding inlined and its codes and the weights
// in registers). The likely reason: a tile register is not renamed, so
// tile loads and products that wait on earlier products hold the
// scheduler's entries.
template <int kBlocks>
bool scores_by_groups(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                      int64_t blocks, const float* w, const float* ks, int64_t ks_stride,
                      uint16_t* keys, float* s, float* score, uint32_t* hist) {
  const cpu::Fp8Bf16Tables tables = cpu::fp8_bf16_tables();
  const HeadWeights<kBlocks> hw(w);
  const int64_t ss = blocks * 16, groups = (count + kGroup - 1) / kGroup;
  const auto key_slot = [&](int64_t g) { return keys + (g % 2) * kGroup * kAmxIndexerDim; };
  const auto score_slot = [&](int64_t g) { return s + (g % 2) * kGroup * ss; };
  __mmask16 bad = 0;
  __m512 lanes[4], quads[4];
  // Key u of the 16 head-score rows at `rows`; after every fourth key, the
  // four keys' quad.
  const auto reduce_key = [&](const float* rows, int64_t u) {
    lanes[u % 4] = key_lanes<kBlocks>(rows + u * ss, blocks, hw, w);
    if (u % 4 == 3) quads[u / 4] = quad(lanes);
  };
  const auto finish = [&](int64_t g) {
    reduce_finish(quads, ks + g * kGroup * ks_stride, ks_stride,
                  std::min(kGroup, count - g * kGroup), score + g * kGroup, hist, &bad);
  };
  for (int64_t u = 0; u < kGroup; ++u)
    decode_or_zero(tables, codes, code_stride, u, count, key_slot(0) + u * kAmxIndexerDim);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* next = key_slot(g + 1);
    const float* prev = score_slot(g + 1);  // group g - 1's
    const int64_t r0 = (g + 1) * kGroup;
    if (g > 0 && r0 + kGroup <= count) {
      // The steady state: a whole group to decode, one to reduce.
      const int64_t ahead = 4 * kGroup * code_stride;
      const uint8_t* rows = codes + r0 * code_stride;
      multiply_group<kBlocks>(key_slot(g), q, blocks, score_slot(g), ss, [&](int64_t u) {
        decode_row(tables, rows + u * code_stride, ahead, next + u * kAmxIndexerDim);
        reduce_key(prev, u);
      });
    } else {
      multiply_group<kBlocks>(key_slot(g), q, blocks, score_slot(g), ss, [&](int64_t u) {
        if (r0 < count)
          decode_or_zero(tables, codes, code_stride, r0 + u, count, next + u * kAmxIndexerDim);
        if (g > 0) reduce_key(prev, u);
      });
    }
    if (g > 0) finish(g - 1);
  }
  _tile_release();
  for (int64_t u = 0; u < kGroup; ++u) reduce_key(score_slot(groups - 1), u);
  finish(groups - 1);
  return bad == 0;
}

}  // namespace

bool indexer_amx_scores(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                        int64_t heads, const float* w, const float* ks, int64_t ks_stride,
                        uint16_t* keys, float* s, float* score, uint32_t* hist) {
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
                                                                   s, score, hist);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build

bool indexer_amx_available() { return false; }

bool indexer_amx_scores(const uint8_t*, int64_t, int64_t, const uint16_t*, int64_t, const float*,
                        const float*, int64_t, uint16_t*, float*, float*, uint32_t*) {
  return true;
}

#endif

}  // namespace attnkit::kernels
