// Reference attention: the obvious loops, accumulated in double. It is the
// twin every fast kernel is tested against, so it favours clarity over
// speed: one query row at a time, scores kept in a caller-provided buffer,
// three passes (max, sum, weighted values).
#include "kernels/ref/attention_ref.h"

#include <cmath>
#include <limits>

#include "kernels/kv_load.h"
#include "kernels/mask.h"

namespace attnkit::kernels {
namespace {

// Score of key j for row i of (b, h), or -inf when masked. `p` is the row's
// key-space position. Only visible keys are ever loaded.
double score(const AttentionParams& prm, int64_t b, int64_t h, int64_t kvh, int64_t i, int64_t p,
             int64_t j) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  if (!sparse_admits(prm.sparse, p, j)) return kNegInf;
  const int64_t mask_off = b * prm.mask_stride.batch + h * prm.mask_stride.head +
                           i * prm.mask_stride.row + j * prm.mask_stride.dim;
  if (prm.bool_mask && prm.bool_mask[mask_off] == 0) return kNegInf;
  // A -inf bias masks the key too; decide before K is read so that NaN/Inf
  // in a masked K row cannot leak (NaN + -inf is NaN).
  if (prm.add_mask && prm.add_mask[mask_off] == kNegInf) return kNegInf;
  const float* qrow =
      prm.q + b * prm.q_stride.batch + prm.q_row(b, i) * prm.q_stride.row + h * prm.q_stride.head;
  const int64_t r = prm.key_row(b, j);
  const int64_t krow = b * prm.k_stride.batch + r * prm.k_stride.row + kvh * prm.k_stride.head;
  double dot = 0.0;
  for (int64_t d = 0; d < prm.head_dim; ++d)
    dot += static_cast<double>(qrow[d * prm.q_stride.dim]) *
           kv_element(prm, false, krow + d * prm.k_stride.dim, b, r, kvh, d);
  double s = prm.scale * dot;
  if (prm.softcap > 0.0f) s = prm.softcap * std::tanh(s / prm.softcap);
  if (prm.add_mask) s += prm.add_mask[mask_off];
  return s;
}

}  // namespace

size_t attention_ref_scratch(const AttentionParams& prm) {
  return static_cast<size_t>(prm.seqlen_k + prm.head_dim_v);
}

void attention_ref(const AttentionParams& prm, double* scratch) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double* scores = scratch;              // [seqlen_k]
  double* acc = scratch + prm.seqlen_k;  // [head_dim_v]
  const int64_t group = prm.num_heads / prm.num_kv_heads;

  for (int64_t b = 0; b < prm.batch; ++b) {
    const int64_t offset = prm.offset_of(b);
    for (int64_t h = 0; h < prm.num_heads; ++h) {
      const int64_t kvh = h / group;
      // Ragged queries: probs rows past this item's own rows are 0.
      for (int64_t i = prm.rows_of(b); prm.probs && i < prm.seqlen_q; ++i)
        for (int64_t j = 0; j < prm.seqlen_k; ++j)
          prm.probs[b * prm.probs_stride.batch + h * prm.probs_stride.head +
                    i * prm.probs_stride.row + j * prm.probs_stride.dim] = 0.0f;
      for (int64_t i = 0; i < prm.rows_of(b); ++i) {
        const int64_t p = i + offset;
        int64_t lo, hi;
        key_range(prm, b, p, &lo, &hi);

        double max_s = kNegInf;
        for (int64_t j = lo; j < hi; ++j) {
          scores[j] = score(prm, b, h, kvh, i, p, j);
          // NaN must win the max so that it propagates to this row only.
          if (scores[j] > max_s || std::isnan(scores[j])) max_s = scores[j];
        }

        for (int64_t d = 0; d < prm.head_dim_v; ++d) acc[d] = 0.0;
        double sum = 0.0;
        const bool empty = (max_s == kNegInf);
        if (!empty) {
          for (int64_t j = lo; j < hi; ++j) {
            if (scores[j] == kNegInf) continue;  // masked: never read V
            const double w = std::exp(scores[j] - max_s);
            scores[j] = w;
            sum += w;
            const int64_t r = prm.key_row(b, j);
            const int64_t vrow =
                b * prm.v_stride.batch + r * prm.v_stride.row + kvh * prm.v_stride.head;
            for (int64_t d = 0; d < prm.head_dim_v; ++d)
              acc[d] += w * kv_element(prm, true, vrow + d * prm.v_stride.dim, b, r, kvh, d);
          }
        }

        // The row's denominator is sum * e^max_s; a sink adds e^sink. Both
        // are taken relative to m = max(max_s, sink), so that neither a
        // large sink nor large scores overflow: weights are scaled by
        // e^(max_s - m) / denom, lse = m + log(denom).
        double m = max_s, denom = sum, rescale = 1.0;
        if (prm.sinks != nullptr) {
          const double sink = prm.sinks[h * prm.sinks_stride];
          if (empty) {
            m = sink;
            denom = 1.0;
          } else if (!std::isnan(max_s)) {
            m = std::max(max_s, sink);
            rescale = std::exp(max_s - m);
            denom = sum * rescale + std::exp(sink - m);
          }
        }
        const int64_t row = prm.q_row(b, i);
        float* orow =
            prm.out + b * prm.out_stride.batch + row * prm.out_stride.row + h * prm.out_stride.head;
        for (int64_t d = 0; d < prm.head_dim_v; ++d)
          orow[d * prm.out_stride.dim] =
              empty ? 0.0f : static_cast<float>(acc[d] * rescale / denom);
        if (prm.lse) {
          // Without a sink an empty row's denominator is 0: lse = -inf.
          const bool none = empty && prm.sinks == nullptr;
          prm.lse[b * prm.lse_stride_batch + h * prm.lse_stride_head + row * prm.lse_stride_row] =
              none ? -std::numeric_limits<float>::infinity()
                   : static_cast<float>(m + std::log(denom));
        }
        if (prm.probs) {
          float* prow = prm.probs + b * prm.probs_stride.batch + h * prm.probs_stride.head +
                        i * prm.probs_stride.row;
          for (int64_t j = 0; j < prm.seqlen_k; ++j) {
            const bool seen = !empty && j >= lo && j < hi && scores[j] != kNegInf;
            prow[j * prm.probs_stride.dim] =
                seen ? static_cast<float>(scores[j] * rescale / denom) : 0.0f;
          }
        }
      }
    }
  }
}

}  // namespace attnkit::kernels
