// Dense projections for the layers, in nn.Linear's convention:
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
//   x [rows, in_features] row stride ldx; w [out_features, in_features]
//   contiguous; y [rows, out_features] row stride ldy; bias [out_features]
//   or null. y must not overlap x, w or bias; ldy >= out_features when
//   rows > 1.
// Every layer calls this one function, so the GEMM behind it is chosen
// here only (docs/GEMM.md has the measurements behind the choice).
//
// Backends (`backend`; kAuto follows ATTNKIT_BACKEND, see dispatch.h):
//   kAuto, kFast  oneDNN's matmul primitive (Debian's libdnnl), JIT-compiled
//                 for the CPU it runs on (AVX-512, AVX2, ...) whatever the
//                 environment says to other BLAS libraries
//                 (OPENBLAS_CORETYPE). The result does not depend on the
//                 thread count. Where linear_rows_independent() (oneDNN's
//                 brgemm, AVX-512), each y[m, n] is one fp32 chain of fused
//                 multiply-adds over k, so a row of y depends only on its
//                 row of x and on W, not on `rows` or the blocking (unless
//                 gemv_for_one_row, below); elsewhere (AVX2) a row's last
//                 bits may depend on the other rows of the call. Each
//                 thread keeps scratch buffers for oneDNN that grow to its
//                 largest call.
//                 Falls back to dnnl_sgemm, then to the loop, for a block
//                 oneDNN refuses (out of memory), and to the loop for
//                 overlapping input rows (ldx < in_features), which BLAS
//                 does not take.
//   kReference    linear_ref: the plain loop, eight fp32 partial sums.
// Both write every element of y [rows, out_features] and nothing else.
//
// Threads: `options.num_threads` >= 1 is used as given, 0 means the default
// (core/threads.h: ATTNKIT_NUM_THREADS, else all cores). The default of 1
// suits callers that already run in parallel (the MoE experts' shards).
// The work is cut into row or column blocks that depend only on the shape
// and run on attnkit's own pool, oneDNN single-threaded inside each block,
// so no second thread pool (OpenMP's) competes for the cores.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"

namespace attnkit::kernels {

struct LinearOptions {
  int num_threads = 1;
  Backend backend = Backend::kAuto;
  // Runs a one-row call (decode) through oneDNN's GEMV (dnnl_sgemm), which
  // streams W ~1.5x faster than the matmul kernels (docs/GEMM.md), but
  // sums in another order: the row's last bits then differ from the same
  // row computed among others. Leave false where results must not depend
  // on how rows are grouped into calls (the MoE layer shards its tokens
  // by thread count where linear_rows_independent()).
  bool gemv_for_one_row = false;
};

// Whether a row of linear()'s result depends only on its row of x and on W
// (not on the other rows of the call) with this backend on this machine:
// always for kReference; for kFast where oneDNN runs its brgemm kernels
// (AVX-512), not where it falls back to its jit sgemm (AVX2). Decided once
// per process, from the implementation oneDNN picks for a small block.
bool linear_rows_independent(Backend backend);

void linear(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features,
            const LinearOptions& options = {});

// The reference twin: the loop, single-threaded; same contract.
void linear_ref(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features);

// y = x W with W stored [in_features, out_features] (row stride ldw >=
// out_features), i.e. the weight un-transposed: MLA's absorbed queries
// W_UK_h^T q use row blocks of kv_b_proj this way without copying them.
//   x [rows, in_features] row stride ldx; y [rows, out_features] row stride
//   ldy, not overlapping x or W.
// On the calling thread only (callers run many of these in parallel, one
// per head): kAuto/kFast through dnnl_sgemm, single-threaded, falling back
// to the loop if oneDNN refuses; kReference the loop (fp32 axpys over the
// rows of W, so each sum runs in k order).
void linear_nn(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
               int64_t rows, int64_t out_features, int64_t in_features, Backend backend);

// The GEMM behind the fast backend, oneDNN's implementation and the ISA it
// runs, for reports, e.g. "oneDNN 2.6.3 matmul brg:avx512_core
// (avx512_core_bf16)". Not affected by ATTNKIT_BACKEND.
const char* linear_backend_name();

// RMSNorm over the last dimension, in double:
//   y = x / sqrt(mean(x^2) + eps) * gain
// x and y are [rows, dim] with row strides; y may equal x (in place).
void rms_norm(const float* x, int64_t ldx, const float* gain, float* y, int64_t ldy, int64_t rows,
              int64_t dim, double eps);

}  // namespace attnkit::kernels
