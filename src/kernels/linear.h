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
//                 thread keeps scratch buffers that grow only when a
//                 call larger than its earlier ones comes, and oneDNN
//                 memory objects made once per block shape and re-pointed
//                 at each call's buffers, so a call of a shape and size
//                 this thread has run before allocates nothing in
//                 attnkit (tests/kernels/linear_alloc_test.cc); oneDNN
//                 2.6 still copies each block's arguments into a map of
//                 its own when it runs it.
//                 Falls back to dnnl_sgemm, then to the loop, for a block
//                 oneDNN refuses (out of memory), and to the loop for
//                 overlapping input rows (ldx < in_features), which BLAS
//                 does not take.
//   kReference    linear_ref: the plain loop, eight fp32 partial sums.
// Both write every element of y [rows, out_features] and nothing else.
//
// bf16 weights (Weight::dtype kBF16, as bf16 checkpoints ship them) are
// used as they are, never widened into a kept f32 copy: half the memory,
// and half the bytes a decode step streams. The product is then a bf16
// GEMM with fp32 accumulation, as bf16 hardware computes it: x is rounded
// to bf16 (nearest even) first, so
//   y[m, n] = sum_k bf16(x[m, k]) * w[n, k] (+ bias[n]),
// each product of two bf16 values is exact in fp32 and the sums are fp32:
// the f32 bound holds for the rounded x (inputs and products below fp32's
// normal range may be flushed to zero, as AVX512_BF16's dot product does).
// kFast runs calls of up to bf16_stream_max_rows() rows (decode) through
// attnkit's stream GEMM (kernels/linear_bf16.h: W read once, widened in
// registers, or vdpbf16ps), and longer ones through oneDNN's bf16 matmul
// (bf16 x and W, f32 bias and y) where oneDNN has a kernel for it (AMX
// tiles, avx512_core_bf16's vdpbf16ps, or AVX-512 emulation); elsewhere
// (AVX2) oneDNN's f32 kernels on each block's W widened to f32 in
// per-thread scratch and the rounded x. The row limit depends on what
// oneDNN has here (linear.cc has the measured reasons).
// bf16 calls never take the one-row GEMV (gemv_for_one_row is ignored).
//
// Threads: `options.num_threads` >= 1 is used as given, 0 means the default
// (core/threads.h: ATTNKIT_NUM_THREADS, else all cores). The default of 1
// suits callers that already run in parallel (the MoE experts' shards).
// The work is cut into row or column blocks that depend only on the shape
// and run on attnkit's own pool, oneDNN single-threaded inside each block,
// so no second thread pool (OpenMP's) competes for the cores.
#pragma once

#include <cstdint>
#include <string>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"

namespace attnkit::kernels {

// A weight matrix [out_features, in_features], contiguous, in the dtype a
// layer keeps it: kF32 or kBF16.
struct Weight {
  const void* data = nullptr;
  DType dtype = DType::kF32;

  // The matrix from element `offset` on (a block of rows: row r starts at
  // r * in_features), e.g. one head's rows of MLA's kv_b_proj.
  Weight at(int64_t offset) const {
    return {static_cast<const char*>(data) + offset * static_cast<int64_t>(dtype_size(dtype)),
            dtype};
  }
};

// A layer's weight Tensor (f32 or bf16) as a Weight.
inline Weight weight_of(const Tensor& t) { return {t.data(), t.dtype()}; }

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
  // Which GEMM runs bf16 weights with kFast/kAuto: the plan's choice
  // (bf16_gemm_for), or one forced, for benchmarks and tests.
  enum class Bf16Gemm : uint8_t { kPlan, kStream, kOneDnn };
  Bf16Gemm bf16_gemm = Bf16Gemm::kPlan;
};

