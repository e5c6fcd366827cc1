// The bf16 stream GEMM's driver (linear_bf16.h): the target's kernel, x
// prepared once on the calling thread, column blocks on the pool.
#include "kernels/linear_bf16.h"

#include <algorithm>

#include "core/threads.h"
#include "kernels/scratch.h"

namespace attnkit::kernels {

const Bf16StreamKernel* bf16_stream_kernel(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar:
      return nullptr;
    case SimdTarget::kAvx2:
#if defined(ATTNKIT_HAVE_AVX2)
      return &bf16_stream::kAvx2;
#else
      return nullptr;
#endif
    case SimdTarget::kAvx512:
#if defined(ATTNKIT_HAVE_AVX512)
      return &bf16_stream::kAvx512;
#else
      return nullptr;
#endif
    case SimdTarget::kAvx512Bf16:
#if defined(ATTNKIT_HAVE_AVX512)
      return &bf16_stream::kAvx512Bf16;
#else
      return nullptr;
#endif
  }
  return nullptr;
}

const Bf16StreamKernel* bf16_stream_planned_kernel() {
  if (simd_target() == SimdTarget::kAvx512Bf16)
    if (const Bf16StreamKernel* amx = bf16_stream_amx_kernel()) return amx;
  return bf16_stream_kernel(simd_target());
}

namespace {

// Column blocks: about 128 columns each (a decode step's 1024-14336
// columns make 8-112 blocks, so two to eight threads end within a block of
// each other), at most kMaxBlocks; one block below kMinSplitMacs
// multiply-adds, where waking the pool costs more than it saves. The bits
// do not depend on the blocks (linear_bf16.h), only the speed does.
constexpr int64_t kBlockCols = 128;
constexpr int64_t kMaxBlocks = 64;
constexpr double kMinSplitMacs = 1 << 20;

}  // namespace

bool linear_bf16_stream(const Bf16StreamKernel& kernel, const float* x, int64_t ldx, const bf16* w,
                        const float* bias, float* y, int64_t ldy, int64_t rows,
                        int64_t out_features, int64_t in_features, int num_threads) {
  if (rows <= 0 || out_features <= 0) return true;
  // xp starts on a cache line (operator new[] gives 16 bytes): the
  // kernels' 32- and 64-byte x loads then split no line where in_features
  // is a multiple of 16.
  thread_local Scratch<float> scratch;
  if (!scratch.grow(static_cast<size_t>(kernel.xp_floats(rows, in_features)) + 15)) return false;
  const uintptr_t at = reinterpret_cast<uintptr_t>(scratch.get());
  float* const xp = scratch.get() + ((64 - at % 64) % 64) / sizeof(float);
  kernel.prepare_x(x, ldx, rows, in_features, xp);
  const double macs = static_cast<double>(rows) * static_cast<double>(out_features) * in_features;
  const int64_t blocks =
      macs < kMinSplitMacs ? 1 : std::clamp<int64_t>(out_features / kBlockCols, 1, kMaxBlocks);
  const int64_t align = kernel.col_align;
  const int64_t size = ((out_features + blocks - 1) / blocks + align - 1) / align * align;
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
  // The tasks reach parallel_for through a closure holding one reference,
  // which std::function stores without allocating.
  const auto body = [&](int64_t task) {
    const int64_t c0 = task * size, cols = std::min(size, out_features - c0);
    if (cols > 0)
      kernel.run(xp, rows, in_features, wb + c0 * in_features, cols, bias ? bias + c0 : nullptr,
                 y + c0, ldy);
  };
  parallel_for((out_features + size - 1) / size, num_threads,
               [&body](int64_t task, int) { body(task); });
  return true;
}

}  // namespace attnkit::kernels
