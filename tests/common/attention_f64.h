// An independent float64 attention oracle for tests.
//
// It is deliberately written unlike the kernels: per (batch, head) it builds
// an explicit boolean visibility matrix [seqlen_q, seqlen_k] from the rules
// in include/attnkit/attention.h, materialises the whole score matrix, then
// runs a masked softmax in double. It shares no code with src/ (only the
// public SparsePattern struct, as plain data), so a misreading of the rules
// in the kernels shows up as a disagreement here.
//
// Header-only because tests/CMakeLists.txt compiles only *_test.cc files.
//
// Layouts (contiguous, row-major):
//   q     [batch, seqlen_q, num_heads,    head_dim]
//   k     [batch, seqlen_k, num_kv_heads, head_dim]
//   v     [batch, seqlen_k, num_kv_heads, head_dim_v]
//   out   [batch, seqlen_q, num_heads,    head_dim_v]
//   lse   [batch, num_heads, seqlen_q]
//   probs [batch, num_heads, seqlen_q, seqlen_k]
//   mask  [mask_shape[0..3]], each dim 1 or the full
//         [batch, num_heads, seqlen_q, seqlen_k] size.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "attnkit/attention.h"

namespace attnkit_test {

struct OracleOptions {
  int64_t batch = 1;
  int64_t seqlen_q = 1;
  int64_t seqlen_k = 1;
  int64_t num_heads = 1;
  int64_t num_kv_heads = 1;
  int64_t head_dim = 1;
  int64_t head_dim_v = 1;

  double softmax_scale = 0.0;  // 0 = 1/sqrt(head_dim)
  bool causal = false;
  int64_t window_left = -1;   // -1 = unlimited
  int64_t window_right = -1;  // -1 = unlimited
  double softcap = 0.0;       // 0 = off

  std::vector<int32_t> seqlens_k;  // [batch]; empty = seqlen_k for all
  // [batch] key position of query row 0; empty = L - seqlen_q (bottom-right).
  // Lets cache tests state the alignment explicitly.
  std::vector<int64_t> q_offset;

  // At most one of the two masks, laid out as described above.
  std::array<int64_t, 4> mask_shape{1, 1, 1, 1};
  std::vector<uint8_t> bool_mask;  // nonzero = keep
  std::vector<double> add_mask;    // added to the score

  attnkit::SparsePattern sparse;

  int64_t chunk_size = 0;     // > 0: key j visible from p only if j, p share a chunk
  std::vector<double> sinks;  // [num_heads] sink logits; empty = none
};

struct OracleResult {
  std::vector<double> out;    // [batch, seqlen_q, num_heads, head_dim_v]
  std::vector<double> lse;    // [batch, num_heads, seqlen_q]
  std::vector<double> probs;  // [batch, num_heads, seqlen_q, seqlen_k]
};

namespace oracle_detail {

// Mathematical floor(x / m) and x mod m in [0, m) for m > 0, computed from
// the non-negative remainder (not from a corrected quotient as src/ does).
inline int64_t mod_pos(int64_t x, int64_t m) {
  const int64_t r = x % m;
  return r < 0 ? r + m : r;
}
inline int64_t div_floor(int64_t x, int64_t m) { return (x - mod_pos(x, m)) / m; }

// Whether the Sparse Transformer pattern admits query position p, key j.
inline bool pattern_admits(const attnkit::SparsePattern& sp, int64_t p, int64_t j) {
  using Kind = attnkit::SparsePattern::Kind;
  if (sp.kind == Kind::kNone) return true;
  const int64_t qa = div_floor(p, sp.block_size);
  const int64_t kb = div_floor(j, sp.block_size);
  const int64_t l = sp.stride;
  if (sp.kind == Kind::kStrided) {
    const int64_t dist = qa > kb ? qa - kb : kb - qa;
    return dist < l || mod_pos(qa - kb, l) == 0;
  }
  const bool same_chunk = div_floor(qa, l) == div_floor(kb, l);
  const bool summary_block = mod_pos(kb, l) >= l - sp.summary;
  return same_chunk || summary_block;
}

inline int64_t bcast(const std::array<int64_t, 4>& shape, int axis, int64_t index) {
  return shape[axis] == 1 ? 0 : index;
}

}  // namespace oracle_detail

inline OracleResult attention_f64(const OracleOptions& o, std::span<const double> q,
                                  std::span<const double> k, std::span<const double> v) {
  using oracle_detail::bcast;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int64_t B = o.batch, Sq = o.seqlen_q, Sk = o.seqlen_k, H = o.num_heads,
                Hkv = o.num_kv_heads, D = o.head_dim, Dv = o.head_dim_v;
  const double scale = o.softmax_scale != 0.0 ? o.softmax_scale : 1.0 / std::sqrt(double(D));
  const int64_t heads_per_kv = H / Hkv;

  OracleResult r;
  r.out.assign(static_cast<size_t>(B * Sq * H * Dv), 0.0);
  r.lse.assign(static_cast<size_t>(B * H * Sq), -kInf);
  r.probs.assign(static_cast<size_t>(B * H * Sq * Sk), 0.0);

  std::vector<uint8_t> visible(static_cast<size_t>(Sq * Sk));
  std::vector<double> scores(static_cast<size_t>(Sq * Sk));

  auto mask_index = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    const auto& ms = o.mask_shape;
    return ((bcast(ms, 0, b) * ms[1] + bcast(ms, 1, h)) * ms[2] + bcast(ms, 2, i)) * ms[3] +
           bcast(ms, 3, j);
  };

  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = o.seqlens_k.empty() ? Sk : o.seqlens_k[static_cast<size_t>(b)];
    const int64_t offset = o.q_offset.empty() ? L - Sq : o.q_offset[static_cast<size_t>(b)];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / heads_per_kv;  // the kv head this query head reads

