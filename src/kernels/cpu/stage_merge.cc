// The output stage: a task's rows normalised into out and lse, or stored
// as a split's partial, and the merge of a split base's partials
// (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace attnkit::kernels::cpu {
namespace {

// How a row's unnormalised output o (weights e^(s - max), summing to sum)
// becomes out = o * scale, and its lse.
struct Normalizer {
  float scale, lse;
};

// Without a sink: scale = 1 / sum, lse = max + log(sum). Head h's sink
// adds e^sink to the denominator; with m = max(max, sink) it is
// sum e^(max - m) + e^(sink - m), so a large sink or large scores cannot
// overflow. Empty rows (sum = 0): scale 0, lse -inf, or the sink. NaN in
// max (a row that saw a NaN score) stays NaN.
Normalizer normalize(const AttentionParams& p, int64_t h, float max, float sum) {
  if (p.sinks == nullptr) {
    if (sum == 0.0f) return {0.0f, kNegInf};
    return {1.0f / sum, max + std::log(sum)};
  }
  const float sink = p.sinks[h * p.sinks_stride];
  if (sum == 0.0f) return {0.0f, sink};
  const float m = std::isnan(max) || max > sink ? max : sink;
  const float rescale = std::exp(max - m);
  const float denom = sum * rescale + std::exp(sink - m);
  return {rescale / denom, m + std::log(denom)};
}

}  // namespace

void TaskRunner::write_rows() const {
  const float* o = o_;
  for (int64_t m = 0; m < m_; ++m) {
    const int64_t h = head_of(m), i = p_.q_row(b_, row_of(m));
    const Normalizer n = normalize(p_, h, row_max_[m], row_sum_[m]);
    float* out = p_.out + b_ * p_.out_stride.batch + i * p_.out_stride.row + h * p_.out_stride.head;
    const float* row = o + m * g_.dv_pad;
    if (row_sum_[m] == 0.0f)  // no visible key: 0, never NaN
      for (int64_t c = 0; c < g_.dv; ++c) out[c * p_.out_stride.dim] = 0.0f;
    else if (p_.out_stride.dim == 1)
      for (int64_t c = 0; c < g_.dv; ++c) out[c] = row[c] * n.scale;  // vectorised by the compiler
    else
      for (int64_t c = 0; c < g_.dv; ++c) out[c * p_.out_stride.dim] = row[c] * n.scale;
    if (p_.lse)
      p_.lse[b_ * p_.lse_stride_batch + h * p_.lse_stride_head + i * p_.lse_stride_row] = n.lse;
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
    const Normalizer n = normalize(p, h, max, total);
    float* out = p.out + base.b * p.out_stride.batch + i * p.out_stride.row + h * p.out_stride.head;
    for (int64_t c = 0; c < g.dv; ++c) out[c * p.out_stride.dim] = acc[c] * n.scale;
    if (p.lse)
      p.lse[base.b * p.lse_stride_batch + h * p.lse_stride_head + i * p.lse_stride_row] = n.lse;
  }
}
}  // namespace attnkit::kernels::cpu
