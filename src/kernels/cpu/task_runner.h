// One task of the fast attention kernel (attention_cpu.h): a (batch item,
// block of kv heads, block of query rows, key split), walked tile by tile.
// The runner's stages live in their own files:
//   task_runner.cc    run(), select_head(), tile(): the walk and its prefetches
//   stage_qk.cc       pack_q(), scores(): S = K Q^T
//   stage_softmax.cc  finish_head(): softcap, masks, the online softmax
//   stage_pv.cc       accumulate(): O = alpha O + P V
//   stage_merge.cc    write_rows(), store_partial(), merge(): the outputs
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/attention_params.h"
#include "kernels/cpu/task_plan.h"

namespace attnkit::kernels::cpu {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

class TaskRunner {
 public:
  TaskRunner(const Call& call, float* ws) : c_(call), p_(call.p), g_(call.g), ws_(ws) {}

  void run(const Task& task);

 private:
  // task_runner.cc
  void select_head(int64_t h);
  void tile(int64_t j0, int64_t nk, const int64_t* row_lo, const int64_t* row_hi);
  // stage_qk.cc
  void pack_q();
  void pack_q_int16(const float* const* rows);
  void scores(int64_t j0, int64_t nk, float* s, Prefetch pf, const int64_t* seen);
  void scores_8bit(int64_t j0, int64_t nk, float* s, Prefetch pf, const int64_t* seen);
  void scores_8bit_groups(int64_t j0, int64_t nk, float* s, Prefetch pf);
  void scores_amx(int64_t j0, int64_t nk, float* s, Prefetch pf);
  void amx_begin();
  // stage_softmax.cc
  void finish_head(int64_t j0, int64_t nk, float* s, Prefetch prefetch, const int64_t* seen,
                   bool masked, bool sparse_partial, const int64_t* row_lo, const int64_t* row_hi);
  void fill_sparse_bitmap(int64_t j0, int64_t nk, const int64_t* row_lo, const int64_t* row_hi,
                          int64_t* admitted, int64_t* admitted_visible);
  void apply_masks(int64_t j0, int64_t nk, float* s, const int64_t* row_lo, const int64_t* row_hi,
                   bool sparse_partial);
  // stage_pv.cc
  void accumulate(int64_t j0, int64_t nk, const float* s, const float* alpha, Prefetch pf,
                  const int64_t* seen);
  void accumulate_dequantized(int64_t j0, int64_t nk, const float* s, const float* alpha,
                              Prefetch pf, const int64_t* seen);
  void accumulate_amx(int64_t j0, int64_t nk, const float* s, const float* alpha, Prefetch pf);
  bool values_finite(int64_t j0, int64_t nk) const;
  void accumulate_skipping_zeros(int64_t j0, int64_t nk, const float* s, const float* alpha);
  // stage_merge.cc
  void write_rows() const;
  void store_partial(float* part) const;

  size_t elem_size() const { return g_.q8 ? 1 : g_.bf16 ? 2 : 4; }
  // Elements from the selected head's K rows to its V rows.
  int64_t k_to_v() const {
    return (reinterpret_cast<intptr_t>(v_) - reinterpret_cast<intptr_t>(k_)) /
           static_cast<int64_t>(elem_size());
  }
  // 8-bit K/V: the scales of a physical row of the selected head.
  const float* k_scales(int64_t physical) const {
    return k_scale_ + physical * p_.k_scale_stride.row;
  }
  const float* v_scales(int64_t physical) const {
    return v_scale_ + physical * p_.v_scale_stride.row;
  }
  const void* k_row(int64_t physical) const {
    return k_ + physical * p_.k_stride.row * static_cast<int64_t>(elem_size());
  }
  const void* v_row(int64_t physical) const {
    return v_ + physical * p_.v_stride.row * static_cast<int64_t>(elem_size());
  }
  int64_t head_of(int64_t m) const { return kvh_ * g_.group + m % g_.group; }
  int64_t row_of(int64_t m) const { return i0_ + m / g_.group; }

  // Elements from the rows of a run (keys from j0 + at, physical `row`,
  // `stride` apart) to what `pf` asks to prefetch, or 0 for nothing.
  int64_t prefetch_at(const Prefetch& pf, int64_t j0, int64_t nk, int64_t at, int64_t row,
                      int64_t stride) const {
    if (!pf.next_tile) return pf.elems;
    const int64_t next = j0 + nk + at;
    if (next >= task_end_) return 0;
    return pf.elems + (p_.key_row(b_, next) - row) * stride;
  }

  const Call& c_;
  const AttentionParams& p_;
  const Geometry& g_;
  float* ws_;
  int64_t b_ = 0, i0_ = 0, rows_ = 0, m_ = 0, offset_ = 0, task_end_ = 0;
  int64_t g0_ = 0, heads_ = 1;  // the task's kv heads
  int64_t m_lo_ = 0;            // the tile's first live packed row (tile())
  bool amx_loaded_ = false;     // this thread's AMX tiles are configured (scores_amx)
  // The selected head (select_head).
  int64_t kvh_ = 0;
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  const float* k_scale_ = nullptr;  // 8-bit K/V: the scales of physical row 0
  const float* v_scale_ = nullptr;
  float* qt_ = nullptr;
  float* o_ = nullptr;
  float* row_max_ = nullptr;
  float* row_sum_ = nullptr;
};

// Combines the partials of a split base into its output rows (stage_merge.cc).
void merge(const Call& call, const Base& base, int64_t hh, int64_t m0, int64_t m1, float* acc);

}  // namespace attnkit::kernels::cpu