      // 1. Visibility from the positional rules and the masks.
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t p = i + offset;
        for (int64_t j = 0; j < Sk; ++j) {
          bool vis = j < L;
          if (o.causal && j > p) vis = false;
          if (o.window_left >= 0 && j < p - o.window_left) vis = false;
          if (o.window_right >= 0 && j > p + o.window_right) vis = false;
          if (o.chunk_size > 0 && oracle_detail::div_floor(j, o.chunk_size) !=
                                      oracle_detail::div_floor(p, o.chunk_size))
            vis = false;
          if (!oracle_detail::pattern_admits(o.sparse, p, j)) vis = false;
          if (!o.bool_mask.empty() && o.bool_mask[size_t(mask_index(b, h, i, j))] == 0) vis = false;
          // A -inf bias masks like a false entry: the key's K is never read.
          if (!o.add_mask.empty() && o.add_mask[size_t(mask_index(b, h, i, j))] == -kInf)
            vis = false;
          visible[size_t(i * Sk + j)] = vis ? 1 : 0;
        }
      }

      // 2. Scores of visible pairs only (masked K is never touched);
      //    -inf after the additive mask turns the pair invisible.
      for (int64_t i = 0; i < Sq; ++i) {
        for (int64_t j = 0; j < Sk; ++j) {
          const size_t ij = size_t(i * Sk + j);
          if (!visible[ij]) continue;
          const double* qv = &q[size_t(((b * Sq + i) * H + h) * D)];
          const double* kv = &k[size_t(((b * Sk + j) * Hkv + g) * D)];
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
          double s = dot * scale;
          if (o.softcap > 0.0) s = std::tanh(s / o.softcap) * o.softcap;
          if (!o.add_mask.empty()) s += o.add_mask[size_t(mask_index(b, h, i, j))];
          if (s == -kInf) visible[ij] = 0;
          scores[ij] = s;
        }
      }

      // 3. Masked softmax per row, then the weighted sum of visible V rows.
      for (int64_t i = 0; i < Sq; ++i) {
        double m = -kInf;
        bool any = false, nan = false;
        for (int64_t j = 0; j < Sk; ++j) {
          const size_t ij = size_t(i * Sk + j);
          if (!visible[ij]) continue;
          any = true;
          if (std::isnan(scores[ij]))
            nan = true;
          else if (scores[ij] > m)
            m = scores[ij];
        }
        const size_t lse_at = size_t((b * H + h) * Sq + i);
        // A sink is one more logit in the softmax whose column is dropped
        // afterwards (the way gpt-oss writes it).
        const bool sink = !o.sinks.empty();
        if (!any) {  // out 0, probs 0 (already set); lse -inf, or the sink
          if (sink) r.lse[lse_at] = o.sinks[size_t(h)];
          continue;
        }
        double* orow = &r.out[size_t(((b * Sq + i) * H + h) * Dv)];
        double* prow = &r.probs[size_t(((b * H + h) * Sq + i) * Sk)];
        if (nan) {
          const double qnan = std::numeric_limits<double>::quiet_NaN();
          r.lse[lse_at] = qnan;
          for (int64_t d = 0; d < Dv; ++d) orow[d] = qnan;
          for (int64_t j = 0; j < Sk; ++j)
            if (visible[size_t(i * Sk + j)]) prow[j] = qnan;
          continue;
        }
        if (sink) m = std::max(m, o.sinks[size_t(h)]);
        double denom = sink ? std::exp(o.sinks[size_t(h)] - m) : 0.0;
        for (int64_t j = 0; j < Sk; ++j)
          if (visible[size_t(i * Sk + j)]) denom += std::exp(scores[size_t(i * Sk + j)] - m);
        r.lse[lse_at] = m + std::log(denom);
        for (int64_t j = 0; j < Sk; ++j) {
          if (!visible[size_t(i * Sk + j)]) continue;
          const double pj = std::exp(scores[size_t(i * Sk + j)] - m) / denom;
          prow[j] = pj;
          const double* vv = &v[size_t(((b * Sk + j) * Hkv + g) * Dv)];
          for (int64_t d = 0; d < Dv; ++d) orow[d] += pj * vv[d];
        }
      }
    }
  }
  return r;
}

}  // namespace attnkit_test
