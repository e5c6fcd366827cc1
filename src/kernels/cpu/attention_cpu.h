// Fast CPU attention: FlashAttention-2's tiling with an online softmax, for
// prefill and (with a fixed-size split of the keys) decode alike.
//
// Work is cut into tasks of (batch item, kv head(s), block of query rows,
// key split). A task packs the queries of *all* heads of a kv group for its
// rows into one tile (rows m = query_row * group + head_in_group), so each
// K/V tile is read once for the whole group while it is in cache, then
// walks the key tiles its rows can see (decode tasks take several kv heads
// and visit them tile by tile, so that the cache is read in address order
// rather than one 4 KiB-strided head at a time): tiles outside every row's visible
// range (causal, window, chunk, seqlens_k) or rejected by the sparse pattern are
// skipped, per-key masking runs only on tiles that need it. Per tile:
//   S = K Q^T (key-major), softcap, masks, online softmax, O = alpha O + P V.
// Attention sinks join the denominator when a row is written (or its split
// partials merged), never the online softmax (stage_merge.cc).
// Nothing seqlen_q x seqlen_k is ever stored.
//
// Decode-shaped calls (few tasks) split their keys into splits of a fixed
// size that depends only on the shapes; each split writes a partial result
// and a second pass merges the splits of a row in split order. The task
// list and every reduction order are thus the same for any thread count:
// the output is the same bits for 1 or N threads.
//
// Precision: fp32 K/V, and bf16 K/V widened exactly, accumulate in fp32.
// On kAvx512Bf16, bf16 K/V go through vdpbf16ps, which rounds the scaled
// queries and the softmax weights to bf16 (relative error 2^-8 each) and
// accumulates in fp32. Decode tiles of 5-16 rows on AMX (tile_policy.h,
// scores_on_amx) round the scaled queries and the weights to bf16 for bf16
// and 8-bit K/V alike; the 8-bit codes themselves decode exactly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/kernel_table.h"

namespace attnkit::kernels::cpu {

struct Plan {
  SimdTarget target = SimdTarget::kScalar;
  int64_t block_q = 1;  // query rows per task (times the group's heads = packed rows)
  int64_t block_k = 1;  // keys per tile
  int64_t split_k = 0;  // keys per split; 0 = no split
  // Batch-invariant plans (AttentionParams::batch_invariant, tile_policy.h):
  // every task walks its keys in tiles that end at multiples of block_k,
  // wherever its rows' visible keys start, and fp32 / bf16 K/V take the
  // tile kernels for any number of rows (never qk_rows_*, whose sums over
  // head_dim run in another order), so that a row's arithmetic does not
  // depend on which rows share its task.
  bool batch_invariant = false;
  // kv heads one task walks together, tile by tile; 1 = a task per kv head.
  int64_t kv_heads_per_task = 1;
  // With several kv heads per task, how a tile is walked: every head's QK,
  // then every head's P V (true), or QK then P V head by head (false).
  bool k_then_v = true;
  // With k_then_v, how far ahead the rows are prefetched: each head's QK
  // fetches that head's V rows of the tile and each head's P V its K rows
  // of the next tile, a sweep ahead (true; tile_policy.h,
  // fetches_a_sweep_ahead), or each phase the next head's rows (false).
  bool fetch_sweep_ahead = false;
  // 8-bit K/V tiles that are dequantized (prefill, absorbed MLA) become bf16
  // for the vdpbf16ps kernels where the target has them (true), else fp32.
  bool dequant_bf16 = true;
  // int8 K/V with one scale per row and tiles of 5 to kInt8ScoreGroupsMaxRows
  // packed rows (multi-token decode): S = K Q^T by qk_rows_i8, one group of 4
  // int16 query rows at a time over the codes where they lie (true), or over
  // a dequantized fp32 / bf16 copy of the tile (false).
  bool int8_score_groups = false;
  // bf16 and 8-bit (one scale per row) keys in tiles of 5-16 packed rows
  // (multi-token decode): S = K Q^T on AMX tiles (decode_amx.h), the keys
  // copied or decoded to bf16 (tile_policy.h, scores_on_amx).
  bool amx_qk = false;
  // With amx_qk: O = alpha O + P V on AMX tiles too: the weights and the
  // values (decoded to bf16) as two keys' pairs (amx_pv), or for int8 K/V
  // the codes as four keys' quads against int8 weights (amx_pv_i8).
  bool amx_pv = false;
  int num_threads = 1;  // resolved, >= 1
  // Tests only: kernels to run instead of kernel_table(target), which still
  // names the target (the emulated AVX-512 tables,
  // cmake/attnkit_avx512_emulation.cmake).
  const KernelTable* kernels = nullptr;
};

// False for the cases the fast kernel leaves to the reference (see
// dispatch.cc): probabilities requested, K/V rows that are not contiguous
// along the head dimension, or 8-bit K/V whose scale blocks are not a
// multiple of 16 channels, adjacent.
bool supports(const AttentionParams& params);

// nullptr when this build has no kernels for `target`.
const KernelTable* kernel_table(SimdTarget target);

// Bytes of scratch attention() needs for `plan` (any alignment).
size_t scratch_bytes(const AttentionParams& params, const Plan& plan);

// Runs attention. Requires supports(params), a compiled and available
// plan.target, and `scratch` of scratch_bytes(params, plan) bytes.
void attention(const AttentionParams& params, const Plan& plan, void* scratch);

}  // namespace attnkit::kernels::cpu
