// Eigen 3's GEMM for gemm_bench, compiled for AVX-512 in its own
// translation unit (Eigen picks its SIMD width at compile time); call only
// where the CPU has AVX-512F.
#pragma once

#include <cstdint>

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) w^T, w [n, k]
// contiguous; single-threaded.
void eigen_linear_avx512(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy,
                         int64_t m, int64_t n, int64_t k);
