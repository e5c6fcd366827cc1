// The bf16-weight GEMM for few rows (decode): W [out, in] bf16 streamed
// from memory once per call and widened in registers, x rounded to bf16
// once, fp32 accumulation. kernels::linear runs it for bf16 weights where
// its plan says so (linear.cc, bf16_stream_max_rows); tests call it
// directly, per SIMD target.
//
// Why: a decode step is a read of the weights. bf16 weights are half the
// bytes of f32 ones, so the step should take about half the time; oneDNN
// 2.6 gets that only where it has a bf16 kernel (avx512_core_bf16, AMX).
// Elsewhere (AVX2: AMD Zen 3 and older, Intel client CPUs) it widens each
// call's W into an f32 copy first, and bf16 weights were slower than f32
// ones (docs/GEMM.md, "bf16 weights on every CPU").
//
// Contract (kernels::linear's for bf16 weights):
//   y[m, n] = sum_k bf16(x[m, k]) * w[n, k] (+ bias[n])
// each product exact in fp32, fp32 sums. Each y[m, n] is one fixed
// sequence of operations that depends on the target, k and the two rows
// only: not on `rows`, the column blocks or the thread count, so within
// this kernel a row's bits do not depend on the rows beside it.
#pragma once

#include <cstdint>

#include "attnkit/tensor.h"
#include "core/cpu_features.h"

namespace attnkit::kernels {

// One stream kernel: a SIMD target's, or the AMX tiles'.
struct Bf16StreamKernel {
  // "avx2", "avx512" (widening), "avx512bf16" (vdpbf16ps), "amx" (tiles)
  const char* name;
  // xp (xp_floats(rows, depth) floats): x rounded to bf16 and laid out as
  // `run` reads it (the layout is the kernel's: even/odd lanes of each
  // vector-pair chunk, packed bf16 in the first half of each row, or AMX B
  // tiles of bf16 pairs).
  //   x [rows, depth] row stride ldx
  void (*prepare_x)(const float* x, int64_t ldx, int64_t rows, int64_t depth, float* xp);
  // y[m, n] for m < rows, n < cols, from prepare_x's xp.
  //   w [cols, depth] bf16 bits, contiguous; bias [cols] or null;
  //   y [rows, cols] row stride ldy
  void (*run)(const float* xp, int64_t rows, int64_t depth, const uint16_t* w, int64_t cols,
              const float* bias, float* y, int64_t ldy);
  int64_t (*xp_floats)(int64_t rows, int64_t depth);
  // Column blocks on the pool start at multiples of this (the AMX kernel
  // works on blocks of 16 columns of W, and copies a partial one through
  // its edge path); the bits do not depend on it.
  int64_t col_align;
};

// rows * depth: the SIMD targets' xp_floats.
inline int64_t bf16_stream_xp_dense(int64_t rows, int64_t depth) { return rows * depth; }

namespace bf16_stream {
// Defined in the targets' translation units (linear_bf16_avx2.cc,
// linear_bf16_avx512.cc, linear_bf16_amx.cc) where the compiler builds them.
extern const Bf16StreamKernel kAvx2, kAvx512, kAvx512Bf16, kAmx;
}  // namespace bf16_stream

// The kernel for `target`, or nullptr where this build has none (scalar,
// or a target the compiler could not build). The caller checks that the
// CPU runs the target (simd_target_available).
const Bf16StreamKernel* bf16_stream_kernel(SimdTarget target);

// The AMX tile kernel, or nullptr where this build or this process has no
// AMX (amx_bf16_available(): the CPU, the OS's permission, and
// set_amx_allowed).
const Bf16StreamKernel* bf16_stream_amx_kernel();

// The kernel kernels::linear's plan runs: AMX tiles where this process has
// them and the SIMD target is the CPU's own (ATTNKIT_SIMD below it stands
// in for a CPU without AMX), else the active target's; nullptr if none.
const Bf16StreamKernel* bf16_stream_planned_kernel();

// The whole call: x prepared on the calling thread (per-thread scratch that
// grows only on a larger call), then column blocks on the pool. false
// (nothing written) if the scratch cannot be had.
//   x [rows, in] row stride ldx (>= in unless rows == 1); w [out, in];
//   bias [out] or null; y [rows, out] row stride ldy
bool linear_bf16_stream(const Bf16StreamKernel& kernel, const float* x, int64_t ldx, const bf16* w,
                        const float* bias, float* y, int64_t ldy, int64_t rows,
                        int64_t out_features, int64_t in_features, int num_threads);

}  // namespace attnkit::kernels
