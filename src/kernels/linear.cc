#include "kernels/linear.h"

#include <cmath>

namespace attnkit::kernels {

void linear(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features) {
  constexpr int kLanes = 8;  // independent partial sums: lets the compiler vectorise
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    for (int64_t n = 0; n < out_features; ++n) {
      const float* wr = w + n * in_features;
      float acc[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= in_features; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += xr[k + l] * wr[k + l];
      float tail = 0.0f;
      for (; k < in_features; ++k) tail += xr[k] * wr[k];
      float sum = tail;
      for (int l = 0; l < kLanes; ++l) sum += acc[l];
      yr[n] = bias ? sum + bias[n] : sum;
    }
  }
}

void rms_norm(const float* x, int64_t ldx, const float* gain, float* y, int64_t ldy, int64_t rows,
              int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    double ss = 0.0;
    for (int64_t d = 0; d < dim; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) yr[d] = static_cast<float>(xr[d] * inv * gain[d]);
  }
}

}  // namespace attnkit::kernels
