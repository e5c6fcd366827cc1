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

// AMX intrinsics: GCC 11 and clang 12 on; older compilers build the stubs.
#if defined(__x86_64__) && defined(__linux__) &&      \
    ((defined(__clang__) && __clang_major__ >= 12) || \
     (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11))
#define ATTNKIT_INDEXER_AMX 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's own AVX-512 headers trip -W(maybe-)uninitialized (GCC bug
// 105593: the `__m512 __Y = __Y;` idiom behind _mm512_undefined_ps).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/cpu/fp8_bf16.h"
#endif

namespace attnkit::kernels {

#if defined(ATTNKIT_INDEXER_AMX)

namespace {

bool request_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u, vbmi = (c >> 1) & 1u;
  if (!tile || !bf16 || !vbmi) return false;
  // Linux hands out the 8 KiB of tile state per process, on request
  // (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel that
  // refuses, or predates it, leaves AMX off.
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) return false;
  return (granted >> kXtileData) & 1ul;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

bool indexer_amx_available() {
  static const bool available = request_amx();
  return available;
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

constexpr int64_t kGroup = 16;  // keys per A tile

// keys [16][128] = the codes of rows r0 .. r0 + 15 (row_stride apart) as
// bf16 in fp8_bf16_feature's order, rows at or past count 0.
void decode_group(const cpu::Fp8Bf16Tables& t, const uint8_t* codes, int64_t row_stride, int64_t r0,
                  int64_t count, uint16_t* keys) {
  const int64_t n = std::min(kGroup, count - r0);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = codes + (r0 + r) * row_stride;
    // The same row four groups on: the codes are read from memory once, so
    // their lines are in flight well before they are needed. A hint,
    // harmless past the end.
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * kGroup * row_stride), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + 4 * kGroup * row_stride + 64), _MM_HINT_T0);
    cpu::fp8_bf16_decode64(t, row, keys + r * kAmxIndexerDim);
    cpu::fp8_bf16_decode64(t, row + 64, keys + r * kAmxIndexerDim + 64);
  }
  if (n < kGroup)
    std::memset(keys + n * kAmxIndexerDim, 0,
                static_cast<size_t>((kGroup - n) * kAmxIndexerDim) * sizeof(uint16_t));
}

// score[n] = ks[n * ks_stride] * sum_h w_h ReLU(s[n][h]) for the n < count
// (<= 16) keys whose head scores s [16][ss] holds; NaN -> -inf. Each key's
// 16-lane partial sums are reduced across lanes for all 16 keys at once (a
// transpose by unpack and shuffle, 15 adds), not one key at a time.
void reduce_group(const float* s, int64_t ss, int64_t blocks, const float* w, const float* ks,
                  int64_t ks_stride, int64_t count, float* score) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 v[kGroup];
  for (int64_t n = 0; n < kGroup; ++n) {
    // max(0, x) keeps a NaN x (vmaxps returns its second operand when
    // either is NaN), so a NaN head score reaches the total.
    __m512 acc =
        _mm512_mul_ps(_mm512_max_ps(zero, _mm512_loadu_ps(s + n * ss)), _mm512_loadu_ps(w));
    for (int64_t j = 1; j < blocks; ++j)
      acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(s + n * ss + 16 * j)),
                            _mm512_loadu_ps(w + 16 * j), acc);
    v[n] = acc;
  }
  // Pairs: per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
  __m512 p[8];
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // Quads: per lane, the lane's sums of keys 4i .. 4i + 3.
  __m512 q[4];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
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
  const __m512 total = _mm512_mul_ps(sum, scale);
  const __mmask16 nan = _mm512_cmp_ps_mask(total, total, _CMP_UNORD_Q);
  _mm512_mask_storeu_ps(
      score, live,
      _mm512_mask_blend_ps(nan, total, _mm512_set1_ps(-std::numeric_limits<float>::infinity())));
}

// C = the 16 keys at `keys` times every head block, stored to s [16][ss].
void multiply_group(const uint16_t* keys, const uint16_t* q, int64_t blocks, float* s, int64_t ss) {
  for (int64_t j0 = 0; j0 < blocks; j0 += 4) {
    switch (blocks - j0) {
      case 1:
        key_tile<1>(keys, q, j0, s, ss);
        break;
      case 2:
        key_tile<2>(keys, q, j0, s, ss);
        break;
      case 3:
        key_tile<3>(keys, q, j0, s, ss);
        break;
      default:
        key_tile<4>(keys, q, j0, s, ss);
        break;
    }
  }
}

}  // namespace

// By groups of 16 keys: the tile unit multiplies group g while, behind it
// in program order, the vector units decode group g + 1 and reduce group
// g - 1 (each in its own of two scratch slots). Measured on the bench's
// 128K keys, the order of these three steps changes little (within the
// noise of 4.0-4.5 ms on one thread: decode all 64 keys, then multiply,
// then reduce, as before, was as fast); what paid was making each step
// cheaper.
void indexer_amx_scores(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                        int64_t heads, const float* w, const float* ks, int64_t ks_stride,
                        uint16_t* keys, float* s, float* score) {
  if (count <= 0) return;
  const cpu::Fp8Bf16Tables tables = cpu::fp8_bf16_tables();
  TileConfig cfg;
  for (int r = 0; r < 6; ++r) {
    cfg.rows[r] = 16;
    cfg.colsb[r] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t blocks = (heads + 15) / 16, ss = blocks * 16;
  const int64_t groups = (count + kGroup - 1) / kGroup;
  const auto key_slot = [&](int64_t g) { return keys + (g % 2) * kGroup * kAmxIndexerDim; };
  const auto score_slot = [&](int64_t g) { return s + (g % 2) * kGroup * ss; };
  const auto reduce = [&](int64_t g) {
    reduce_group(score_slot(g), ss, blocks, w, ks + g * kGroup * ks_stride, ks_stride,
                 std::min(kGroup, count - g * kGroup), score + g * kGroup);
  };
  decode_group(tables, codes, code_stride, 0, count, key_slot(0));
  for (int64_t g = 0; g < groups; ++g) {
    multiply_group(key_slot(g), q, blocks, score_slot(g), ss);
    if (g + 1 < groups)
      decode_group(tables, codes, code_stride, (g + 1) * kGroup, count, key_slot(g + 1));
    if (g > 0) reduce(g - 1);
  }
  _tile_release();
  reduce(groups - 1);
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
