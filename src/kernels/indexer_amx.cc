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

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
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
#endif

namespace attnkit::kernels {

#if defined(ATTNKIT_INDEXER_AMX)

namespace {

bool request_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  if (!tile || !bf16) return false;
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

}  // namespace

void indexer_amx_scores(const uint16_t* keys, int64_t count, const uint16_t* q, int64_t heads,
                        const float* w, const float* ks, int64_t ks_stride, float* s,
                        float* score) {
  TileConfig cfg;
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
  // returns its second operand when either is NaN), so NaN reaches -inf.
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t n = 0; n < count; ++n) {
    __m512 acc = zero;
    for (int64_t j = 0; j < blocks; ++j)
      acc = _mm512_fmadd_ps(_mm512_max_ps(zero, _mm512_loadu_ps(s + n * ss + 16 * j)),
                            _mm512_loadu_ps(w + 16 * j), acc);
    const float total = _mm512_reduce_add_ps(acc) * ks[n * ks_stride];
    score[n] = std::isnan(total) ? -std::numeric_limits<float>::infinity() : total;
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AMX in this build

bool indexer_amx_available() { return false; }

void indexer_amx_scores(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                        const float*, int64_t, float*, float*) {}

#endif

}  // namespace attnkit::kernels
