// The lightning indexer's scores on AMX (Intel Advanced Matrix Extensions,
// tdpbf16ps), for kernels/sparse.cc: one 16 x 16 x 32 tile product does
// 8,192 multiply-adds, so the indexer, which does 8,192 per key (64 heads
// x 128 features) at DeepSeek-V3.2's shape, runs near the speed at which
// its 132 bytes a key can be read, where fp32 FMAs would be compute-bound.
//
// Exact as the fp32 form is: fp8 E4M3 values are bf16 values, so both
// operands are the codes' values unrounded, products are exact in fp32 and
// sums accumulate in fp32. Scales are not applied to the operands: they
// are > 0 (lightning_indexer_topk checks), so for one scale block per row
// w_h ReLU(qs_h ks_n dot) = (w_h qs_h) ks_n ReLU(dot), and the caller folds
// qs into the weights and passes ks.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

// Indexer rows this form handles: head_dim = 128 (one scale block).
inline constexpr int64_t kAmxIndexerDim = 128;

// True when the CPU has AMX-TILE and AMX-BF16 and the OS lets this process
// use the tile registers (asked for on the first call, on Linux).
bool indexer_amx_available();

// The query's layout for indexer_amx_scores: AMX B tiles of bf16 pairs,
// [ceil(heads / 16)][4 steps of 32 features][16 feature pairs][16 heads][2].
// Slot (h, p) of this layout, at this index, holds head h's feature
// cpu::fp8_bf16_feature(p) (kernels/cpu/fp8_bf16.h: the order in which the
// keys' codes are decoded); heads past `heads` up to a multiple of 16 hold 0.
inline int64_t indexer_amx_query_index(int64_t h, int64_t p) {
  return (((h / 16) * 4 + p / 32) * 16 + (p % 32) / 2) * 32 + (h % 16) * 2 + (p & 1);
}
inline int64_t indexer_amx_query_elems(int64_t heads) { return (heads + 15) / 16 * 16 * 128; }

// For n < count (any count >= 0): score[n] = ks[n * ks_stride] * sum_h
// w[h] * ReLU(sum_c key[n][c] q[h][c]), key n the 128 E4M3 codes at codes
// + n * code_stride, q as indexer_amx_query_index lays it out, w
// [round_up(heads, 16)] (zero past heads); scratch: keys of 64 * 128
// uint16s, s of 64 * round_up(heads, 16) floats. A key with a NaN code,
// or a NaN total, scores -inf, as in the other forms. Tile state is
// configured on entry and released on return. Returns whether every scale
// it read, ks[n * ks_stride] for n < count, is finite and > 0 (the check
// that lightning_indexer_topk makes of a decode step's key scales, made
// here on the scales as the scores use them instead of in a pass of its
// own). hist: nullptr, or kTopkHistogram counts (kernels/sparse.h) to
// which each score written is added as add_topk_histogram would add it,
// while it is still in a register.
bool indexer_amx_scores(const uint8_t* codes, int64_t code_stride, int64_t count, const uint16_t* q,
                        int64_t heads, const float* w, const float* ks, int64_t ks_stride,
                        uint16_t* keys, float* s, float* score, uint32_t* hist);

}  // namespace attnkit::kernels
