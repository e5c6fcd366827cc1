// The tile loop of the fast CPU attention kernel (see attention_cpu.h). This
// file is portable C++: it plans tasks, packs queries, applies masks with
// the shared rules of mask.h, and calls the active target's microkernels
// through its KernelTable for everything per tile that is arithmetic.
#include "kernels/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/threads.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/mask.h"

namespace attnkit::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

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
  bool bf16 = false;       // K/V are bf16
  bool dot_bf16 = false;   // ... and go through the vdpbf16ps kernels
  bool copy_v = false;     // V tiles are copied (bf16: widened) to a compact buffer
  bool pv_copies = false;  // PV reads V from the vw buffer (copy_v, or bf16 with no pv_widen)
  bool rows_qk = false;    // S = K Q^T by qk_rows_* (q row-major, qt_row apart)
  bool k_copies = false;   // QK reads K from the kw buffer (bf16, widened)
  bool k_then_v = true;    // Plan::k_then_v
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

constexpr size_t kAlign = 64;
size_t align_bytes(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

Geometry make_geometry(const AttentionParams& p, const Plan& plan) {
  Geometry g;
  g.kt = plan.kernels != nullptr ? plan.kernels : kernel_table(plan.target);
  const int64_t lanes = g.kt->lanes;
  g.bf16 = p.kv_dtype == DType::kBF16;
  g.dot_bf16 = g.bf16 && g.kt->qk_bf16 != nullptr;
  g.group = p.num_heads / p.num_kv_heads;
  g.heads = std::clamp<int64_t>(plan.kv_heads_per_task, 1, p.num_kv_heads);
  g.k_then_v = plan.k_then_v;
  g.head_blocks = ceil_div(p.num_kv_heads, g.heads);
  g.bq = plan.block_q;
  g.bk = plan.block_k;
  g.q_blocks = ceil_div(p.seqlen_q, g.bq);
  g.bases = p.batch * g.head_blocks * g.q_blocks;
  g.max_parts = plan.split_k > 0 ? std::max<int64_t>(1, ceil_div(p.seqlen_k, plan.split_k)) : 1;
  if (plan.split_per_item) g.max_parts = std::min(g.max_parts, kMaxSplitsPerItem);
  g.m_max = g.bq * g.group;
  g.m_pad = round_up(g.m_max, lanes);
  g.d = p.head_dim;
  g.dv = p.head_dim_v;
  g.d_pad = round_up(g.d, lanes);
  g.dv_pad = round_up(g.dv, lanes);
  g.vw_stride = odd_line_stride(g.dv_pad);
  const int64_t elem_bytes = g.bf16 ? 2 : 4;
  g.copy_v = !g.dot_bf16 && g.m_max >= kCopyValuesMinRows &&
             (p.v_stride.row * elem_bytes) % kCopyValuesStrideBytes == 0;
  const bool widen = g.bf16 && !g.dot_bf16;
  g.pv_copies = g.copy_v || (widen && g.kt->pv_widen == nullptr);
  g.rows_qk = takes_rows_qk(*g.kt, g.m_max, g.dot_bf16);
  g.k_copies = widen && !(g.rows_qk && g.kt->qk_rows_widen != nullptr);
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
  // Also holds the bf16 pairs, or qk_rows_*'s 4 row-major rows.
  g.qt = take(std::max(round_up(g.d, 2) * qt_cols, 4 * g.qt_row));
  g.o = take(g.m_max * g.dv_pad);
  g.row_max = take(g.m_pad);
  g.row_sum = take(g.m_pad);
  g.head_floats = at;
  at = g.heads * g.head_floats;
  g.qrows = take(2 * g.m_max);  // const float* per packed row
  g.s_head = round_up(g.bk * g.s_stride, 16);
  g.s = take(g.heads * g.s_head);
  g.alpha = take(g.m_pad);
  g.ones = take(g.m_pad);
  g.kw = take(g.k_copies ? g.bk * g.d_pad : 0);
  g.vw = take(g.pv_copies ? g.bk * g.vw_stride : 0);
  g.seen = take(4 * g.m_pad);  // int64 pairs
  g.pack = take(g.dot_bf16 ? ceil_div(pv_bf16_pack_elems(g.bk, g.s_stride, g.dv_pad), 2) : 0);
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

// Everything one call's tasks share.
struct Call {
  const AttentionParams& p;
  const Geometry& g;
  const Base* bases;
  float* parts;
};

// Calls f(offset in tile, physical row, count) for the runs of physically
// contiguous rows that hold logical keys [j0, j0 + n) of batch item b: one
// run for dense and packed keys, more where a ring buffer wraps or a page
// ends (AttentionParams::key_row).
template <class F>
void for_runs(const AttentionParams& p, int64_t b, int64_t j0, int64_t n, F&& f) {
  for (int64_t done = 0; done < n;) {
    int64_t count;
    const int64_t r = p.key_row(b, j0 + done, n - done, &count);
    f(done, r, count);
    done += count;
  }
}

// A prefetch hint for the kernels that read one tile's rows: `elems` from
// each row read, plus, when `next_tile`, the distance from that row to the
// row holding the same key offset in the task's next tile (a run's own
// distance: pages and rings do not keep tiles nk rows apart).
struct Prefetch {
  int64_t elems = 0;
  bool next_tile = false;
};

bool rows_finite(const void* base, DType dtype, int64_t stride, int64_t rows, int64_t cols) {
  uint32_t bad = 0;
  if (dtype == DType::kBF16) {
    const uint16_t* x = static_cast<const uint16_t*>(base);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) bad |= (x[n * stride + c] & 0x7f80u) == 0x7f80u;
  } else {
    const uint32_t* x = static_cast<const uint32_t*>(base);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) bad |= (x[n * stride + c] & 0x7f800000u) == 0x7f800000u;
  }
  return bad == 0;
}

