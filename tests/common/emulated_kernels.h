// The AVX-512 kernel tables built on emulated intrinsics, linked into test
// programs by cmake/attnkit_avx512_emulation.cmake, which then defines
// ATTNKIT_TEST_AVX512_EMULATION, and the list of targets a test or fuzzer
// runs with them. They run anywhere (slowly); tests pass them as
// cpu::Plan::kernels or to kernels::set_kernels_for_testing().
#pragma once

#include <vector>

#include "core/cpu_features.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/kernel_table.h"

namespace attnkit::kernels {

#if defined(ATTNKIT_TEST_AVX512_EMULATION)
namespace cpu {
const KernelTable* emulated_avx512_kernel_table();      // SimdTarget::kAvx512
const KernelTable* emulated_avx512bf16_kernel_table();  // SimdTarget::kAvx512Bf16
}  // namespace cpu
#endif

// A target to run, on its own kernels (kernels == nullptr) or on an
// emulated table.
struct TestedTarget {
  SimdTarget target;
  const cpu::KernelTable* kernels;

  void apply(cpu::Plan& plan) const {
    plan.target = target;
    plan.kernels = kernels;
  }
};

// The targets this CPU has, then the AVX-512 ones it lacks, emulated, where
// the program links them: so that their kernels are checked on every
// machine.
inline std::vector<TestedTarget> tested_targets() {
  std::vector<TestedTarget> out;
  for (SimdTarget t : kAllSimdTargets)
    if (simd_target_available(t)) out.push_back({t, nullptr});
#if defined(ATTNKIT_TEST_AVX512_EMULATION)
  if (!simd_target_available(SimdTarget::kAvx512))
    out.push_back({SimdTarget::kAvx512, cpu::emulated_avx512_kernel_table()});
  if (!simd_target_available(SimdTarget::kAvx512Bf16))
    out.push_back({SimdTarget::kAvx512Bf16, cpu::emulated_avx512bf16_kernel_table()});
#endif
  return out;
}

}  // namespace attnkit::kernels
