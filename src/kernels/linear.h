// Dense projections for the layers, in nn.Linear's convention:
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
//   x [rows, in_features] row stride ldx; w [out_features, in_features]
//   contiguous; y [rows, out_features] row stride ldy; bias may be null.
// Accumulates in fp32 with eight partial sums (error grows ~ sqrt(k) eps).
// Every layer calls this one function, so swapping in a tuned GEMM is a
// change here only.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

void linear(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features);

// RMSNorm over the last dimension, in double:
//   y = x / sqrt(mean(x^2) + eps) * gain
// x and y are [rows, dim] with row strides; y may equal x (in place).
void rms_norm(const float* x, int64_t ldx, const float* gain, float* y, int64_t ldy, int64_t rows,
              int64_t dim, double eps);

}  // namespace attnkit::kernels
