#include "core/cpu_features.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace attnkit {
namespace {

#if defined(__x86_64__) || defined(__i386__)
// XCR0: which register state the OS saves on a context switch. AVX needs
// SSE+YMM (bits 1, 2); AVX-512 also needs opmask, ZMM_Hi256, Hi16_ZMM
// (bits 5, 6, 7). A CPU flag without OS support still faults.
uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, f16c = (c >> 29) & 1;
  if (!osxsave) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6, os_zmm = (xcr0 & 0xe6) == 0xe6;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1,
             avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1, avx512_vnni = (c >> 11) & 1;
  __cpuid_count(7, 1, a, b, c, d);
  const bool avx512_bf16 = (a >> 5) & 1;
  f.avx2 = os_ymm && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_zmm && avx512f && avx512dq && avx512bw && avx512vl;
  f.avx512_bf16 = f.avx512 && avx512_bf16 && avx512_vnni;
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

// The targets this build compiled: cmake/attnkit_simd.cmake defines
// ATTNKIT_HAVE_AVX2 / ATTNKIT_HAVE_AVX512 when the compiler took the flags.
bool compiled(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar:
      return true;
    case SimdTarget::kAvx2:
#if defined(ATTNKIT_HAVE_AVX2)
      return true;
#else
      return false;
#endif
    case SimdTarget::kAvx512:
    case SimdTarget::kAvx512Bf16:
#if defined(ATTNKIT_HAVE_AVX512)
      return true;
#else
      return false;
#endif
  }
  return false;
}

SimdTarget initial_target() {
  SimdTarget best = SimdTarget::kScalar;
  for (SimdTarget t : kAllSimdTargets)
    if (simd_target_available(t)) best = t;
  if (const char* env = std::getenv("ATTNKIT_SIMD")) {
    const std::optional<SimdTarget> wanted = parse_simd_target(env);
    if (wanted && *wanted < best) best = *wanted;
  }
  return best;
}

std::atomic<SimdTarget>& active() {
  static std::atomic<SimdTarget> target{initial_target()};
  return target;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

SimdTarget best_simd_target(const CpuFeatures& f) {
  if (f.avx512_bf16) return SimdTarget::kAvx512Bf16;
  if (f.avx512) return SimdTarget::kAvx512;
  if (f.avx2) return SimdTarget::kAvx2;
  return SimdTarget::kScalar;
}

const char* simd_target_name(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar:
      return "scalar";
    case SimdTarget::kAvx2:
      return "avx2";
    case SimdTarget::kAvx512:
      return "avx512";
    case SimdTarget::kAvx512Bf16:
      return "avx512bf16";
  }
  return "unknown";
}

std::optional<SimdTarget> parse_simd_target(std::string_view name) {
  for (SimdTarget t : kAllSimdTargets)
    if (name == simd_target_name(t)) return t;
  return std::nullopt;
}

bool simd_target_available(SimdTarget target) {
  return compiled(target) && target <= best_simd_target(cpu_features());
}

SimdTarget simd_target() { return active().load(std::memory_order_relaxed); }

bool set_simd_target(SimdTarget target) {
  if (!simd_target_available(target)) return false;
  active().store(target, std::memory_order_relaxed);
  return true;
}

}  // namespace attnkit