// Whether a row of linear()'s result depends only on its row of x and on W
// (not on the other rows of the call) with this backend and weight dtype on
// this machine: always for kReference; for kFast where oneDNN runs the same
// brgemm kernel for every block shape (f32 on AVX-512; bf16 on
// avx512_core_bf16 without AMX, or where W is widened, the f32 brgemm);
// not where it falls back to its jit sgemm (AVX2), nor for bf16 on AMX
// CPUs, where oneDNN runs AMX tiles on large blocks and avx512_core_bf16
// on small ones. Decided once per process, from the implementations oneDNN
// picks for a one-row and a large block.
bool linear_rows_independent(Backend backend, DType weight_dtype = DType::kF32);

void linear(const float* x, int64_t ldx, Weight w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features,
            const LinearOptions& options = {});
inline void linear(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                   int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                   const LinearOptions& options = {}) {
  linear(x, ldx, Weight{w, DType::kF32}, bias, y, ldy, rows, out_features, in_features, options);
}

// The reference twin: the loop, single-threaded; same contract (bf16
// weights: x rounded to bf16, exact products, fp32 partial sums).
void linear_ref(const float* x, int64_t ldx, Weight w, const float* bias, float* y, int64_t ldy,
                int64_t rows, int64_t out_features, int64_t in_features);
inline void linear_ref(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                       int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features) {
  linear_ref(x, ldx, Weight{w, DType::kF32}, bias, y, ldy, rows, out_features, in_features);
}

// y = x W with W stored [in_features, out_features] (row stride ldw >=
// out_features), i.e. the weight un-transposed: MLA's absorbed queries
// W_UK_h^T q use row blocks of kv_b_proj this way without copying them.
//   x [rows, in_features] row stride ldx; y [rows, out_features] row stride
//   ldy, not overlapping x or W.
// On the calling thread only (callers run many of these in parallel, one
// per head): kAuto/kFast through dnnl_sgemm, single-threaded (bf16 W, with
// x rounded to bf16 as linear's contract: oneDNN's bf16 matmul on W in
// place, or dnnl_sgemm on W widened where oneDNN has no bf16 kernel),
// falling back to the loop if oneDNN refuses; kReference the loop (fp32
// axpys over the rows of W, so each sum runs in k order).
void linear_nn(const float* x, int64_t ldx, Weight w, int64_t ldw, float* y, int64_t ldy,
               int64_t rows, int64_t out_features, int64_t in_features, Backend backend);
inline void linear_nn(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                      int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features,
                      Backend backend) {
  linear_nn(x, ldx, Weight{w, DType::kF32}, ldw, y, ldy, rows, out_features, in_features, backend);
}

// The most rows for which bf16 weights run the stream GEMM
// (kernels/linear_bf16.h) rather than oneDNN on this CPU with the active
// SIMD target; 0 where they never do. The measured reasons are beside the
// thresholds in linear.cc.
int64_t bf16_stream_max_rows();

// What runs a fast call's projections with weights kept in `weight_dtype`
// on this CPU now (the active SIMD target), for reports: f32 weights e.g.
// "oneDNN 2.6.3 matmul brg:avx512_core (avx512_core_amx)"; bf16 weights
// e.g. "attnkit bf16 stream (avx2) for 1-64 rows, above: oneDNN 2.6.3
// matmul gemm:jit (avx2) on W widened to f32".
std::string linear_backend_name(DType weight_dtype);

// The GEMM behind the fast backend, oneDNN's implementation and the ISA it
// runs, and what runs bf16 weights, for reports, e.g. "oneDNN 2.6.3 matmul
// brg:avx512_core (avx512_core_amx), bf16 weights
// brg:avx512_core_amx_bf16". Not affected by ATTNKIT_BACKEND.
const char* linear_backend_name();

// RMSNorm over the last dimension, in double:
//   y = x / sqrt(mean(x^2) + eps) * gain
// x and y are [rows, dim] with row strides; y may equal x (in place).
void rms_norm(const float* x, int64_t ldx, const float* gain, float* y, int64_t ldy, int64_t rows,
              int64_t dim, double eps);

}  // namespace attnkit::kernels
