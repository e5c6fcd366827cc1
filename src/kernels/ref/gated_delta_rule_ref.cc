#include "kernels/ref/gated_delta_rule_ref.h"

#include <cmath>

namespace attnkit::kernels {

size_t gated_delta_rule_ref_scratch(const GatedDeltaRuleParams& p) {
  return static_cast<size_t>(p.key_head_dim * p.value_head_dim + p.value_head_dim);
}

void gated_delta_rule_ref(const GatedDeltaRuleParams& p, double* scratch) {
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim;
  const int64_t group = p.num_v_heads / p.num_k_heads;
  double* S = scratch;                // [dk, dv]
  double* delta = scratch + dk * dv;  // [dv]
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_v_heads; ++h) {
      const int64_t kh = h / group;
      float* state = p.state + (b * p.num_v_heads + h) * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) S[i] = state[i];
      for (int64_t t = 0; t < p.seq; ++t) {
        const int64_t row = b * p.seq + t;
        const float* q = p.q_at(row, kh);
        const float* k = p.k_at(row, kh);
        const float* v = p.v_at(row, h);
        const double decay = std::exp(static_cast<double>(p.g[row * p.num_v_heads + h]));
        const double beta = p.beta[row * p.num_v_heads + h];
        for (int64_t i = 0; i < dk * dv; ++i) S[i] *= decay;
        for (int64_t j = 0; j < dv; ++j) {
          double kv = 0.0;
          for (int64_t i = 0; i < dk; ++i) kv += S[i * dv + j] * k[i];
          delta[j] = beta * (v[j] - kv);
        }
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += k[i] * delta[j];
        float* out = p.out + row * p.out_stride + h * dv;
        for (int64_t j = 0; j < dv; ++j) {
          double o = 0.0;
          for (int64_t i = 0; i < dk; ++i) o += S[i * dv + j] * q[i];
          out[j] = static_cast<float>(o);
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) state[i] = static_cast<float>(S[i]);
    }
  }
}

}  // namespace attnkit::kernels
