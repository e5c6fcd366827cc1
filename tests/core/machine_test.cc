#include "attnkit/machine.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/best_run.h"

namespace attnkit {
namespace {

// A probe that replays given run times.
struct Replay {
  std::vector<double> times;
  size_t next = 0;
  double operator()() { return times.at(next++); }
};

TEST(BestRun, StopsOnceTheFastestRunIsMatched) {
  // The first run is slowed by a busy machine; the next two agree within 5 %.
  Replay r{{2.0, 1.0, 1.03, 9.0}};
  const BestRun b = best_until_stable(r, 2, 10, 0.05);
  EXPECT_EQ(b.runs, 3);
  EXPECT_TRUE(b.stable);
  EXPECT_DOUBLE_EQ(b.seconds, 1.0);
}

TEST(BestRun, KeepsTheBestAndSaysWhenItNeverSettles) {
  // Every run differs from the others by more than 5 %: the probe runs to
  // its limit, keeps the fastest and reports that it did not settle.
  Replay r{{1.0, 1.5, 2.0, 0.8, 1.2}};
  const BestRun b = best_until_stable(r, 2, 5, 0.05);
  EXPECT_EQ(b.runs, 5);
  EXPECT_FALSE(b.stable);
  EXPECT_DOUBLE_EQ(b.seconds, 0.8);
}

TEST(BestRun, RunsAtLeastTheMinimum) {
  // Stable after two runs, but four were asked for.
  Replay r{{1.0, 1.0, 1.0, 1.0}};
  const BestRun b = best_until_stable(r, 4, 10, 0.05);
  EXPECT_EQ(b.runs, 4);
  EXPECT_TRUE(b.stable);
}

MachineProfile profile(double peak, double bf16, double bw) {
  MachineProfile p;
  p.simd = "avx512";
  p.fp32_peak_gflops = peak;
  p.bf16_dot_peak_gflops = bf16;
  p.dram_read_gbps = bw;
  p.stable = true;
  return p;
}

TEST(MachineCheck, AgreeingProfilesKeepTheBestOfEach) {
  const MachineCheck c =
      compare_machine_profiles(profile(230, 460, 20.0), profile(220, 470, 21.0), 0.15);
  EXPECT_TRUE(c.agree);
  EXPECT_TRUE(c.disagreement.empty());
  EXPECT_EQ(c.best.fp32_peak_gflops, 230);
  EXPECT_EQ(c.best.bf16_dot_peak_gflops, 470);
  EXPECT_EQ(c.best.dram_read_gbps, 21.0);
}

TEST(MachineCheck, APeakMeasuredUnderLoadIsNamed) {
  // The case behind the check: a peak measured at half while the machine
  // was busy, then at its usual value after the run.
  const MachineCheck c =
      compare_machine_profiles(profile(114, 460, 20.0), profile(231, 462, 19.5), 0.15);
  EXPECT_FALSE(c.agree);
  EXPECT_EQ(c.disagreement, "fp32 peak 114 then 231 GFLOP/s");
  EXPECT_EQ(c.best.fp32_peak_gflops, 231);
  const MachineCheck both =
      compare_machine_profiles(profile(114, 460, 30.0), profile(231, 462, 19.5), 0.15);
  EXPECT_EQ(both.disagreement,
            "fp32 peak 114 then 231 GFLOP/s; read bandwidth 30.0 then 19.5 GB/s");
}

TEST(MachineCheck, AMachineWithoutBf16DotAgreesOnIt) {
  EXPECT_TRUE(compare_machine_profiles(profile(100, 0, 10), profile(100, 0, 10)).agree);
}

TEST(MachineProfile, MeasuredFiguresArePositive) {
  const MachineProfile p = measure_machine(1, /*quick=*/true);
  EXPECT_GT(p.fp32_peak_gflops, 0);
  EXPECT_GT(p.dram_read_gbps, 0);
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.bf16_dot_peak_gflops > 0, p.has_avx512_bf16);
}

}  // namespace
}  // namespace attnkit
