// The output stage: a task's rows normalised into out and lse, or stored
// as a split's partial, and the merge of a split base's partials
// (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace attnkit::kernels::cpu {

void TaskRunner::write_rows() const {
  const float* o = o_;
  for (int64_t m = 0; m < m_; ++m) {
    const float sum = row_sum_[m], max = row_max_[m];
    const int64_t h = head_of(m), i = p_.q_row(b_, row_of(m));
    float* out = p_.out + b_ * p_.out_stride.batch + i * p_.out_stride.row + h * p_.out_stride.head;
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
void TaskRunner::store_partial(float* part) const {
  for (int64_t m = 0; m < m_; ++m)
    std::memcpy(part + m * g_.dv, o_ + m * g_.dv_pad, sizeof(float) * g_.dv);
  std::memcpy(part + g_.m_max * g_.dv, row_max_, sizeof(float) * m_);
  std::memcpy(part + g_.m_max * (g_.dv + 1), row_sum_, sizeof(float) * m_);
}

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
}  // namespace attnkit::kernels::cpu
