// Inputs of the gated delta rule's kernels (src/kernels/gated_delta_rule_params.h)
// token-major (every head of a token in one row), and one call of a kernel
// form on them, on those rows or on a head-major copy (the layout the
// GatedDeltaNet layer hands the kernels): shared by the kernel tests
// (tests/kernels/gated_delta_rule_test.cc) and the fuzzer
// (fuzz/gated_delta_fuzz.cc). No gtest here: the fuzzer links without it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "attnkit/status.h"
#include "kernels/dispatch.h"
#include "kernels/gated_delta_rule_params.h"

namespace attnkit_test {

// One call's sizes and inputs. Every token has one row of `width` floats,
// q | k | v interleaved (hk * dk, hk * dk, hv * dv) and then any padding,
// as a wider projection's output would carry.
struct GdrInputs {
  int64_t batch = 0, seq = 0, hk = 0, hv = 0, dk = 0, dv = 0;
  int64_t width = 0;           // floats per token row, >= 2 hk dk + hv dv
  std::vector<float> rows;     // [batch * seq, width]
  std::vector<float> g, beta;  // [batch * seq, hv] log-decays and write strengths
  std::vector<float> state0;   // [batch, hv, dk, dv] the state before the first token
};

// Scales each token's q and k heads to unit length and q further by
// dk^-0.5, which the kernels' contract assumes: the layer's L2 norm (its
// eps of 1e-6 in the sum of squares, FLA's value) and query scale.
inline void normalise_qk(GdrInputs& in) {
  for (int64_t t = 0; t < in.batch * in.seq; ++t)
    for (int64_t h = 0; h < 2 * in.hk; ++h) {
      float* v = in.rows.data() + t * in.width + h * in.dk;
      double ss = 0;
      for (int64_t d = 0; d < in.dk; ++d) ss += static_cast<double>(v[d]) * v[d];
      const double scale = h < in.hk ? 1.0 / std::sqrt(static_cast<double>(in.dk)) : 1.0;
      const double f = scale / std::sqrt(ss + 1e-6);
      for (int64_t d = 0; d < in.dk; ++d) v[d] = static_cast<float>(v[d] * f);
    }
}

// Runs one form on a copy of in.state0 and sets *out to the outputs
// [batch * seq, hv * dv] followed by the final state [batch, hv, dk, dv].
// The outputs start as `unwritten`, so an output the kernel skips shows.
// The kernel writes into buffers of exactly the extent it addresses, so
// that ASan reports any access past them. head_gap >= 0: the kernel reads
// q, k and v from a head-major copy instead ([2 hk + hv heads][batch * seq
// rows][head dim], as the layer lays out its blocks), each head's rows
// followed by head_gap unused floats, so that a head stride taken for
// another shows.
inline attnkit::Status run_gdr(const GdrInputs& in, attnkit::Backend backend,
                               attnkit::kernels::GdrForm form, int threads, float unwritten,
                               std::vector<float>* out, int64_t head_gap = -1) {
  std::vector<float> outputs(static_cast<size_t>(in.batch * in.seq * in.hv * in.dv), unwritten);
  std::vector<float> state = in.state0;
  const int64_t T = in.batch * in.seq, qks = T * in.dk + head_gap, vs = T * in.dv + head_gap;
  std::vector<float> heads;  // [2 hk, qks] then [hv, vs] when head-major
  if (head_gap >= 0) {
    heads.assign(static_cast<size_t>(2 * in.hk * qks + in.hv * vs), unwritten);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = in.rows.data() + t * in.width;
      for (int64_t h = 0; h < 2 * in.hk; ++h)
        std::copy(row + h * in.dk, row + (h + 1) * in.dk, heads.data() + h * qks + t * in.dk);
      for (int64_t h = 0; h < in.hv; ++h) {
        const float* v = row + 2 * in.hk * in.dk + h * in.dv;
        std::copy(v, v + in.dv, heads.data() + 2 * in.hk * qks + h * vs + t * in.dv);
      }
    }
  }
  attnkit::kernels::GatedDeltaRuleParams p;
  p.batch = in.batch;
  p.seq = in.seq;
  p.num_k_heads = in.hk;
  p.num_v_heads = in.hv;
  p.key_head_dim = in.dk;
  p.value_head_dim = in.dv;
  p.q = in.rows.data();
  p.k = p.q + in.hk * in.dk;
  p.v = p.q + 2 * in.hk * in.dk;
  p.q_stride = p.k_stride = p.v_stride = in.width;
  if (head_gap >= 0) {
    p.q = heads.data();
    p.k = p.q + in.hk * qks;
    p.v = p.q + 2 * in.hk * qks;
    p.q_stride = p.k_stride = in.dk;
    p.v_stride = in.dv;
    p.q_head_stride = p.k_head_stride = qks;
    p.v_head_stride = vs;
  }
  p.g = in.g.data();
  p.beta = in.beta.data();
  p.state = state.data();
  p.out = outputs.data();
  p.out_stride = in.hv * in.dv;
  p.num_threads = threads;
  p.form = form;
  const attnkit::Status st = attnkit::kernels::run_gated_delta_rule(p, backend);
  *out = std::move(outputs);
  out->insert(out->end(), state.begin(), state.end());
  return st;
}

}  // namespace attnkit_test
