// Planning of the fast attention kernel (attention_cpu.h): the geometry
// of one call (sizes shared by every task, the scratch layout) and its task
// list, both functions of the shapes and the plan only, never of the thread
// count, so that the reduction order and the output bits do not depend on
// it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/attention_params.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/kernel_table.h"

namespace attnkit::kernels::cpu {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A (batch item, block of kv heads, query block): the unit whose rows share
// packed q tiles (one per kv head). With parts >= 2 its keys were split and
// merge() combines partials [first_part, first_part + parts).
struct Base {
  int64_t b, g, qb;  // g: the first kv head of the block
  int64_t first_part;
  int64_t parts;
};

// Keys [k0, k1) of one base. part < 0: the task owns all of the base's
// keys and writes the output rows itself.
struct Task {
  int64_t base;
  int64_t k0, k1;
  int64_t part;
  int64_t cost;
};

// Sizes shared by every task of one call, and the scratch layout.
struct Geometry {
  const KernelTable* kt = nullptr;
  bool bf16 = false;        // K/V are bf16
  bool q8 = false;          // K/V are 8-bit codes (kI8, kFp8E4M3) ...
  bool fp8 = false;         // ... fp8 E4M3 ones (else int8)
  bool row_scales = false;  // ... with one scale per head row (else per block of channels)
  bool dot_bf16 = false;    // bf16 K/V, or 8-bit K/V copied as bf16, go through vdpbf16ps
  bool copy_v = false;      // fp32 V tiles are copied to a compact buffer
  // PV reads V from the vw buffer: copy_v, bf16 with no pv_widen, or 8-bit
  // V dequantized (with block scales, or for tiles of many rows).
  bool pv_copies = false;
  // int8 V where it lies goes through KernelTable::pv_i8_f32 (fp32 weights
  // for any rows) instead of pv_i8: batch-invariant plans.
  bool pv_i8_f32 = false;
  bool rows_qk = false;   // S = K Q^T by qk_rows_* (q row-major, qt_row apart)
  bool k_copies = false;  // QK reads K from the kw buffer (bf16 widened, 8-bit dequantized)
  // int8 keys, tiles of 5 to kInt8ScoreGroupsMaxRows rows: qk_rows_i8 per
  // group of 4 rows (Plan::int8_score_groups), each group's packed scores
  // in the kw buffer (nk x 4), then copied into s's columns. Batch-invariant
  // plans take it for 8-bit keys with row scales of any rows: qk_rows_i8,
  // or qk_rows_fp8 over m_pad fp32 query rows in qt (qt_row apart).
  bool qk_groups = false;
  // Plan::amx_qk, for bf16 keys or 8-bit keys with row scales in tiles of
  // 16 padded rows: the keys copied or decoded to bf16 rows in the kw
  // buffer (the tile's bk key scales, then bk x qt_row uint16s), the
  // queries in qt as decode_amx.h's operand.
  bool amx_qk = false;
  // Plan::amx_pv (with amx_qk): each tile's values decoded to bf16 pairs
  // in vw, their scales, row pointers and prefetch distances in kw, the
  // weights in pack; o holds m_pad rows.
  bool amx_pv = false;
  // amx_qk with int8 keys: their codes on AMX-INT8 (amx_qk_i8), int16
  // queries (q16_rows = 16) split in two int8 operands after qf in qt;
  // the codes copied into kw after the scales, then the int32 C tiles.
  bool amx_int8 = false;
  int64_t amx_kd8 = 0;  // round_up(head_dim, 64): the codes' row stride
  // Rows of int16 queries in qt (pack_q_int16): 4 for qk_rows_i8 on a
  // tile of at most 4 rows, m_pad for int8 qk_groups, else 0 (none).
  int64_t q16_rows = 0;
  bool k_then_v = true;            // Plan::k_then_v
  bool fetch_sweep_ahead = false;  // Plan::fetch_sweep_ahead
  // Plan::batch_invariant: key tiles end at multiples of bk (a task's
  // first tile may be shorter), so a row's visible keys fall into the same
  // tiles whichever rows share its task.
  bool fixed_tiles = false;
  int64_t qt_row = 0;
  int64_t group = 1, bq = 1, bk = 1, q_blocks = 0, bases = 0, max_parts = 1;
  int64_t heads = 1, head_blocks = 1;  // kv heads per task, blocks of them
  int64_t m_max = 0, m_pad = 0, s_stride = 0, d = 0, dv = 0, d_pad = 0, dv_pad = 0, vw_stride = 0;
  int64_t part_floats = 0;  // one partial: per head o [m_max][dv], row_max, row_sum
  // Offsets in floats inside one worker's region: per kv head of a task
  // (head h at offset + h * head_floats) ...
  int64_t qt = 0, o = 0, row_max = 0, row_sum = 0, head_floats = 0;
  // ... and shared by the heads (but for s, which holds each head's scores
  // of a tile, s_head floats apart, as tasks of several heads run all QK
  // first).
  int64_t qrows = 0, s = 0, s_head = 0, alpha = 0, ones = 0, kw = 0, vw = 0, seen = 0, pack = 0,
          bitmap = 0, row_lo = 0, row_hi = 0, worker_floats = 0;
  // Byte offsets of the shared regions.
  size_t tasks_at = 0, bases_at = 0, parts_at = 0, workers_at = 0, total = 0;
  int workers = 1;
};

// Whether tiles of m_max packed rows take the qk_rows_* kernels and their
// packed s, rather than qk_f32 / qk_bf16: fp32 keys, bf16 keys with
// dot_bf16 (the vdpbf16ps one), or 8-bit keys with one scale per row
// (row_scales; the others are dequantized into a copy).
inline bool takes_rows_qk(const KernelTable& kt, int64_t m_max, DType kv, bool dot_bf16,
                          bool row_scales) {
  const int64_t m_pad = (m_max + kt.lanes - 1) / kt.lanes * kt.lanes;
  if (m_max > kt.qk_rows_max || m_pad != kt.lanes) return false;
  switch (kv) {
    case DType::kI8:
      return row_scales && kt.qk_rows_i8 != nullptr;
    case DType::kFp8E4M3:
      return row_scales && kt.qk_rows_fp8 != nullptr;
    default:
      return dot_bf16 ? kt.qk_rows_bf16 != nullptr : kt.qk_rows_f32 != nullptr;
  }
}

inline constexpr size_t kAlign = 64;

Geometry make_geometry(const AttentionParams& p, const Plan& plan);

// Everything one call's tasks share.
struct Call {
  const AttentionParams& p;
  const Geometry& g;
  const Base* bases;
  float* parts;
};

// Fills bases[0, g.bases) and the task list (sorted longest first) for
// scratch laid out by make_geometry; returns the number of tasks and sets
// *num_parts to the number of split partials.
int64_t plan_tasks(const AttentionParams& p, const Plan& plan, const Geometry& g, Base* bases,
                   Task* tasks, int64_t* num_parts);

}  // namespace attnkit::kernels::cpu
