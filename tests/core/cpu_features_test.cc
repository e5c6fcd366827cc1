#include "core/cpu_features.h"

#include <gtest/gtest.h>

namespace attnkit {
namespace {

TEST(CpuFeatures, NamesRoundTrip) {
  for (SimdTarget t : kAllSimdTargets) {
    const auto parsed = parse_simd_target(simd_target_name(t));
    ASSERT_TRUE(parsed.has_value()) << simd_target_name(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_FALSE(parse_simd_target("avx512f").has_value());
  EXPECT_FALSE(parse_simd_target("").has_value());
}

TEST(CpuFeatures, BestTargetFollowsTheLadder) {
  CpuFeatures f;
  EXPECT_EQ(best_simd_target(f), SimdTarget::kScalar);
  f.avx2 = true;
  EXPECT_EQ(best_simd_target(f), SimdTarget::kAvx2);
  f.avx512 = true;
  EXPECT_EQ(best_simd_target(f), SimdTarget::kAvx512);
  f.avx512_bf16 = true;
  EXPECT_EQ(best_simd_target(f), SimdTarget::kAvx512Bf16);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Cross-check cpuid decoding against the compiler's own detection (which
// does not look at OS support, but Linux enables AVX-512 state wherever the
// CPU has it).
TEST(CpuFeatures, AgreesWithCompilerDetection) {
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.avx2, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  EXPECT_EQ(f.avx512, f.avx2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"));
}
#endif

TEST(CpuFeatures, SetTargetAcceptsOnlyAvailableTargets) {
  const SimdTarget before = simd_target();
  EXPECT_TRUE(simd_target_available(SimdTarget::kScalar));
  EXPECT_TRUE(simd_target_available(before));
  for (SimdTarget t : kAllSimdTargets) {
    const bool available = simd_target_available(t);
    EXPECT_TRUE(!available || t <= best_simd_target(cpu_features())) << simd_target_name(t);
    EXPECT_EQ(set_simd_target(t), available) << simd_target_name(t);
    EXPECT_EQ(simd_target(), available ? t : SimdTarget::kScalar) << simd_target_name(t);
    set_simd_target(SimdTarget::kScalar);
  }
  EXPECT_TRUE(set_simd_target(before));
  EXPECT_EQ(simd_target(), before);
}

}  // namespace
}  // namespace attnkit
