#include "gemm_bench_eigen.h"

#include <Eigen/Core>

void eigen_linear_avx512(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy,
                         int64_t m, int64_t n, int64_t k) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  Eigen::Map<const RowMajor, 0, Stride> xm(x, m, k, Stride(ldx));
  Eigen::Map<const RowMajor> wm(w, n, k);
  Eigen::Map<RowMajor, 0, Stride> ym(y, m, n, Stride(ldy));
  ym.noalias() = xm * wm.transpose();
}
