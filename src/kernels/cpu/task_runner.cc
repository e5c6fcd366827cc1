// TaskRunner::run, the per-head state and the tile walk (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/decode_amx.h"
#include "kernels/mask.h"

namespace attnkit::kernels::cpu {

void TaskRunner::run(const Task& task) {
  const Base& base = c_.bases[task.base];
  b_ = base.b;
  i0_ = base.qb * g_.bq;
  rows_ = std::min(g_.bq, p_.rows_of(b_) - i0_);
  m_ = rows_ * g_.group;
  offset_ = p_.offset_of(b_);
  g0_ = base.g;
  heads_ = std::min(g_.heads, p_.num_kv_heads - g0_);

  int64_t* row_lo = reinterpret_cast<int64_t*>(ws_ + g_.row_lo);
  int64_t* row_hi = reinterpret_cast<int64_t*>(ws_ + g_.row_hi);
  for (int64_t il = 0; il < rows_; ++il)
    key_range(p_, b_, i0_ + il + offset_, &row_lo[il], &row_hi[il]);
  std::fill_n(ws_ + g_.ones, g_.m_pad, 1.0f);
  // softcap reads a packed tile in whole vectors, past the last key; QK by
  // row groups leaves the pad rows' columns as they are.
  if (g_.rows_qk || g_.qk_groups) std::fill_n(ws_ + g_.s, g_.heads * g_.s_head, 0.0f);
  for (int64_t h = 0; h < heads_; ++h) {
    select_head(h);
    pack_q();
    std::fill_n(row_max_, g_.m_pad, kNegInf);
    std::fill_n(row_sum_, g_.m_pad, 0.0f);
    std::fill_n(o_, (g_.amx_pv ? g_.m_pad : m_) * g_.dv_pad, 0.0f);
  }

  task_end_ = task.k1;
  // Fixed tiles start the walk with the rest of k0's tile: never keys
  // before k0, which no row sees and a paged window may have released.
  for (int64_t j0 = task.k0; j0 < task.k1;) {
    const int64_t j1 = std::min(task.k1, g_.fixed_tiles ? (j0 / g_.bk + 1) * g_.bk : j0 + g_.bk);
    tile(j0, j1 - j0, row_lo, row_hi);
    j0 = j1;
  }

  for (int64_t h = 0; h < heads_; ++h) {
    select_head(h);
    if (task.part < 0)
      write_rows();
    else
      store_partial(c_.parts + task.part * g_.part_floats + h * g_.m_max * (g_.dv + 2));
  }
  if (amx_loaded_) amx_tiles_end();
}

// Points the per-head members at kv head g0_ + h and its state.
void TaskRunner::select_head(int64_t h) {
  kvh_ = g0_ + h;
  k_ = static_cast<const char*>(p_.k) +
       (b_ * p_.k_stride.batch + kvh_ * p_.k_stride.head) * elem_size();
  v_ = static_cast<const char*>(p_.v) +
       (b_ * p_.v_stride.batch + kvh_ * p_.v_stride.head) * elem_size();
  if (g_.q8) {
    k_scale_ = p_.k_scale + b_ * p_.k_scale_stride.batch + kvh_ * p_.k_scale_stride.head;
    v_scale_ = p_.v_scale + b_ * p_.v_scale_stride.batch + kvh_ * p_.v_scale_stride.head;
  }
  float* state = ws_ + h * g_.head_floats;
  qt_ = state + g_.qt;
  o_ = state + g_.o;
  row_max_ = state + g_.row_max;
  row_sum_ = state + g_.row_sum;
}

// One key tile [j0, j0 + nk).
void TaskRunner::tile(int64_t j0, int64_t nk, const int64_t* row_lo, const int64_t* row_hi) {
  const int64_t j1 = j0 + nk;
  bool visible = false, full = true;
  for (int64_t il = 0; il < rows_; ++il) {
    visible |= row_lo[il] < j1 && row_hi[il] > j0;
    full &= row_lo[il] <= j0 && row_hi[il] >= j1;
  }
  if (!visible) return;
  bool sparse_partial = false;
  if (p_.sparse.kind != SparsePattern::Kind::kNone) {
    int64_t admitted = 0, admitted_visible = 0;
    fill_sparse_bitmap(j0, nk, row_lo, row_hi, &admitted, &admitted_visible);
    if (admitted_visible == 0) return;
    sparse_partial = admitted < rows_ * nk;
  }
  const bool masked = !full || sparse_partial || p_.bool_mask || p_.add_mask;
  // On a causal diagonal (or a window's edge) the task's first query rows
  // may see none of this tile's keys: whole column blocks of them (the qt
  // layout's unit) are skipped, leaving their state as a fully masked tile
  // would. Without this, causal MHA, whose tasks hold 256 query rows,
  // computed ~25 % more (query, key) pairs than visible at s1024.
  int64_t il_first = 0;
  while (row_lo[il_first] >= j1 || row_hi[il_first] <= j0) ++il_first;  // a row sees it
  const int64_t w = g_.kt->qk_block_cols;
  m_lo_ = g_.rows_qk ? 0 : il_first * g_.group / w * w;
  const bool more_tiles = j1 < task_end_;
  // On a masked tile, the keys of the tile that each packed row's query
  // row sees (pad rows: none), from m_lo_ on: the products skip keys that
  // no row of a register block sees. Scores QK leaves unwritten are set by
  // apply_masks (valid rows) or belong to pad rows, whose results nothing
  // reads.
  int64_t* seen = nullptr;
  if (masked) {
    seen = reinterpret_cast<int64_t*>(ws_ + g_.seen);
    for (int64_t m = m_lo_; m < g_.m_pad; ++m) {
      int64_t* range = seen + 2 * (m - m_lo_);
      range[0] = range[1] = 0;
      if (m >= m_) continue;
      range[0] = std::clamp(row_lo[m / g_.group] - j0, int64_t{0}, nk);
      range[1] = std::clamp(row_hi[m / g_.group] - j0, range[0], nk);
    }
  }
  // Columns [m_lo_, m_pad) of the scores, alpha and the row state are
  // live. Prefetches run one phase ahead (offsets in elements from the
  // rows being read). Fetching K and V a whole head step ahead, each
  // during its own phase, left more of the lines to be evicted before use
  // and ran slower: 1-token decode 3-15 %, 4-token 5-17 % (GQA 32/8, 16K
  // keys, 2 threads, the two alternated call by call in one process;
  // 2026-11-24 at d3bb6e7 on a Zen 5: docs/PERFORMANCE.md#prefetch).
  if (heads_ == 1 || !g_.k_then_v) {
    // Head by head. QK fetches this head's V rows, P V the K rows read
    // next: the next head's, or after the last head the first head's in
    // the next tile (wherever a ring or a page table puts it). Where V lies in K's rows (absorbed
    // MLA), the strides differ, or P V reads a copy (made before the product, so a fetch from P V
    // would come late), each phase fetches its own rows of the next step instead; a bf16 copy's
    // widening issues them, an fp32 copy issues none.
    for (int64_t h = 0; h < heads_; ++h) {
      select_head(h);
      const int64_t to_v = k_to_v();
      const bool one_phase = !g_.pv_copies && p_.k_stride.row == p_.v_stride.row && to_v != 0;
      Prefetch k_next, v_next;  // none after the task's last tile
      if (h + 1 < heads_) {
        k_next = {p_.k_stride.head, false};
        v_next = {p_.v_stride.head, false};
      } else if (more_tiles) {
        k_next = {-h * p_.k_stride.head, true};
        v_next = {-h * p_.v_stride.head, true};
      }
      const bool fetch_k = h + 1 < heads_ || more_tiles;
      float* s = ws_ + g_.s + h * g_.s_head;
      scores(j0, nk, s, one_phase ? Prefetch{to_v, false} : k_next, seen);
      finish_head(j0, nk, s,
                  one_phase
                      ? (fetch_k ? Prefetch{k_next.elems - to_v, k_next.next_tile} : Prefetch{})
                      : v_next,
                  seen, masked, sparse_partial, row_lo, row_hi);
    }
    return;
  }
  // Several kv heads (decode, kInterleaveHeadsMaxRows) with k_then_v
  // (tile_policy.h says where): every head's QK first, then each head's
  // softmax and P V, so the tile's K rows are read in one sweep over their
  // token rows and its V rows in another. Head by head (QK then P V for each)
  // the reads went back and forth between the tile's K and V token rows at
  // every head: read without arithmetic (decode_read_bench), at 0.81-0.88 of a
  // sequential read against 0.85-0.96 in this order, and decode calls (GQA
  // 32/8, 16K keys, the two orders alternated call by call) take 0.94-0.96 of
  // the time for 1-token fp32, 0.87-0.96 for bf16, 0.95-0.99 for 4 tokens
  // (decode_read_bench 2 40 and the in-process A/B, 2026-11-24 at 38d9ab8 on
  // a Zen 3: docs/PERFORMANCE.md#decode-walk). A phase ahead, QK prefetches
  // the next head's K rows, the last head the first head's V rows; P V the
  // next head's V rows, the last head the next tile's first K rows. A sweep
  // ahead (Plan::fetch_sweep_ahead), each head's QK prefetches its V rows,
  // its P V its K rows of the next tile. Fetches that cross from K to V
  // need K and V rows equally strided; where not, they are not issued.
  const bool cross = p_.k_stride.row == p_.v_stride.row;
  const int64_t last = heads_ - 1;
  auto qk_fetch = [&](int64_t h) -> Prefetch {
    if (g_.fetch_sweep_ahead) return cross ? Prefetch{k_to_v(), false} : Prefetch{};  // its V rows
    if (h < last) return {p_.k_stride.head, false};
    return cross ? Prefetch{k_to_v() - last * p_.v_stride.head, false} : Prefetch{};
  };
  auto pv_fetch = [&](int64_t h) -> Prefetch {
    if (g_.fetch_sweep_ahead)  // its K rows of the next tile
      return cross && more_tiles ? Prefetch{-k_to_v(), true} : Prefetch{};
    if (h < last) return {p_.v_stride.head, false};
    return cross && more_tiles ? Prefetch{-k_to_v() - last * p_.k_stride.head, true} : Prefetch{};
  };
  for (int64_t h = 0; h < heads_; ++h) {
    select_head(h);
    scores(j0, nk, ws_ + g_.s + h * g_.s_head, qk_fetch(h), seen);
  }
  for (int64_t h = 0; h < heads_; ++h) {
    select_head(h);
    finish_head(j0, nk, ws_ + g_.s + h * g_.s_head, pv_fetch(h), seen, masked, sparse_partial,
                row_lo, row_hi);
  }
}

}  // namespace attnkit::kernels::cpu