float load_kv(const void* base, DType dtype, int64_t index) {
  if (dtype == DType::kBF16) return bf16_to_float(static_cast<const bf16*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

class TaskRunner {
 public:
  TaskRunner(const Call& call, float* ws) : c_(call), p_(call.p), g_(call.g), ws_(ws) {}

  void run(const Task& task) {
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
    // softcap reads a packed tile in whole vectors, past the last key.
    if (g_.rows_qk) std::fill_n(ws_ + g_.s, g_.heads * g_.s_head, 0.0f);
    for (int64_t h = 0; h < heads_; ++h) {
      select_head(h);
      pack_q();
      std::fill_n(row_max_, g_.m_pad, kNegInf);
      std::fill_n(row_sum_, g_.m_pad, 0.0f);
      std::fill_n(o_, m_ * g_.dv_pad, 0.0f);
    }

    task_end_ = task.k1;
    for (int64_t j0 = task.k0; j0 < task.k1; j0 += g_.bk)
      tile(j0, std::min(g_.bk, task.k1 - j0), row_lo, row_hi);

    for (int64_t h = 0; h < heads_; ++h) {
      select_head(h);
      if (task.part < 0)
        write_rows();
      else
        store_partial(c_.parts + task.part * g_.part_floats + h * g_.m_max * (g_.dv + 2));
    }
  }

 private:
  // Points the per-head members at kv head g0_ + h and its state.
  void select_head(int64_t h) {
    kvh_ = g0_ + h;
    k_ = static_cast<const char*>(p_.k) +
         (b_ * p_.k_stride.batch + kvh_ * p_.k_stride.head) * elem_size();
    v_ = static_cast<const char*>(p_.v) +
         (b_ * p_.v_stride.batch + kvh_ * p_.v_stride.head) * elem_size();
    float* state = ws_ + h * g_.head_floats;
    qt_ = state + g_.qt;
    o_ = state + g_.o;
    row_max_ = state + g_.row_max;
    row_sum_ = state + g_.row_sum;
  }

  size_t elem_size() const { return g_.bf16 ? 2 : 4; }
  const void* k_row(int64_t physical) const {
    return k_ + physical * p_.k_stride.row * static_cast<int64_t>(elem_size());
  }
  const void* v_row(int64_t physical) const {
    return v_ + physical * p_.v_stride.row * static_cast<int64_t>(elem_size());
  }
  int64_t head_of(int64_t m) const { return kvh_ * g_.group + m % g_.group; }
  int64_t row_of(int64_t m) const { return i0_ + m / g_.group; }

  // qt = scale * q in the KernelTable's blocked, transposed layout (fp32, or
  // bf16 pairs for the vdpbf16ps kernels), or as 4 row-major rows for the
  // qk_rows_* kernels. Pad columns m >= m_ are 0 so that their scores stay
  // finite. In the portable loops columns are the inner loop: writes are
  // contiguous, and the rows being read (one per column) stay in L1.
  void pack_q() {
    const float** rows = reinterpret_cast<const float**>(ws_ + g_.qrows);
    for (int64_t m = 0; m < m_; ++m)
      rows[m] = p_.q + b_ * p_.q_stride.batch + p_.q_row(b_, row_of(m)) * p_.q_stride.row +
                head_of(m) * p_.q_stride.head;
    const float scale = p_.scale;
    const int64_t w = g_.kt->qk_block_cols, dim = p_.q_stride.dim;
    const KernelTable& kt = *g_.kt;
    if (g_.rows_qk) {  // 4 row-major rows, zero-padded
      // One plain loop per row and dtype, so that the compiler vectorises
      // it (a loop over the padded row with the dtype test inside did not,
      // and took ~6 % of a bf16 decode step).
      for (int64_t r = 0; r < 4; ++r) {
        const int64_t valid = r < m_ ? g_.d : 0;
        if (g_.dot_bf16) {
          uint16_t* out = reinterpret_cast<uint16_t*>(qt_) + r * g_.qt_row;
          for (int64_t c = 0; c < valid; ++c) out[c] = float_to_bf16(rows[r][c * dim] * scale).bits;
          std::fill(out + valid, out + g_.qt_row, uint16_t{0});
        } else {
          float* out = qt_ + r * g_.qt_row;
          for (int64_t c = 0; c < valid; ++c) out[c] = rows[r][c * dim] * scale;
          std::fill(out + valid, out + g_.qt_row, 0.0f);
        }
      }
      return;
    }
    if (dim == 1 && (g_.dot_bf16 ? kt.pack_q_bf16 != nullptr : kt.pack_q_f32 != nullptr)) {
      for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
        const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
        if (g_.dot_bf16)
          kt.pack_q_bf16(rows + m0, valid, g_.d, scale,
                         reinterpret_cast<uint16_t*>(qt_) + m0 * ceil_div(g_.d, 2) * 2, w);
        else
          kt.pack_q_f32(rows + m0, valid, g_.d, scale, qt_ + m0 * g_.d, w);
      }
      return;
    }
    if (g_.dot_bf16) {
      uint16_t* qt2 = reinterpret_cast<uint16_t*>(qt_);
      const int64_t pairs = ceil_div(g_.d, 2);
      for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
        uint16_t* block = qt2 + m0 * pairs * 2;
        const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
        for (int64_t c = 0; c < pairs * 2; ++c) {
          uint16_t* out = block + (c / 2) * w * 2 + (c & 1);
          for (int64_t x = 0; x < valid; ++x)
            out[2 * x] = c < g_.d ? float_to_bf16(rows[m0 + x][c * dim] * scale).bits : 0;
          for (int64_t x = valid; x < w; ++x) out[2 * x] = 0;
        }
      }
      return;
    }
    float* qt = qt_;
    for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
      float* block = qt + m0 * g_.d;
      const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
      for (int64_t c = 0; c < g_.d; ++c) {
        float* out = block + c * w;
        for (int64_t x = 0; x < valid; ++x) out[x] = rows[m0 + x][c * dim] * scale;
        std::fill(out + valid, out + w, 0.0f);
      }
    }
  }

  // One key tile [j0, j0 + nk).
  void tile(int64_t j0, int64_t nk, const int64_t* row_lo, const int64_t* row_hi) {
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
    // 2026-11-24 at d3bb6e7 on a Zen 5: docs/PERFORMANCE-LOG.md,
    // 2026-11-24 · d3bb6e7).
    if (heads_ == 1 || !g_.k_then_v) {
      // Head by head. QK fetches this head's V rows, P V the K rows read
      // next: the next head's, or after the last head the first head's in
      // the next tile (wherever a ring or a page table puts it). Where V lies in K's rows (absorbed
      // MLA), the strides differ, or P V reads a copy (made before the product, so a fetch from P V
      // would come late), each phase fetches its own rows of the next step instead; a bf16 copy's
      // widening issues them, an fp32 copy issues none.
      for (int64_t h = 0; h < heads_; ++h) {
        select_head(h);
        const int64_t to_v = (reinterpret_cast<intptr_t>(v_) - reinterpret_cast<intptr_t>(k_)) /
                             static_cast<int64_t>(elem_size());
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
    // a Zen 3: docs/PERFORMANCE-LOG.md, 2026-11-24 · 38d9ab8). QK prefetches
    // the next head's K rows, the last head the first head's V rows; P V the
    // next head's V rows, the last head the next tile's first K rows. Those
    // two cross from K to V and need K and V rows equally strided; where not,
    // they are not issued.
    select_head(0);
    // Elements from head 0's K rows to its V rows.
    const int64_t k_to_v = (reinterpret_cast<intptr_t>(v_) - reinterpret_cast<intptr_t>(k_)) /
                           static_cast<int64_t>(elem_size());
    const bool cross = p_.k_stride.row == p_.v_stride.row;
    const int64_t last = heads_ - 1;
    for (int64_t h = 0; h < heads_; ++h) {
      select_head(h);
      const Prefetch prefetch = h < last ? Prefetch{p_.k_stride.head, false}
                                : cross  ? Prefetch{k_to_v - last * p_.k_stride.head, false}
                                         : Prefetch{};
      scores(j0, nk, ws_ + g_.s + h * g_.s_head, prefetch, seen);
    }
    for (int64_t h = 0; h < heads_; ++h) {
      select_head(h);
      const Prefetch prefetch = h < last ? Prefetch{p_.v_stride.head, false}
                                : cross && more_tiles
                                    ? Prefetch{-last * p_.v_stride.head - k_to_v, true}
                                    : Prefetch{};
      finish_head(j0, nk, ws_ + g_.s + h * g_.s_head, prefetch, seen, masked, sparse_partial,
                  row_lo, row_hi);
    }
  }

  // The selected head's tile after its scores s: softcap, masks, the online
  // softmax step and O = alpha O + P V (prefetch: as accumulate()).
  void finish_head(int64_t j0, int64_t nk, float* s, Prefetch prefetch, const int64_t* seen,
                   bool masked, bool sparse_partial, const int64_t* row_lo, const int64_t* row_hi) {
    const int64_t cols = g_.m_pad - m_lo_;
    if (p_.softcap > 0.0f) {
      if (g_.rows_qk)  // elementwise: the packed tile as rows of 16 (whole vectors)
        g_.kt->softcap(s, ceil_div(nk * 4, 16), 16, 16, p_.softcap);
      else
        g_.kt->softcap(s + m_lo_, nk, cols, g_.s_stride, p_.softcap);
    }
    if (masked) apply_masks(j0, nk, s, row_lo, row_hi, sparse_partial);
    float* alpha = ws_ + g_.alpha;
    if (g_.rows_qk)
      g_.kt->softmax_rows4(s, nk, row_max_, row_sum_, alpha);
    else
      g_.kt->softmax(s + m_lo_, nk, cols, g_.s_stride, row_max_ + m_lo_, row_sum_ + m_lo_,
                     alpha + m_lo_);
    // A weight of 0 times a NaN or Inf value is NaN: where masked keys
    // hold non-finite values, add only the nonzero weights (rare, slow).
    if (masked && !values_finite(j0, nk))
      accumulate_skipping_zeros(j0, nk, s, alpha);
    else
      accumulate(j0, nk, s, alpha, prefetch, seen);
  }

  // Elements from the rows of a run (keys from j0 + at, physical `row`,
  // `stride` apart) to what `pf` asks to prefetch, or 0 for nothing.
  int64_t prefetch_at(const Prefetch& pf, int64_t j0, int64_t nk, int64_t at, int64_t row,
                      int64_t stride) const {
    if (!pf.next_tile) return pf.elems;
    const int64_t next = j0 + nk + at;
    if (next >= task_end_) return 0;
    return pf.elems + (p_.key_row(b_, next) - row) * stride;
  }

  // `seen`: see tile(); the kernels take it for a whole tile, not for a
  // run of keys that a ring or a page cuts short.
  void scores(int64_t j0, int64_t nk, float* s, Prefetch pf, const int64_t* seen) {
    const KernelTable& kt = *g_.kt;
    auto whole = [&](int64_t n) { return n == nk ? seen : nullptr; };
    auto fetch = [&](int64_t at, int64_t row) {
      return prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
    };
    if (g_.rows_qk && g_.dot_bf16) {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(qt_);
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.qk_rows_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, q,
                        g_.qt_row, s + at * 4, fetch(at, row));
      });
    } else if (g_.rows_qk && !g_.bf16) {
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.qk_rows_f32(static_cast<const float*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_,
                       g_.qt_row, s + at * 4, fetch(at, row));
      });
    } else if (g_.dot_bf16) {
      const uint16_t* qt2 = reinterpret_cast<const uint16_t*>(qt_) + m_lo_ * ceil_div(g_.d, 2) * 2;
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.qk_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, qt2,
                   g_.m_pad - m_lo_, s + at * g_.s_stride + m_lo_, g_.s_stride, fetch(at, row));
      });
    } else if (g_.rows_qk && g_.bf16 && !g_.k_copies) {
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.qk_rows_widen(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_,
                         g_.qt_row, s + at * 4, fetch(at, row));
      });
    } else if (g_.bf16) {
      float* kw = ws_ + g_.kw;
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.widen_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d,
                      kw + at * g_.d_pad, g_.d_pad, fetch(at, row));
      });
      if (g_.rows_qk)
        kt.qk_rows_f32(kw, g_.d_pad, nk, g_.d, qt_, g_.qt_row, s, 0);
      else
        kt.qk_f32(kw, g_.d_pad, nk, g_.d, qt_ + m_lo_ * g_.d, g_.m_pad - m_lo_, s + m_lo_,
                  g_.s_stride, 0, seen);
    } else {
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.qk_f32(static_cast<const float*>(k_row(row)), p_.k_stride.row, n, g_.d,
                  qt_ + m_lo_ * g_.d, g_.m_pad - m_lo_, s + at * g_.s_stride + m_lo_, g_.s_stride,
                  fetch(at, row), whole(n));
      });
    }
  }

  // Rows [m_lo_, m_) of o += P V (s and alpha indexed by packed row).
  void accumulate(int64_t j0, int64_t nk, const float* s, const float* alpha, Prefetch pf,
                  const int64_t* seen) {
    const KernelTable& kt = *g_.kt;
    auto fetch = [&](int64_t at, int64_t row) {
      return prefetch_at(pf, j0, nk, at, row, p_.v_stride.row);
    };
    float* o = o_ + m_lo_ * g_.dv_pad;
    const float* ones = ws_ + g_.ones;
    s += m_lo_;
    alpha += m_lo_;
    const int64_t rows = m_ - m_lo_;
    auto whole = [&](int64_t n) { return n == nk ? seen : nullptr; };
    if (g_.dot_bf16) {
      uint16_t* pack = reinterpret_cast<uint16_t*>(ws_ + g_.pack);
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.pv_bf16(s + at * g_.s_stride, n, g_.m_pad - m_lo_, g_.s_stride, rows,
                   static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, g_.dv, o, g_.dv_pad,
                   at == 0 ? alpha : ones, pack, fetch(at, row));
      });
      return;
    }
    if (g_.pv_copies) {
      // A compact copy: V rows of a kv head are often 4 KiB apart (all
      // heads of a token are adjacent), which folds a tile's columns onto
      // a few L1 sets; PV reads the tile once per block of rows.
      float* vw = ws_ + g_.vw;
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        if (g_.bf16) {
          kt.widen_bf16(static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, n, g_.dv,
                        vw + at * g_.vw_stride, g_.vw_stride, fetch(at, row));
          return;
        }
        const float* v = static_cast<const float*>(v_row(row));
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(vw + (at + r) * g_.vw_stride, v + r * p_.v_stride.row, sizeof(float) * g_.dv);
      });
      kt.pv_f32(s, nk, g_.s_stride, rows, vw, g_.vw_stride, g_.dv, o, g_.dv_pad, alpha, 0, seen);
      return;
    }
    if (g_.bf16) {
      for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
        kt.pv_widen(s + at * g_.s_stride, n, g_.s_stride, rows,
                    static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, g_.dv, o, g_.dv_pad,
                    at == 0 ? alpha : ones, fetch(at, row), whole(n));
      });
      return;
    }
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.pv_f32(s + at * g_.s_stride, n, g_.s_stride, rows, static_cast<const float*>(v_row(row)),
                p_.v_stride.row, g_.dv, o, g_.dv_pad, at == 0 ? alpha : ones, fetch(at, row),
                whole(n));
    });
  }

  bool values_finite(int64_t j0, int64_t nk) const {
    bool finite = true;
    for_runs(p_, b_, j0, nk, [&](int64_t, int64_t row, int64_t n) {
      finite = finite && rows_finite(v_row(row), p_.kv_dtype, p_.v_stride.row, n, g_.dv);
    });
    return finite;
  }

  void accumulate_skipping_zeros(int64_t j0, int64_t nk, const float* s, const float* alpha) {
    float* o = o_;
    for (int64_t m = m_lo_; m < m_; ++m)
      for (int64_t c = 0; c < g_.dv; ++c) o[m * g_.dv_pad + c] *= alpha[m];
    for (int64_t n = 0; n < nk; ++n) {
      const void* v = v_row(p_.key_row(b_, j0 + n));
      for (int64_t m = m_lo_; m < m_; ++m) {
        const float w = s[n * g_.s_stride + m];
        if (w == 0.0f) continue;
        for (int64_t c = 0; c < g_.dv; ++c) o[m * g_.dv_pad + c] += w * load_kv(v, p_.kv_dtype, c);
      }
    }
  }

  // bitmap[il][n] = the sparse pattern admits (row il, key j0 + n). The
  // pattern is constant on (query block, key block) pairs, so it is asked
  // once per pair and rows of one query block share a bitmap row.
  void fill_sparse_bitmap(int64_t j0, int64_t nk, const int64_t* row_lo, const int64_t* row_hi,
                          int64_t* admitted, int64_t* admitted_visible) {
    uint8_t* bits = reinterpret_cast<uint8_t*>(ws_ + g_.bitmap);
    const SparsePattern& sp = p_.sparse;
    int64_t prev_block = 0;
    for (int64_t il = 0; il < rows_; ++il) {
      const int64_t pos = i0_ + il + offset_;
      const int64_t block = floor_div(pos, sp.block_size);
      uint8_t* row = bits + il * g_.bk;
      if (il > 0 && block == prev_block) {
        std::memcpy(row, row - g_.bk, static_cast<size_t>(nk));
      } else {
        bool admit = false;
        for (int64_t n = 0; n < nk; ++n) {
          const int64_t j = j0 + n;
          if (n == 0 || j % sp.block_size == 0) admit = sparse_admits(sp, pos, j);
          row[n] = admit;
        }
      }
      prev_block = block;
      const int64_t lo = std::clamp(row_lo[il] - j0, int64_t{0}, nk);
      const int64_t hi = std::clamp(row_hi[il] - j0, lo, nk);
      for (int64_t n = 0; n < nk; ++n) {
        *admitted += row[n];
        if (n >= lo && n < hi) *admitted_visible += row[n];
      }
    }
  }

  // Scores of keys a row may not see become -inf; the additive mask is
  // added to the others (after softcap, as in the reference).
  void apply_masks(int64_t j0, int64_t nk, float* s, const int64_t* row_lo, const int64_t* row_hi,
                   bool sparse_partial) {
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(ws_ + g_.bitmap);
    const bool per_key = sparse_partial || p_.bool_mask || p_.add_mask;
    const Strides4& ms = p_.mask_stride;
    for (int64_t il = m_lo_ / g_.group; il < rows_; ++il) {
      const int64_t lo = std::clamp(row_lo[il] - j0, int64_t{0}, nk);
      const int64_t hi = std::clamp(row_hi[il] - j0, lo, nk);
      const int64_t i = i0_ + il;
      for (int64_t hg = 0; hg < g_.group; ++hg) {
        const int64_t m = il * g_.group + hg, h = kvh_ * g_.group + hg;
        float* col = s + m;
        for (int64_t n = 0; n < lo; ++n) col[n * g_.s_stride] = kNegInf;
        for (int64_t n = hi; n < nk; ++n) col[n * g_.s_stride] = kNegInf;
        if (!per_key) continue;
        const int64_t mask_row = b_ * ms.batch + h * ms.head + i * ms.row;
        for (int64_t n = lo; n < hi; ++n) {
          const int64_t at = mask_row + (j0 + n) * ms.dim;
          // A bias of -inf masks the key like false in a bool mask (and,
          // as in the reference, NaN + -inf must not make it NaN).
          if ((sparse_partial && !bits[il * g_.bk + n]) ||
              (p_.bool_mask && p_.bool_mask[at] == 0) ||
              (p_.add_mask && p_.add_mask[at] == kNegInf)) {
            col[n * g_.s_stride] = kNegInf;
          } else if (p_.add_mask) {
            col[n * g_.s_stride] += p_.add_mask[at];
          }
        }
      }
    }
  }

  void write_rows() const {
    const float* o = o_;
    for (int64_t m = 0; m < m_; ++m) {
      const float sum = row_sum_[m], max = row_max_[m];
      const int64_t h = head_of(m), i = p_.q_row(b_, row_of(m));
      float* out =
          p_.out + b_ * p_.out_stride.batch + i * p_.out_stride.row + h * p_.out_stride.head;
      const bool empty = sum == 0.0f;  // no visible key: 0, never NaN
      const float inv = empty ? 0.0f : 1.0f / sum;
      const float* row = o + m * g_.dv_pad;
      if (empty)
        for (int64_t c = 0; c < g_.dv; ++c) out[c * p_.out_stride.dim] = 0.0f;
      else if (p_.out_stride.dim == 1)
        for (int64_t c = 0; c < g_.dv; ++c) out[c] = row[c] * inv;  // vectorised by the compiler
      else
        for (int64_t c = 0; c < g_.dv; ++c) out[c * p_.out_stride.dim] = row[c] * inv;
      if (p_.lse)
        p_.lse[b_ * p_.lse_stride_batch + h * p_.lse_stride_head + i * p_.lse_stride_row] =
            empty ? kNegInf : max + std::log(sum);
    }
  }

  // Partial layout: o [m_max][dv], then row_max [m_max], row_sum [m_max].
  void store_partial(float* part) const {
    for (int64_t m = 0; m < m_; ++m)
      std::memcpy(part + m * g_.dv, o_ + m * g_.dv_pad, sizeof(float) * g_.dv);
    std::memcpy(part + g_.m_max * g_.dv, row_max_, sizeof(float) * m_);
    std::memcpy(part + g_.m_max * (g_.dv + 1), row_sum_, sizeof(float) * m_);
  }

  const Call& c_;
  const AttentionParams& p_;
  const Geometry& g_;
  float* ws_;
  int64_t b_ = 0, i0_ = 0, rows_ = 0, m_ = 0, offset_ = 0, task_end_ = 0;
  int64_t g0_ = 0, heads_ = 1;  // the task's kv heads
  int64_t m_lo_ = 0;            // the tile's first live packed row (tile())
  // The selected head (select_head).
  int64_t kvh_ = 0;
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  float* qt_ = nullptr;
  float* o_ = nullptr;
  float* row_max_ = nullptr;
  float* row_sum_ = nullptr;
};

