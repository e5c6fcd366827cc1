// The gated delta rule's kernels held equal: the fast recurrent and chunked
// forms against the reference twin (recurrent, double) and against each
// other, on seeded random inputs with q, k and v interleaved in one row per
// token (the public layout), across chunk edges (63, 64, 65
// tokens), value widths below, at and above the recurrent column blocks,
// grouped value heads, key heads split across the chunked form's tasks,
// decays from none to total, thread counts (which must not change a
// bit) and head-major rows (the layer's layout).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/gated_delta_rows.h"
#include "common/random.h"
#include "core/cpu_features.h"

namespace attnkit::kernels {
namespace {

using attnkit_test::Rng;

struct Case {
  int64_t batch, seq, hk, hv, dk, dv;
  float g_lo, g_hi;  // log-decays drawn uniformly in [g_lo, g_hi]
};

using Problem = attnkit_test::GdrInputs;

// q | k | v rows of uniform values, q and k normalised as the layer does.
Problem make_problem(const Case& c, uint64_t seed) {
  Rng rng(seed);
  Problem p;
  p.batch = c.batch;
  p.seq = c.seq;
  p.hk = c.hk;
  p.hv = c.hv;
  p.dk = c.dk;
  p.dv = c.dv;
  p.width = 2 * c.hk * c.dk + c.hv * c.dv;
  const int64_t T = c.batch * c.seq;
  p.rows = attnkit_test::uniform_vector(T * p.width, rng);
  attnkit_test::normalise_qk(p);
  p.g = attnkit_test::uniform_vector(T * c.hv, rng, c.g_lo, c.g_hi);
  p.beta = attnkit_test::uniform_vector(T * c.hv, rng, 0.0f, 1.0f);
  p.state0 = attnkit_test::uniform_vector(c.batch * c.hv * c.dk * c.dv, rng, -0.5f, 0.5f);
  return p;
}

// Runs one form; returns out [T, hv * dv] followed by the final state.
std::vector<float> run(const Problem& pr, Backend backend, GdrForm form, int threads) {
  std::vector<float> out;
  EXPECT_TRUE(attnkit_test::run_gdr(pr, backend, form, threads, -9.0f, &out).ok());
  return out;
}

std::string name(const Case& c) {
  return "batch " + std::to_string(c.batch) + " seq " + std::to_string(c.seq) + " heads " +
         std::to_string(c.hk) + "/" + std::to_string(c.hv) + " dims " + std::to_string(c.dk) + "/" +
         std::to_string(c.dv) + " g in [" + std::to_string(c.g_lo) + ", " + std::to_string(c.g_hi) +
         "]";
}

// max |got - want| <= 1e-4 * max |want| over outputs and state together:
// f32 sums of dk or 64 terms round at ~1e-6 of that scale; the bound is the
// layer's target.
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0, worst = -1;
  size_t at = 0;
  for (float v : want) scale = std::max(scale, std::fabs(double{v}));
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(double{got[i]} - want[i]);
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  EXPECT_LE(worst, 1e-4 * scale) << what << ": element " << at << " got " << got[at] << " want "
                                 << want[at] << " bound " << 1e-4 * scale;
}

TEST(GatedDeltaRule, FastFormsMatchReference) {
  const Case cases[] = {
      {1, 1, 1, 1, 16, 16, -0.5f, 0.0f},
      {2, 2, 2, 4, 16, 24, -0.5f, 0.0f},
      {1, 63, 2, 4, 32, 8, -0.3f, 0.0f},
      {1, 64, 1, 2, 16, 40, -0.3f, 0.0f},
      {2, 65, 2, 2, 24, 16, -0.3f, 0.0f},
      {1, 200, 2, 4, 32, 32, -0.2f, 0.0f},
      {1, 130, 1, 1, 16, 16, 0.0f, 0.0f},       // no decay at all
      {1, 100, 1, 2, 16, 16, -1000.0f, -5.0f},  // near-total forgetting
      {1, 70, 1, 2, 128, 128, -0.1f, 0.0f},     // Qwen3-Next's head dims
      // Recurrent column groups of 8, 4, 2 and 1 blocks of 16 and a tail.
      {1, 5, 1, 2, 16, 88, -0.3f, 0.0f},
      {2, 3, 2, 2, 16, 152, -0.3f, 0.0f},
      // The chunked form's tiles: several value heads per key head (their
      // key-only products shared), value widths with a column tail and
      // several column panels, row tiles with rows left over, 1 token.
      {1, 129, 2, 8, 20, 40, -0.3f, 0.0f},
      {1, 127, 3, 6, 48, 130, -0.2f, 0.0f},
      {3, 1, 1, 3, 8, 17, -0.3f, 0.0f},
      {2, 66, 1, 4, 7, 5, -2.0f, 0.0f},
      // Chunked tasks of several key heads, chunk by chunk (at most half
      // the key heads, ceil, and 512 KiB of states: 4 key heads' of 128 x
      // 128 with 2 value heads each): 5 key heads split 3 + 2, 7 at 128 x
      // 128 split 4 + 3, the last chunk short.
      {2, 70, 5, 10, 16, 16, -0.3f, 0.0f},
      {1, 70, 7, 14, 128, 128, -0.1f, 0.0f},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const Problem pr = make_problem(c, seed++);
    const std::vector<float> want = run(pr, Backend::kReference, GdrForm::kAuto, 1);
    const std::vector<float> rec = run(pr, Backend::kFast, GdrForm::kRecurrent, 1);
    const std::vector<float> chk = run(pr, Backend::kFast, GdrForm::kChunked, 1);
    expect_close(rec, want, "recurrent, " + name(c));
    expect_close(chk, want, "chunked, " + name(c));
    expect_close(chk, rec, "chunked vs recurrent, " + name(c));
    // Any thread count, the same bits.
    EXPECT_EQ(run(pr, Backend::kFast, GdrForm::kRecurrent, 2), rec) << name(c);
    EXPECT_EQ(run(pr, Backend::kFast, GdrForm::kChunked, 3), chk) << name(c);
  }
}

TEST(GatedDeltaRule, EverySimdTargetMatches) {
  // The forms are compiled per target with function attributes; targets
  // with FMA contract multiply-adds, so each target this CPU runs is held
  // to the scalar build within the kernels' bound, not to its bits.
  const SimdTarget active = simd_target();
  const Case cases[] = {{2, 3, 2, 4, 16, 40, -0.5f, 0.0f},
                        {1, 150, 1, 2, 32, 24, -0.3f, 0.0f},
                        {1, 4, 1, 1, 16, 248, -0.3f, 0.0f},
                        {1, 131, 2, 6, 24, 72, -0.3f, 0.0f}};
  uint64_t seed = 40;
  for (const Case& c : cases) {
    const Problem pr = make_problem(c, seed++);
    ASSERT_TRUE(set_simd_target(SimdTarget::kScalar));
    const std::vector<float> rec = run(pr, Backend::kFast, GdrForm::kRecurrent, 2);
    const std::vector<float> chk = run(pr, Backend::kFast, GdrForm::kChunked, 2);
    for (SimdTarget t : kAllSimdTargets) {
      if (!set_simd_target(t)) continue;
      expect_close(run(pr, Backend::kFast, GdrForm::kRecurrent, 2), rec,
                   std::string(simd_target_name(t)) + " recurrent, " + name(c));
      expect_close(run(pr, Backend::kFast, GdrForm::kChunked, 2), chk,
                   std::string(simd_target_name(t)) + " chunked, " + name(c));
    }
  }
  set_simd_target(active);
}

TEST(GatedDeltaRule, LongSequenceStaysExact) {
  // 2000 tokens: 32 chunks of state passing, slow decay.
  const Case c{1, 2000, 1, 2, 32, 32, -0.05f, 0.0f};
  const Problem pr = make_problem(c, 77);
  const std::vector<float> want = run(pr, Backend::kReference, GdrForm::kAuto, 1);
  expect_close(run(pr, Backend::kFast, GdrForm::kChunked, 2), want, "chunked, " + name(c));
  expect_close(run(pr, Backend::kFast, GdrForm::kRecurrent, 2), want, "recurrent, " + name(c));
}

TEST(GatedDeltaRule, HeadMajorRowsMatch) {
  // q, k and v head-major (a head's rows one run, the layer's layout, with
  // a gap after each head's rows) against the reference on token-major
  // rows; the fast forms' sums do not depend on where a row lies, so each
  // gives the token-major layout's bits.
  const Case cases[] = {{2, 65, 2, 4, 16, 24, -0.3f, 0.0f},
                        {1, 130, 2, 2, 32, 40, -0.2f, 0.0f},
                        {3, 5, 1, 3, 8, 17, -0.3f, 0.0f},
                        {1, 70, 5, 10, 16, 16, -0.3f, 0.0f}};
  uint64_t seed = 60;
  for (const Case& c : cases) {
    const Problem pr = make_problem(c, seed++);
    const std::vector<float> want = run(pr, Backend::kReference, GdrForm::kAuto, 1);
    for (int64_t gap : {0, 5}) {
      const std::string what = name(c) + ", head gap " + std::to_string(gap);
      std::vector<float> got;
      ASSERT_TRUE(
          attnkit_test::run_gdr(pr, Backend::kReference, GdrForm::kAuto, 1, -9.0f, &got, gap).ok());
      expect_close(got, want, "reference, " + what);
      for (GdrForm form : {GdrForm::kRecurrent, GdrForm::kChunked}) {
        ASSERT_TRUE(attnkit_test::run_gdr(pr, Backend::kFast, form, 2, -9.0f, &got, gap).ok());
        expect_close(got, want, what);
        EXPECT_EQ(got, run(pr, Backend::kFast, form, 2)) << what;
      }
    }
  }
}

TEST(GatedDeltaRule, NonFiniteTokenLeavesEarlierTokensAlone) {
  // A NaN or infinite value in token 37's k, v or q reaches tokens 37 and
  // later only: every output before it is finite and what the reference
  // gives (the chunked form's tiles never multiply an earlier row by a
  // later one, not even by 0). Token 37 sits inside a row tile (rows 36-39).
  const Case c{1, 70, 1, 2, 16, 24, -0.3f, 0.0f};
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -3e38f};
  const int64_t t = 37, width = 2 * c.hk * c.dk + c.hv * c.dv;
  for (int64_t at : {int64_t{0}, c.dk, 2 * c.dk + 5}) {  // q, k, v
    for (float bad : specials) {
      Problem pr = make_problem(c, 91);
      pr.rows[t * width + at] = bad;
      const std::string what = "column " + std::to_string(at) + " = " + std::to_string(bad);
      const std::vector<float> want = run(pr, Backend::kReference, GdrForm::kAuto, 1);
      const std::vector<float> before(want.begin(), want.begin() + t * c.hv * c.dv);
      for (GdrForm form : {GdrForm::kChunked, GdrForm::kRecurrent}) {
        const std::vector<float> got = run(pr, Backend::kFast, form, 1);
        const std::vector<float> head(got.begin(), got.begin() + t * c.hv * c.dv);
        for (float v : head) ASSERT_TRUE(std::isfinite(v)) << what;
        expect_close(head, before, what);
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::kernels
