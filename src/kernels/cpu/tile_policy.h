// Tile and split sizes of the fast CPU attention kernel, in one place, each
// with the measurement behind it. Correctness never depends on them (tests
// run many other values); only speed does. Nothing here may depend on the
// thread count: the split size decides the reduction order, and the output
// must be the same bits for any number of threads.
#pragma once

#include <cstdint>
#include <limits>

#include "core/cpu_features.h"
#include "kernels/amx.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/attention_cpu.h"

namespace attnkit::kernels::cpu {

// Packed rows (query rows x heads of the kv group) per task. The K/V tile
// is reused across all of them, and the pack-Q, finish and per-tile
// softmax-bookkeeping costs are spread over them; 256 rows keep the q tile
// (256 x 128 fp32 = 128 KiB) and the accumulators in L2.
inline constexpr int64_t kTargetRows = 256;

// Keys per tile: the S tile is 64 x m_pad fp32 and a K or V tile of 64
// rows of head_dim 128 is 32 KiB, so the V tile that PV streams per column
// block stays in L1.
inline constexpr int64_t kKeysPerTile = 64;

// Keys per tile on AVX2 for tasks of at most kShortTileMaxRows packed rows
// per kv head (1-token decode; 2 tokens under GQA-4). Each head step
// prefetches the rows of its next phase (tile()), so the tile size is also
// the prefetch distance: at 64 keys of head_dim 128, 32 KiB of fp32 rows
// are in flight while 32 KiB more are read, the whole of a Zen 3 core's
// L1. On a Zen 3 (GQA 32/8, 16K keys, 2 threads, tile sizes alternated
// call by call, medians of 30 pairs), 64-key tiles took 1.26-1.31x the
// time of these for 1-token fp32, 1.08-1.22x for bf16, 1.14-1.30x at
// batch 8 and 1.11x for 2 tokens; 8-24 keys all gained, 32 and more did
// not, and head dims 64 and 256 kept the same best sizes within 3 %. Per
// key, a short tile's arithmetic on data in the L1 costs the same
// (decode_tile_bench). 16 rows (4 tokens) lost 2-10 % with short tiles:
// their phases are long enough already. Measured on AVX2 only
// (tile sizes alternated call by call in one process, GQA 32/8, 16K keys,
// 2 threads; 2026-11-24 at 3070e75 on a Zen 3:
// docs/PERFORMANCE.md#short-decode-tiles-on-avx2); the AVX-512 targets keep the tile
// they were tuned with on a Zen 5, whose L1 is 48 KiB.
inline constexpr int64_t kShortTileKeysF32 = 12;  // four 3-key QK blocks
inline constexpr int64_t kShortTileKeysBf16 = 24;
inline constexpr int64_t kShortTileMaxRows = 8;

// fp32 V tiles are copied to a compact buffer when a task has at least this
// many packed rows and V's row stride is a multiple of 1 KiB: then a tile's
// columns fold onto a quarter or less of the L1 sets, and PV, which reads
// the tile once per block of 6 rows, misses L1. The copy costs one load and
// store per value; prefill (GQA 32/8: 4 KiB rows, 256 rows) gained 6 % on
// one thread. Decode (4 rows) streams V once anyway, and MLA's 2304-byte
// rows spread over all sets.
inline constexpr int64_t kCopyValuesMinRows = 32;
inline constexpr int64_t kCopyValuesStrideBytes = 1024;

// Calls with fewer (batch item, kv heads, query block) tasks than this
// split their keys so that every core has work (decode: one task per batch
// item, see kInterleaveHeadsMaxRows). A constant, not the thread count.
inline constexpr int64_t kMinTasksWithoutSplit = 64;

// Keys per split when splitting: 8 tiles, enough that the per-split costs
// (packing q, writing and merging partial rows) stay small next to the tile
// work, small enough that a 16K-key decode step gives 32 tasks per batch
// item, and absorbed MLA over 4096 keys (one kv head) gives 8.
inline constexpr int64_t kSplitKeys = 512;

// Calls whose tasks have at most this many packed rows per kv head (decode:
// 1-16 tokens times the group) walk up to kInterleaveMaxHeads kv heads of a
// batch item together, tile by tile (in the order walks_k_then_v() below
// picks), whether or not their keys are split. A cache is laid out [token, kv
// head, dim], so one kv head's rows are 512 B pieces 4 KiB apart, one page
// each: walked alone they cost a TLB miss per row and defeat the hardware
// prefetchers (a single-threaded read of such rows ran at 7-16 GB/s where a
// sequential read ran at 35); walked with the other heads, every page is used
// whole. (Walking a tile in address order, a few keys of every head at a
// time, read 1.5x faster in a read-only sweep but not in the kernel, whose
// arithmetic per byte hides the difference: docs/PERFORMANCE.md#decode-walk.)
// Bigger tasks are bound by arithmetic, not by
// memory, and keep one head each so that their q tiles and accumulators stay
// in L2.
inline constexpr int64_t kInterleaveHeadsMaxRows = 16;

// Each walked head keeps its q tile, scores and accumulators (~13 KiB at
// head_dim 128); 16 heads keep them in L2 and still read 8 KiB (fp32) or
// 4 KiB (bf16) of each token's row at a time, whole pages.
inline constexpr int64_t kInterleaveMaxHeads = 16;

// How a task of several kv heads walks each tile (Plan::k_then_v): every
// head's QK, then every head's P V, which reads the tile's K rows in one
// sweep and its V rows in another; or head by head, QK then P V. On a Zen 3
// (AVX2) the sweeps took 0.87-0.96 of the head-by-head time for 1-token
// decode (2026-11-24 at 38d9ab8). On a Zen 5 (GQA 32/8, 16K keys, 2 threads,
// the walks alternated call by call, medians of 30-40 pairs, head by head over
// the sweeps), bf16 K/V through vdpbf16ps ran faster head by head: 1 token
// 0.91 and 0.92, batch 8 0.92 and 0.95, 4 tokens 1.00. fp32 was even (1
// token 0.99 and 1.01, 2 and 4 tokens 0.99, batch 8 1.05), and so was the
// avx512 target's widened bf16 (1.03), so they keep the sweeps
// (2026-11-26 at c690f90: docs/PERFORMANCE.md#decode-walk). An Intel Xeon
// (family 6, model 167; the same avx512bf16 target, AMX for 4 tokens) goes
// the other way: bf16 with the sweeps, 1 token 2.94-3.39 against 4.31-4.34
// ms head by head (0.82-0.84 of the paired read against 0.65-0.67), batch
// 8 28.6-29.0 against 33.8-33.9 ms, 4 tokens 4.63-5.05 against 5.01
// (attnkit_bench decode/gqa32-8/k16384/{q1,b8/q1,q4}/bf16, medians of 3,
// runs of one build whose walk an environment variable switched,
// alternated, 2026-11-28 at 394cc6d). So bf16 walks head by head on AMD
// CPUs only.
inline bool walks_k_then_v(SimdTarget target, DType kv_dtype, const CpuFeatures& cpu) {
  return !(cpu.amd && target == SimdTarget::kAvx512Bf16 && kv_dtype == DType::kBF16);
}

// With k_then_v, how far ahead a task's rows are prefetched
// (Plan::fetch_sweep_ahead). A phase ahead, each head's QK fetches the next
// head's K rows and each head's P V the next head's V rows: the lines come
// one head's work before their use. A sweep ahead, each head's QK fetches
// that head's V rows of the tile and each head's P V that head's K rows of
// the next tile: about eight heads' work before. For 8-bit K/V (a 64-key
// tile of 8 kv heads, 64 KiB of K or V a sweep) that paid; for fp32 (256
// KiB a sweep, more than L1 holds) it cost: lines were evicted before use.
// GQA 32/8, 16K keys, 2 threads (attnkit_bench, best of each run, two runs
// of each build alternated, 2026-11-28 on an Intel Xeon family 6 model
// 167, the build of 7e283f9 then the same with sweeps for every dtype):
// int8 1 token 1.92 / 1.85 -> 1.45 / 1.53 ms, 4 tokens 3.83 / 3.92 ->
// 3.42 / 3.63; fp8 1 token 2.58 / 2.60 -> 2.34 / 2.38, 4 tokens 4.03 /
// 4.20 -> 3.93 / 3.91; fp32 1 token 3.11 / 3.22 -> 4.38 / 4.79, 4 tokens
// 5.85 / 5.99 -> 9.85 / 10.77 (docs/PERFORMANCE.md#prefetch). bf16 (128
// KiB a sweep) walking the sweeps on that Xeon: 1 token 0.73-0.76 of the
// paired read a sweep ahead, 0.82-0.84 a phase ahead (same runs as
// walks_k_then_v's).
inline bool fetches_a_sweep_ahead(DType kv_dtype) {
  return kv_dtype == DType::kI8 || kv_dtype == DType::kFp8E4M3;
}

// What 8-bit K/V tiles that are dequantized for many rows (prefill, absorbed
// MLA's 128 heads) become on a target with vdpbf16ps (Plan::dequant_bf16):
// bf16 for the vdpbf16ps kernels, or fp32 for the FMA kernels. A 512-bit
// vdpbf16ps does 32 multiply-adds; Intel's server cores issue one a cycle
// beside two 16-lane FMAs, so bf16 gains nothing there and pays for packing
// its pairs: absorbed MLA decode (128 heads, 576/512, 4096 keys, 2 threads,
// the two alternated call by call, 20 pairs) took 0.60 (int8) and 0.64
// (fp8) of the bf16 copies' time with fp32 ones on an Intel Xeon (family
// 6, model 207; 2026-11-26; to repeat, build with this function returning
// each answer in turn). On AMD's Zen 4 and
// Zen 5 vdpbf16ps runs at the FMA's rate (bf16 prefill reached 1.25-1.38x
// the fp32 peak on a Zen 5: docs/PERFORMANCE.md), so there they stay bf16;
// that side is unmeasured for 8-bit K/V.
inline bool dequantizes_to_bf16(const CpuFeatures& cpu) { return cpu.amd; }

// int8 keys (one scale per row) in tiles of 5 to kInt8ScoreGroupsMaxRows
// packed rows (2-4 tokens under GQA 32/8) take qk_rows_i8 once per group of
// 4 query rows, as int16 against the codes where they lie
// (Plan::int8_score_groups), instead of a dequantized copy of the tile and
// the fp32 (or bf16) product over it. Each group widens the tile's codes
// again, but from L1, and vpmaddwd (vpdpwssd) does 16 (32) multiply-adds per
// instruction where an FMA does 8 (16), with no conversion or store of the
// keys. The per-group scores cost
// a copy of 4 floats per key. One int8 decode call (GQA 32/8, head_dim 128,
// 16K keys, causal, 2 threads), the plan's two answers alternated call by
// call in one process, medians of 30 pairs, groups over copy: 2 tokens 0.74
// (avx512bf16) and 0.88 (avx2), 4 tokens 0.94 and 0.93; under callgrind
// (avx2, 4 tokens) 119.2 M instructions against 135.9 M, the QK stage 47.4 M
// (with packing q) against 69.9 M (2026-11-27 at 7223cc6 + this change, on
// an Intel Xeon family 6 model 167, load average 9-12 from other builds).
// fp8 keys keep the copy: their decoding costs 5 instructions per 8 codes,
// which 4 groups would pay 4 times. The AVX2 product stays bound by its
// multiply-adds either way (docs/PERFORMANCE.md#multi-token-8-bit-decode).
inline constexpr int64_t kInt8ScoreGroupsMaxRows = 16;
inline bool scores_int8_in_groups(SimdTarget target, int64_t rows) {
  return target != SimdTarget::kScalar && rows > 4 && rows <= kInt8ScoreGroupsMaxRows;
}

// bf16 and 8-bit keys in tiles of 5 to kAmxScoresMaxRows packed rows (2-4
// tokens under GQA 32/8) take S = K Q^T on AMX tiles (Plan::amx_qk,
// decode_amx.h) where the CPU has AMX-BF16, the OS grants its tiles and the
// active target is the top one (ATTNKIT_SIMD=avx512 or avx2 keep the FMA
// and VNNI kernels). A 16-row tile of 64 keys is exactly four C tiles: its
// QK is 16 tdpbf16ps, where vdpbf16ps needs 4,096 and the int8 groups
// (vpdpwssd) as many again. fp32 keys stay on their kernels: AMX would
// round them to bf16. Not in batch-invariant plans, whose rows must take
// one path for any row count (make_plan below). P V goes on AMX too
// (Plan::amx_pv). Decode (GQA 32/8, head_dim 128, 16K keys, 2 threads)
// with AMX over without, alternated call by call in one process, medians
// of 30 pairs: 4 tokens bf16 0.63, fp8 0.66, int8 0.83; 2 tokens bf16 0.79,
// fp8 0.78 (2026-11-27 at 46ba3f3 on an Intel Xeon family 6 model 167,
// load average 3.5-6: docs/PERFORMANCE.md#multi-token-decode-on-amx).
// int8 K/V take it from kAmxInt8MinRows rows on (3 tokens under GQA-4):
// their AMX form (AMX-INT8 for both products, the int8 kernels' int16
// queries and weights split into int8 halves, to keep their precision)
// took 1.07x the time of the int8 groups and pv_i8 at 2 tokens (8 rows),
// 0.88x at 3 (12 rows), 0.72x at 4 (same bench, 2026-11-28 at 162085d
// built with this bound at 5, medians of 15 pairs). With a cost per tile
// that does not depend on the rows and one that grows with them, those
// cross at about 9-10 rows. (Before amx_pv_i8, with bf16 P V: 1.16x, 1.06x
// and 0.83x, 2026-11-27 at 46ba3f3.)
inline constexpr int64_t kAmxScoresMaxRows = 16;
inline constexpr int64_t kAmxInt8MinRows = 10;
inline bool scores_on_amx(SimdTarget target, int64_t rows, DType kv_dtype) {
  if (target != SimdTarget::kAvx512Bf16 || rows <= 4 || rows > kAmxScoresMaxRows) return false;
  switch (kv_dtype) {
    case DType::kI8:
      return rows >= kAmxInt8MinRows && amx_int8_available();
    case DType::kBF16:
    case DType::kFp8E4M3:
      return amx_bf16_available();
    default:
      return false;
  }
}

// attnkit's own KV caches (KVCache) pad a token's row by one 64-byte line
// when its bytes are a multiple of this. Rows 4 KiB apart (GQA 8 kv heads x
// 128 fp32) put all 64 rows of a kv head's tile into the same 8 of the
// L1's 64 sets, so the tile and the rows prefetched for the next head evict
// each other, and the decode arithmetic runs 11-19 % slower than on
// adjacent rows (decode_tile_bench); 2 KiB rows use 16 sets. One more line
// per row walks the rows through every set. attnkit_bench, GQA 32/8, 16K
// keys, 2 threads, binaries without and with the padding alternated (two
// runs each, best of 3 per run): 1-token fp32 3.29 / 3.04 -> 2.66 / 2.94
// ms, bf16 1.97 / 1.89 -> 1.75 / 1.74, 4-token fp32 5.60 / 5.26 -> 4.84 /
// 4.82; batch 8 within 1-4 %. The cost is 1.6 % (fp32) or 3.1 % (bf16)
// more memory; no more bytes are read.
inline constexpr int64_t kPadTokenRowMultipleBytes = 2048;

// Elements between tokens for rows of row_elems >= 1 elements of elem_bytes
// (2 or 4). Written without multiplying, so no row size can overflow.
inline int64_t padded_token_row(int64_t row_elems, int64_t elem_bytes) {
  const int64_t pad = 64 / elem_bytes;
  return row_elems % (kPadTokenRowMultipleBytes / elem_bytes) == 0 &&
                 row_elems <= std::numeric_limits<int64_t>::max() - pad
             ? row_elems + pad
             : row_elems;
}

// Packed rows per merge item when split partials are combined: items are
// spread over the threads, and 16 rows of 512 values from 8 splits (256
// KiB) are work enough to amortise claiming an item.
inline constexpr int64_t kMergeRows = 16;

// Upper bound on the fp32 values all split partials may take together; a
// bigger call uses proportionally larger splits (still shape-only).
inline constexpr int64_t kMaxPartialFloats = int64_t{1} << 24;

inline Plan make_plan(const AttentionParams& p, SimdTarget target, int num_threads) {
  Plan plan;
  plan.target = target;
  plan.num_threads = num_threads;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t rows = (kTargetRows + group - 1) / group;
  plan.block_q = p.seqlen_q < rows ? (p.seqlen_q > 0 ? p.seqlen_q : 1) : rows;
  plan.block_k = kKeysPerTile;
  if (target == SimdTarget::kAvx2 && plan.block_q * group <= kShortTileMaxRows)
    plan.block_k = p.kv_dtype == DType::kBF16 ? kShortTileKeysBf16 : kShortTileKeysF32;
  const int64_t q_blocks = (p.seqlen_q + plan.block_q - 1) / plan.block_q;
  if (plan.block_q * group <= kInterleaveHeadsMaxRows && p.num_kv_heads > 1)
    plan.kv_heads_per_task =
        p.num_kv_heads < kInterleaveMaxHeads ? p.num_kv_heads : kInterleaveMaxHeads;
  plan.k_then_v = walks_k_then_v(target, p.kv_dtype, cpu_features());
  plan.fetch_sweep_ahead = fetches_a_sweep_ahead(p.kv_dtype);
  plan.dequant_bf16 = dequantizes_to_bf16(cpu_features());
  plan.int8_score_groups = scores_int8_in_groups(target, plan.block_q * group);
  plan.amx_qk = scores_on_amx(target, plan.block_q * group, p.kv_dtype);
  plan.amx_pv = plan.amx_qk;
  if (p.batch_invariant) {
    // Batch-invariant plans fix everything that orders a row's reduction
    // over its keys from the SIMD target alone, so that a row's output bits
    // depend on the row, its keys and the options only: not on how many
    // rows or sequences share the call, how a sequence was chunked into
    // calls (a prefix-cache hit computes only the suffix), nor the thread
    // count. Three choices depended on the call:
    //  - splitting the keys: a split row merges partial softmaxes, which
    //    rounds otherwise than one online softmax, and the split was taken
    //    by the call's task count, so a 76-row suffix after 1024 cached
    //    tokens (16 tasks: split) and the same rows of a 1100-row call (144
    //    tasks: not) differed by up to 1.2e-7;
    //  - AVX2's short decode tiles, taken for tasks of few packed rows;
    //  - tiles starting at a task's first visible key, which under a window
    //    or chunk depends on the task's first row;
    //  - QK for tasks of 1-16 packed rows (decode) by qk_rows_*, which sums
    //    over head_dim in another order than the tile kernels.
    // So keys are never split, tiles end at multiples of kKeysPerTile on
    // every target (a task's first may be shorter), and fp32 / bf16 K/V take the tile
    // kernels for any rows (Plan::batch_invariant); 8-bit K/V take one
    // path for any rows too (make_geometry): keys with one scale per row
    // scored by groups of 4 rows where they lie (int8 by qk_rows_i8 in
    // integers, fp8 by qk_rows_fp8, whose 4 rows each sum in their own
    // accumulators reduced in one order), values read where they lie by
    // pv_fp8 / pv_i8_f32, which multiply in fp32 for every row count on
    // every target (pv_i8's int16 weights on AVX-512 serve up to 16 rows),
    // the rest dequantized to fp32 copies. Before this (fp8 keys and all
    // values through copies), invariant fp8 decode took 1.8-2.4x the
    // default plan's time, now 0.9-1.1x on avx512bf16 and avx2
    // (attnkit_bench --benchmark_filter='invariant_over_default/decode',
    // 2026-11-27, d083010 against 52335bf, Intel Xeon family 6 model 167:
    // docs/PERFORMANCE.md#batch-invariance). Not covered: bf16 K/V
    // through vdpbf16ps under a window or chunk, whose P V sums pairs of
    // keys from the task's first visible key (reading the key before it
    // could touch a page the pool released). Prefix caching has neither
    // (a pool with a window or chunks refuses it).
    // Decode keeps the threads busy with fewer kv heads per task instead: a
    // head's arithmetic is the same whichever heads share its task. A call
    // with fewer (batch item, kv head, query block) tasks than threads (one
    // long sequence of a one-kv-head layer such as absorbed MLA) runs on
    // fewer threads; fixed 512-key segments merged in order, within a task
    // or across tasks by the same code, would restore the split. Cost:
    // docs/PERFORMANCE.md#batch-invariance.
    plan.block_k = kKeysPerTile;
    plan.batch_invariant = true;
    plan.amx_qk = plan.amx_pv =
        false;  // its sums over head_dim run in another order than the tiles'
    const int64_t tasks_per_head_block = p.batch * q_blocks;
    while (plan.kv_heads_per_task > 1 &&
           tasks_per_head_block *
                   ((p.num_kv_heads + plan.kv_heads_per_task - 1) / plan.kv_heads_per_task) <
               num_threads)
      plan.kv_heads_per_task = (plan.kv_heads_per_task + 1) / 2;
    return plan;
  }
  const int64_t head_blocks =
      (p.num_kv_heads + plan.kv_heads_per_task - 1) / plan.kv_heads_per_task;
  const int64_t tasks = p.batch * head_blocks * q_blocks;
  if (tasks < kMinTasksWithoutSplit && p.seqlen_k > kSplitKeys) {
    int64_t split = kSplitKeys;
    const int64_t task_floats = plan.block_q * group * plan.kv_heads_per_task * (p.head_dim_v + 2);
    const int64_t splits_allowed =
        kMaxPartialFloats / (tasks * task_floats > 0 ? tasks * task_floats : 1);
    if (splits_allowed < 2) return plan;
    while ((p.seqlen_k + split - 1) / split + 1 > splits_allowed) split *= 2;
    plan.split_k = split;
  }
  return plan;
}

}  // namespace attnkit::kernels::cpu