// Combines the partials of rows [m0, m1) of kv head hh of a split base, in
// split order (fixed by the shapes, so the result does not depend on which
// thread computed which split, nor on which merges which rows).
void merge(const Call& call, const Base& base, int64_t hh, int64_t m0, int64_t m1, float* acc) {
  const AttentionParams& p = call.p;
  const Geometry& g = call.g;
  const int64_t i0 = base.qb * g.bq;
  // Partial layout (store_partial): per head o [m_max][dv], row_max, row_sum.
  const float* first = call.parts + base.first_part * g.part_floats + hh * g.m_max * (g.dv + 2);
  for (int64_t m = m0; m < m1; ++m) {
    float max = kNegInf;
    for (int64_t s = 0; s < base.parts; ++s) {
      const float* part = first + s * g.part_floats;
      if (part[g.m_max * (g.dv + 1) + m] != 0.0f) max = std::max(max, part[g.m_max * g.dv + m]);
    }
    float total = 0.0f;
    std::fill_n(acc, g.dv, 0.0f);
    for (int64_t s = 0; s < base.parts; ++s) {
      const float* part = first + s * g.part_floats;
      const float sum = part[g.m_max * (g.dv + 1) + m];
      if (sum == 0.0f) continue;  // no visible key in this split: contributes nothing
      const float w = std::exp(part[g.m_max * g.dv + m] - max);
      total += w * sum;
      for (int64_t c = 0; c < g.dv; ++c) acc[c] += w * part[m * g.dv + c];
    }
    const int64_t h = (base.g + hh) * g.group + m % g.group, i = p.q_row(base.b, i0 + m / g.group);
    float* out = p.out + base.b * p.out_stride.batch + i * p.out_stride.row + h * p.out_stride.head;
    const bool empty = total == 0.0f;
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < g.dv; ++c) out[c * p.out_stride.dim] = empty ? 0.0f : acc[c] * inv;
    if (p.lse)
      p.lse[base.b * p.lse_stride_batch + h * p.lse_stride_head + i * p.lse_stride_row] =
          empty ? kNegInf : max + std::log(total);
  }
}

}  // namespace

