// Which SIMD instruction sets this CPU and OS support, and which one the
// fast kernels use.
//
// Targets form a ladder; each one needs everything below it:
//   kScalar      portable C++ (whatever the compiler's baseline allows)
//   kAvx2        AVX2 + FMA + F16C (fp8 K/V decode through binary16), 8 fp32
//                lanes
//   kAvx512      AVX-512 F/BW/VL/DQ, 16 fp32 lanes; bf16 K/V are widened to
//                fp32 exactly
//   kAvx512Bf16  kAvx512 plus AVX512_BF16 and AVX512_VNNI (every CPU with
//                the first has the second): bf16 K/V use vdpbf16ps, which
//                rounds q and the softmax weights to bf16 (as every bf16
//                attention kernel does) and accumulates in fp32; int8 K/V
//                use vpdpwssd
// The active target is the best one detected, chosen once per process. The
// environment variable ATTNKIT_SIMD=avx512bf16|avx512|avx2|scalar lowers it
// (a target above the detected best is ignored), and set_simd_target()
// changes it in-process so that tests can run every compiled target.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace attnkit {

enum class SimdTarget : uint8_t { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

inline constexpr SimdTarget kAllSimdTargets[] = {SimdTarget::kScalar, SimdTarget::kAvx2,
                                                 SimdTarget::kAvx512, SimdTarget::kAvx512Bf16};

struct CpuFeatures {
  bool avx2 = false;         // with FMA, F16C and OS-enabled YMM state
  bool avx512 = false;       // F, BW, VL, DQ and OS-enabled ZMM/opmask state
  bool avx512_bf16 = false;  // with AVX512_VNNI
  // An AMD CPU: there vdpbf16ps multiplies twice the pairs an fp32 FMA does
  // per cycle (kernels/cpu/tile_policy.h, dequantizes_to_bf16).
  bool amd = false;
};

// Detected with cpuid/xgetbv once per process; all false off x86.
const CpuFeatures& cpu_features();

// The best target `features` allows.
SimdTarget best_simd_target(const CpuFeatures& features);

// "scalar", "avx2", "avx512", "avx512bf16".
const char* simd_target_name(SimdTarget target);
std::optional<SimdTarget> parse_simd_target(std::string_view name);

// True when this build compiled kernels for `target` and the CPU runs them.
bool simd_target_available(SimdTarget target);

// The target the kernels use now.
SimdTarget simd_target();

// Makes `target` the active one; false (and no change) when it is not
// available. Affects calls that start afterwards, in every thread.
bool set_simd_target(SimdTarget target);

}  // namespace attnkit
