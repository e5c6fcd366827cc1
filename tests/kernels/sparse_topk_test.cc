// The fast indexer's top-k (kernels/sparse.h, select_topk_scores: a radix
// select on the scores' bits, its first histogram made by itself or given
// in parts) against a selection written here: a stable
// sort by score, highest first (so equal scores keep the lower index
// first), the first k, sorted by index. Seeded random scores with many
// ties, -inf, NaN (which counts as -inf), -0 and +0 (equal), subnormals,
// and every relation of topk to the visible count; scores long enough
// that the candidates' pass splits into stretches, on 1-4 threads and on
// every SIMD target (the AVX-512 pass and the scalar one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/random.h"
#include "core/cpu_features.h"
#include "kernels/sparse.h"

namespace attnkit::kernels {
namespace {

using attnkit_test::Rng;

std::vector<int32_t> expected_topk(const std::vector<float>& score, int64_t topk) {
  const auto value = [&](int32_t i) {
    const float x = score[static_cast<size_t>(i)];
    return std::isnan(x) ? -std::numeric_limits<double>::infinity() : static_cast<double>(x);
  };
  std::vector<int32_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return value(a) > value(b); });
  order.resize(std::min(order.size(), static_cast<size_t>(topk)));
  std::sort(order.begin(), order.end());
  order.resize(static_cast<size_t>(topk), -1);
  return order;
}

// Scores drawn from a few kinds: a small set of repeated values (ties,
// across the radix digits' bins and inside them), wide magnitudes,
// neighbours one ulp apart, the special values.
std::vector<float> random_scores(int64_t n, Rng& rng) {
  const float specials[] = {-std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            0.0f,
                            -0.0f,
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity()};
  std::vector<float> repeated(8);
  for (float& r : repeated) r = rng.uniform(-2.0f, 2.0f);
  std::vector<float> s(static_cast<size_t>(n));
  for (float& x : s) {
    switch (rng.integer(0, 4)) {
      case 0:
        x = repeated[static_cast<size_t>(rng.integer(0, 7))];
        break;
      case 1:
        x = std::ldexp(rng.uniform(-1.0f, 1.0f), static_cast<int>(rng.integer(-140, 100)));
        break;
      case 2:
        x = std::nextafter(1.0f, rng.coin() ? 2.0f : 0.0f);
        break;
      case 3:
        x = specials[rng.integer(0, 7)];
        break;
      default:
        x = rng.uniform(-1.0f, 1.0f);
    }
  }
  return s;
}

// On every SIMD target this CPU has (the histogram's and the candidates'
// passes have an AVX-512 form and a scalar one), on 1 and 3 threads.
TEST(SelectTopkScores, MatchesAStableSortOnRandomScoresWithTiesAndSpecialValues) {
  const SimdTarget saved = simd_target();
  for (SimdTarget target : kAllSimdTargets) {
    if (!set_simd_target(target)) continue;
    Rng rng(2026);
    for (int trial = 0; trial < 300; ++trial) {
      const int64_t n = trial < 20 ? trial : rng.integer(1, trial < 250 ? 3000 : 70000);
      const int64_t topk = rng.integer(0, 3) == 0 ? n + rng.integer(0, 3) : rng.integer(0, n);
      const std::vector<float> s = random_scores(n, rng);
      const int threads = trial % 2 ? 3 : 1;
      std::vector<int32_t> scratch(static_cast<size_t>(2 * std::max<int64_t>(n, 1)));
      std::vector<uint32_t> worker_hist(static_cast<size_t>(threads * kTopkWorkerHistogram));
      // The first histogram made by the select itself, or given: gathered
      // in two sets over two stretches of the scores, as two threads would.
      const int64_t split = rng.integer(0, n);
      std::vector<uint32_t> hist(size_t(2 * kTopkHistogram), 0u);
      add_topk_histogram(s.data(), split, hist.data());
      add_topk_histogram(s.data() + split, n - split, hist.data() + kTopkHistogram);
      const std::vector<int32_t> want = expected_topk(s, topk);
      for (const uint32_t* given :
           {static_cast<const uint32_t*>(nullptr), static_cast<const uint32_t*>(hist.data())}) {
        // A strided output, as the indices tensor may be.
        std::vector<int32_t> out(static_cast<size_t>(2 * topk + 1), 77);
        select_topk_scores(s.data(), n, topk, given, 2, threads, worker_hist.data(), scratch.data(),
                           out.data(), 2);
        std::vector<int32_t> got(static_cast<size_t>(topk));
        for (int64_t i = 0; i < topk; ++i)
          got[static_cast<size_t>(i)] = out[static_cast<size_t>(2 * i)];
        ASSERT_EQ(got, want) << "trial " << trial << " n " << n << " topk " << topk << " given "
                             << (given != nullptr) << " target " << simd_target_name(target);
        for (int64_t i = 0; i < topk; ++i) ASSERT_EQ(out[static_cast<size_t>(2 * i + 1)], 77);
      }
    }
  }
  set_simd_target(saved);
}