const KernelTable* kernel_table(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar:
      return scalar_kernel_table();
    case SimdTarget::kAvx2:
      return avx2_kernel_table();
    case SimdTarget::kAvx512:
      return avx512_kernel_table();
    case SimdTarget::kAvx512Bf16:
      return avx512bf16_kernel_table();
  }
  return nullptr;
}

bool supports(const AttentionParams& p) {
  return p.probs == nullptr && p.k_stride.dim == 1 && p.v_stride.dim == 1 &&
         (p.kv_dtype == DType::kF32 || p.kv_dtype == DType::kBF16);
}

size_t scratch_bytes(const AttentionParams& params, const Plan& plan) {
  return make_geometry(params, plan).total;
}

void attention(const AttentionParams& p, const Plan& plan, void* scratch) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
  const Geometry g = make_geometry(p, plan);
  char* base_ptr = static_cast<char*>(scratch);
  base_ptr += (kAlign - reinterpret_cast<uintptr_t>(base_ptr) % kAlign) % kAlign;
  Task* tasks = reinterpret_cast<Task*>(base_ptr + g.tasks_at);
  Base* bases = reinterpret_cast<Base*>(base_ptr + g.bases_at);
  float* parts = reinterpret_cast<float*>(base_ptr + g.parts_at);
  float* workers = reinterpret_cast<float*>(base_ptr + g.workers_at);

  // Task list: a function of the shapes only.
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
        int64_t split = plan.split_k;
        if (plan.split_per_item && split > 0) {
          if (g.head_blocks * ceil_div(p.rows_of(b), g.bq) >= kMinTasksWithoutSplit)
            split = 0;  // the item alone has tasks enough
          else
            while (ceil_div(hi, split) - lo / split > kMaxSplitsPerItem) split *= 2;
        }
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

  const Call call{p, g, bases, parts};
  const int threads = static_cast<int>(std::min<int64_t>(g.workers, num_tasks));
  parallel_for(num_tasks, threads, [&](int64_t t, int worker) {
    TaskRunner(call, workers + worker * g.worker_floats).run(tasks[t]);
  });
  if (num_parts == 0) return;
  // Merge items: (base, kv head, block of rows), so that a call with one
  // split base (absorbed MLA: 128 rows of one kv head) merges on all
  // threads; merging there took 5 % of a 2-thread call on one thread.
  const int64_t row_blocks = ceil_div(g.m_max, kMergeRows);
  const int64_t items = g.bases * g.heads * row_blocks;
  parallel_for(
      items, static_cast<int>(std::min<int64_t>(g.workers, items)), [&](int64_t item, int worker) {
        const Base& base = bases[item / (g.heads * row_blocks)];
        const int64_t hh = item / row_blocks % g.heads;
        const int64_t m0 = item % row_blocks * kMergeRows;
        const int64_t m_count = std::min(g.bq, p.rows_of(base.b) - base.qb * g.bq) * g.group;
        if (base.parts < 2 || hh >= std::min(g.heads, p.num_kv_heads - base.g) || m0 >= m_count)
          return;
        merge(call, base, hh, m0, std::min(m0 + kMergeRows, m_count),
              workers + worker * g.worker_floats);
      });
}

}  // namespace attnkit::kernels::cpu
