// The AVX-512 kernel tables built on emulated intrinsics, linked into test
// programs by cmake/attnkit_avx512_emulation.cmake, which then defines
// ATTNKIT_TEST_AVX512_EMULATION. They run anywhere (slowly); tests pass
// them as cpu::Plan::kernels or to kernels::set_kernels_for_testing().
#pragma once

#include "kernels/cpu/kernel_table.h"

#if defined(ATTNKIT_TEST_AVX512_EMULATION)
namespace attnkit::kernels::cpu {
const KernelTable* emulated_avx512_kernel_table();      // SimdTarget::kAvx512
const KernelTable* emulated_avx512bf16_kernel_table();  // SimdTarget::kAvx512Bf16
}  // namespace attnkit::kernels::cpu
#endif
