// Planning (task_plan.h): the geometry and scratch layout of a call, and
// its task list, from the shapes and the plan (tile_policy.h) alone.
#include "kernels/cpu/task_plan.h"

#include <algorithm>

#include "kernels/cpu/decode_amx.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/mask.h"

namespace attnkit::kernels::cpu {
namespace {

size_t align_bytes(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

Geometry make_geometry(const AttentionParams& p, const Plan& plan) {
  Geometry g;
  g.kt = plan.kernels != nullptr ? plan.kernels : kernel_table(plan.target);
  const int64_t lanes = g.kt->lanes;
  g.bf16 = p.kv_dtype == DType::kBF16;
  g.dot_bf16 = g.bf16 && g.kt->qk_bf16 != nullptr;
  g.group = p.num_heads / p.num_kv_heads;
  g.heads = std::clamp<int64_t>(plan.kv_heads_per_task, 1, p.num_kv_heads);
  g.k_then_v = plan.k_then_v;
  g.fetch_sweep_ahead = plan.fetch_sweep_ahead;
  g.fixed_tiles = plan.batch_invariant;
  g.head_blocks = ceil_div(p.num_kv_heads, g.heads);
  g.bq = plan.block_q;
  g.bk = plan.block_k;
  g.q_blocks = ceil_div(p.seqlen_q, g.bq);
  g.bases = p.batch * g.head_blocks * g.q_blocks;
  g.max_parts = plan.split_k > 0 ? std::max<int64_t>(1, ceil_div(p.seqlen_k, plan.split_k)) : 1;
  g.m_max = g.bq * g.group;
  g.m_pad = round_up(g.m_max, lanes);
  g.d = p.head_dim;
  g.dv = p.head_dim_v;
  g.d_pad = round_up(g.d, lanes);
  g.dv_pad = round_up(g.dv, lanes);
  g.vw_stride = odd_line_stride(g.dv_pad);
  g.q8 = p.kv_dtype == DType::kI8 || p.kv_dtype == DType::kFp8E4M3;
  g.fp8 = p.kv_dtype == DType::kFp8E4M3;
  g.row_scales = g.q8 && (p.scale_block == 0 || p.scale_block >= std::max(g.d, g.dv));
  if (g.q8) {
    // 1-4 rows with row scales read the codes where they lie (qk_rows_i8 /
    // _fp8, pv_i8 / _fp8), and so do int8 keys of up to 16 rows where the
    // plan says so (qk_groups); more rows dequantize each K tile once for all
    // of them, and tiles of kCopyValuesMinRows rows or more (prefill, absorbed
    // MLA) each V tile too, as bf16 for the vdpbf16ps kernels where the
    // target has them and the plan says so (tile_policy.h). Block scales
    // are always dequantized.
    g.rows_qk = takes_rows_qk(*g.kt, g.m_max, p.kv_dtype, false, g.row_scales);
    g.qk_groups = !g.rows_qk && !g.fp8 && g.row_scales && plan.int8_score_groups &&
                  g.m_max <= kInt8ScoreGroupsMaxRows && g.kt->qk_rows_i8 != nullptr;
    g.k_copies = !g.rows_qk && !g.qk_groups;
    g.q16_rows = g.qk_groups ? g.m_pad : g.rows_qk && !g.fp8 ? 4 : 0;
    g.pv_copies = !g.row_scales || g.m_max >= kCopyValuesMinRows ||
                  (g.fp8 ? g.kt->pv_fp8 == nullptr : g.kt->pv_i8 == nullptr);
    g.dot_bf16 = g.k_copies && g.pv_copies && g.kt->dequant_bf16 != nullptr && plan.dequant_bf16;
    if (plan.batch_invariant) {
      // The paths above round by the task's row count (qk_rows_fp8 and
      // the copies' qk_f32 sum over head_dim in other orders; pv_i8 on
      // AVX-512 takes int16 weights for up to 16 rows, fp32 ones beyond;
      // 32+ rows take the copies), and a row's count is its call's: a
      // prefix-cache hit's suffix or a decode step took another path than
      // the same rows in one call. So every count takes one path. V with
      // row scales is read where it lies by pv_fp8 / pv_i8_f32, which
      // multiply in fp32 for every row count on every target: the weights
      // times each key's scale, then one FMA chain per row and output
      // column over the keys in order (simd::pv_block), whatever the rows
      // beside it or the register block. (Until 2026-11-27 int8 V on
      // AVX-512 was dequantized into the fp32 copy instead, as pv_i8's
      // int16 weights serve up to 16 rows: decode took 1.68x the default
      // plan's time at 1 token, docs/PERFORMANCE.md#batch-invariance.)
      // Block-scaled V is dequantized into the fp32 copy for pv_f32 (exact
      // per value; over fixed tiles the fp32 K/V batch-invariant kernel).
      // int8 keys with row scales are scored by qk_rows_i8 in groups of 4
      // rows, whose int32 sums are exact and whose factors are each row's
      // own. fp8 keys with row scales take
      // qk_rows_fp8 in groups of 4 rows too: it always computes 4 rows,
      // each in its own accumulators, reduced by the same tree whatever the
      // row's or key's slot in its block (hsum16 on AVX-512; hsum8 and
      // hsum4 on AVX2 add a source's lanes in one order), so a row's score
      // does not depend on the rows beside it. Block-scaled keys, and fp8
      // on targets without the kernel (scalar), take the fp32 copy for
      // qk_f32.
      g.rows_qk = g.dot_bf16 = false;
      g.qk_groups =
          g.row_scales && (g.fp8 ? g.kt->qk_rows_fp8 != nullptr : g.kt->qk_rows_i8 != nullptr);
      g.k_copies = !g.qk_groups;
      g.pv_copies = !g.row_scales || (g.fp8 ? g.kt->pv_fp8 == nullptr : g.kt->pv_i8_f32 == nullptr);
      g.pv_i8_f32 = !g.pv_copies && !g.fp8;
      g.q16_rows = g.qk_groups && !g.fp8 ? g.m_pad : 0;
    }
  } else {
    const int64_t elem_bytes = g.bf16 ? 2 : 4;
    g.copy_v = !g.dot_bf16 && g.m_max >= kCopyValuesMinRows &&
               (p.v_stride.row * elem_bytes) % kCopyValuesStrideBytes == 0;
    const bool widen = g.bf16 && !g.dot_bf16;
    g.pv_copies = g.copy_v || (widen && g.kt->pv_widen == nullptr);
    g.rows_qk =
        !plan.batch_invariant && takes_rows_qk(*g.kt, g.m_max, p.kv_dtype, g.dot_bf16, false);
    g.k_copies = widen && !(g.rows_qk && g.kt->qk_rows_widen != nullptr);
  }
  if (plan.amx_qk && plan.target == SimdTarget::kAvx512Bf16 && !plan.batch_invariant &&
      g.m_max > 4 && g.m_pad == 16 && g.bk % 16 == 0 && (g.bf16 || (g.q8 && g.row_scales))) {
    // S = K Q^T on AMX (tile_policy.h, scores_on_amx) instead of the K
    // copy, the int8 groups or the rows kernels; with amx_pv P V too,
    // else bf16 V keep pv_bf16 and 8-bit V pv_i8 / pv_fp8.
    g.amx_qk = true;
    g.rows_qk = g.qk_groups = g.k_copies = false;
    g.q16_rows = 0;
    if (g.q8 && !g.fp8) {
      g.amx_int8 = true;
      g.q16_rows = 16;
      g.amx_kd8 = round_up(g.d, 64);
    }
    if (plan.amx_pv) {
      g.amx_pv = true;
      g.pv_copies = false;
    }
  }
  g.s_stride = score_stride(g.m_pad, g.rows_qk);
  g.qt_row = round_up(g.d, 32);
  g.part_floats = plan.split_k > 0 ? round_up(g.heads * g.m_max * (g.dv + 2), 16) : 0;

  int64_t at = 0;
  auto take = [&](int64_t floats) {
    const int64_t start = at;
    at += round_up(floats, 16);
    return start;
  };
  // Column blocks of qk_block_cols: m_pad rounded up to a whole block.
  const int64_t qt_cols = round_up(g.m_pad, g.kt->qk_block_cols);
  // Also holds the bf16 pairs, or qk_rows_*'s 4 row-major rows (int8 keys:
  // q16_rows int16 rows, then their factors; fp8 keys by groups: m_pad fp32
  // rows).
  const int64_t f32_rows = g.qk_groups && g.fp8 ? g.m_pad : 4;
  g.qt =
      take(std::max({round_up(g.d, 2) * qt_cols, f32_rows * g.qt_row,
                     ceil_div(g.q16_rows * g.qt_row, 2) + g.q16_rows, g.amx_qk ? 16 * g.qt_row : 0,
                     g.amx_int8 ? 8 * g.qt_row + 16 + 8 * g.amx_kd8 : 0}));
  g.o = take((g.amx_pv ? g.m_pad : g.m_max) * g.dv_pad);
  g.row_max = take(g.m_pad);
  g.row_sum = take(g.m_pad);
  g.head_floats = at;
  at = g.heads * g.head_floats;
  g.qrows = take(2 * g.m_max);  // const float* per packed row
  g.s_head = round_up(g.bk * g.s_stride, 16);
  g.s = take(g.heads * g.s_head);
  g.alpha = take(g.m_pad);
  g.ones = take(g.m_pad);
  g.kw = take(g.k_copies    ? g.bk * g.d_pad
              : g.qk_groups ? g.bk * 4
              : g.amx_qk
                  ? g.bk + std::max({g.bk * g.qt_row / 2, 4 * g.bk, g.bk * g.amx_kd8 / 4 + 1024})
                  : 0);
  g.vw = take(g.pv_copies ? g.bk * g.vw_stride : g.amx_pv ? 32 * g.dv_pad : 0);
  g.seen = take(4 * g.m_pad);  // int64 pairs
  g.pack = take(g.amx_pv && g.amx_int8 ? (kAmxPvI8WeightBytes / 4 + kAmxPvI8SumInts)
                : g.amx_pv             ? 16 * 64  // amx_pv's weights, two parts
                : g.dot_bf16           ? ceil_div(pv_bf16_pack_elems(g.bk, g.s_stride, g.dv_pad), 2)
                : g.q8 && !g.pv_copies ? ceil_div(pv_8bit_pack_elems(g.bk, g.s_stride), 2)
                                       : 0);
  g.bitmap = take(p.sparse.kind != SparsePattern::Kind::kNone ? ceil_div(g.bq * g.bk, 4) : 0);
  g.row_lo = take(2 * g.bq);  // int64
  g.row_hi = take(2 * g.bq);
  g.worker_floats = at;

  const int64_t max_tasks = g.bases * g.max_parts;
  g.workers =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(plan.num_threads, max_tasks)));
  size_t bytes = 0;
  g.tasks_at = bytes;
  bytes = align_bytes(bytes + sizeof(Task) * static_cast<size_t>(max_tasks));
  g.bases_at = bytes;
  bytes = align_bytes(bytes + sizeof(Base) * static_cast<size_t>(g.bases));
  g.parts_at = bytes;
  bytes = align_bytes(bytes + sizeof(float) * static_cast<size_t>(max_tasks * g.part_floats));
  g.workers_at = bytes;
  bytes += sizeof(float) * static_cast<size_t>(g.worker_floats) * static_cast<size_t>(g.workers);
  g.total = bytes + kAlign;  // slack to align the caller's pointer
  return g;
}

int64_t plan_tasks(const AttentionParams& p, const Plan& plan, const Geometry& g, Base* bases,
                   Task* tasks, int64_t* num_parts_out) {
  int64_t num_tasks = 0, num_parts = 0, base_index = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t offset = p.offset_of(b);
    for (int64_t kvh = 0; kvh < p.num_kv_heads; kvh += g.heads)
      for (int64_t qb = 0; qb < g.q_blocks; ++qb, ++base_index) {
        const int64_t i0 = qb * g.bq, i1 = std::min(i0 + g.bq, p.rows_of(b));
        Base& base = bases[base_index];
        base = {b, kvh, qb, 0, 1};
        if (i0 >= i1) continue;  // a ragged batch's shorter item: no rows here
        int64_t lo, hi_first, lo_last, hi;
        key_range(p, b, i0 + offset, &lo, &hi_first);
        key_range(p, b, i1 - 1 + offset, &lo_last, &hi);
        const int64_t m_count = (i1 - i0) * g.group * std::min(g.heads, p.num_kv_heads - kvh);
        const int64_t split = plan.split_k;
        if (split > 0 && hi > lo && ceil_div(hi, split) - lo / split >= 2) {
          base.first_part = num_parts;
          for (int64_t sidx = lo / split; sidx * split < hi; ++sidx) {
            const int64_t k0 = std::max(lo, sidx * split), k1 = std::min(hi, (sidx + 1) * split);
            tasks[num_tasks++] = {base_index, k0, k1, num_parts++, (k1 - k0) * m_count};
          }
          base.parts = num_parts - base.first_part;
        } else {
          const int64_t k1 = std::max(lo, hi);
          tasks[num_tasks++] = {base_index, lo, k1, -1, (k1 - lo) * m_count};
        }
      }
  }
  // Longest first, so that the last tasks to start are short ones.
  std::sort(tasks, tasks + num_tasks, [](const Task& a, const Task& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.base != b.base) return a.base < b.base;
    return a.k0 < b.k0;
  });
  *num_parts_out = num_parts;
  return num_tasks;
}

}  // namespace attnkit::kernels::cpu