TEST(SelectTopkScores, AllEqualScoresGoToTheLowestIndices) {
  for (const float v : {0.0f, -0.0f, 3.5f, -std::numeric_limits<float>::infinity()}) {
    std::vector<float> s(5000, v);
    s[100] = -0.0f * v;  // -0 next to +0 (and +-0 among others): equal when v is 0
    std::vector<int32_t> scratch(2 * s.size()), out(7);
    std::vector<uint32_t> worker_hist(kTopkWorkerHistogram);
    select_topk_scores(s.data(), 5000, 7, nullptr, 0, 1, worker_hist.data(), scratch.data(),
                       out.data(), 1);
    EXPECT_EQ(out, expected_topk(s, 7)) << v;
  }
}

// Long runs of equal scores (one value chosen in part) across the
// boundaries of the stretches the candidates' pass splits the scores into
// (16,384 scores and more on the scalar target, 32,768 and more on
// AVX-512; the pass writes each stretch's candidates to its own part of
// the scratch): the choice must still be the lowest indices of the tied
// value, in index order, for every thread count. Each case is checked on
// every SIMD target this CPU has, so that both forms of the pass run.
TEST(SelectTopkScores, TiesAcrossStretchesKeepTheLowestIndicesOnAnyThreadCount) {
  Rng rng(35);
  const SimdTarget saved = simd_target();
  struct Case {
    int64_t n, topk;
  };
  // Lengths around the scalar stretches (16,384 up to 64 of them) and the
  // AVX-512 ones (32,768), including one past 64 stretches of the least.
  for (const Case c : {Case{70000, 2048}, Case{70000, 40000}, Case{16384 * 3 + 17, 5000},
                       Case{600000, 2048}, Case{600000, 300001}, Case{1100000, 2048}}) {
    // Three tied values; the middle one straddles every boundary, and
    // topk falls inside it: scores above it are fewer than topk, with it
    // more. A few distinct higher values are scattered anywhere.
    std::vector<float> s(static_cast<size_t>(c.n));
    for (int64_t i = 0; i < c.n; ++i) s[static_cast<size_t>(i)] = rng.coin() ? 1.5f : -2.0f;
    const int64_t above = c.topk / 3;
    for (int64_t j = 0; j < above; ++j) s[static_cast<size_t>(rng.integer(0, c.n - 1))] = 7.0f;
    for (int64_t i = 0; i < c.n; ++i)
      if (s[static_cast<size_t>(i)] == 1.5f && rng.integer(0, 9) == 0)
        s[static_cast<size_t>(i)] = -0.0f;
    const std::vector<int32_t> want = expected_topk(s, c.topk);
    std::vector<uint32_t> hist(size_t(kTopkHistogram), 0u);
    add_topk_histogram(s.data(), c.n, hist.data());
    for (SimdTarget target : kAllSimdTargets) {
      if (!set_simd_target(target)) continue;
      for (int threads = 1; threads <= 4; ++threads) {
        std::vector<int32_t> scratch(static_cast<size_t>(2 * c.n), 5),
            out(static_cast<size_t>(c.topk), 77);
        std::vector<uint32_t> worker_hist(static_cast<size_t>(threads * kTopkWorkerHistogram));
        select_topk_scores(s.data(), c.n, c.topk, hist.data(), 1, threads, worker_hist.data(),
                           scratch.data(), out.data(), 1);
        ASSERT_EQ(out, want) << "n " << c.n << " topk " << c.topk << " target "
                             << simd_target_name(target) << " threads " << threads;
      }
    }
    set_simd_target(saved);
  }
  set_simd_target(saved);
}

}  // namespace
}  // namespace attnkit::kernels
