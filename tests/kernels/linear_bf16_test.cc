// The bf16 stream GEMM (kernels/linear_bf16.h) on every SIMD target this
// build has and this CPU runs, and on AMX tiles where it has them, against
// a float64 loop written here, on seeded random inputs: every row count
// 1-32 and a few more (past 64, where the AMX kernel reads W in several
// passes), odd column counts and depths (below, at and past each target's
// chunk of 16 or 32 weights), padded and misaligned x and y, bias or none,
// 1-3 threads; the same bits for any thread count and any grouping of the
// rows into calls; NaN and Inf in W or x where the reference loop has
// them; and the plan that kernels::linear follows.
//
// Bound, per element, as tests/kernels/linear_test.cc derives it: the
// products bf16(x) w are exact in fp32, so any fp32 evaluation of the sum
// in any order (vdpbf16ps's and the tiles' included) is within
//   gamma(K + 1) * (sum_k |bf16(x[m, k]) w[n, k]| + |bias[n]|)
// of the exact value; a kernel that skipped x's rounding would be off by
// up to 2^-9 sum |x w|, hundreds of times more.
#include "kernels/linear_bf16.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/machine.h"
#include "common/random.h"
#include "core/cpu_features.h"
#include "kernels/linear.h"

namespace attnkit::kernels {
namespace {

constexpr double kU = 0x1p-24;
constexpr float kSentinel = -5555.5f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// The stream kernels this CPU runs: the SIMD targets' and AMX's.
std::vector<const Bf16StreamKernel*> stream_kernels() {
  std::vector<const Bf16StreamKernel*> out;
  for (SimdTarget t : kAllSimdTargets)
    if (bf16_stream_kernel(t) != nullptr && simd_target_available(t))
      out.push_back(bf16_stream_kernel(t));
  if (bf16_stream_amx_kernel() != nullptr) out.push_back(bf16_stream_amx_kernel());
  return out;
}

struct Case {
  int64_t rows, out, in;
  int64_t x_pad = 0, y_pad = 0, offset = 0;
  bool bias = false;
  uint64_t seed = 1;
  std::string describe() const {
    std::ostringstream s;
    s << "rows=" << rows << " out=" << out << " in=" << in << " x_pad=" << x_pad
      << " y_pad=" << y_pad << " offset=" << offset << " bias=" << bias << " seed=" << seed;
    return s.str();
  }
};

struct Data {
  Case c;
  int64_t ldx, ldy;
  std::vector<float> xbuf, b, ybuf;
  std::vector<bf16> w;
  explicit Data(const Case& cs) : c(cs), ldx(cs.in + cs.x_pad), ldy(cs.out + cs.y_pad) {
    attnkit_test::Rng rng(cs.seed);
    xbuf = attnkit_test::uniform_vector(static_cast<size_t>(c.offset + c.rows * ldx), rng);
    b = attnkit_test::uniform_vector(static_cast<size_t>(c.out), rng);
    for (int64_t i = 0; i < c.out * c.in; ++i) w.push_back(float_to_bf16(rng.uniform()));
    reset_y();
  }
  const float* x() const { return xbuf.data() + c.offset; }
  float* y() { return ybuf.data() + c.offset; }
  const float* bias() const { return c.bias ? b.data() : nullptr; }
  void reset_y() {
    ybuf.assign(static_cast<size_t>(c.offset + c.rows * ldy), kSentinel);
    for (int64_t m = 0; m < c.rows; ++m)
      for (int64_t n = 0; n < c.out; ++n) y()[m * ldy + n] = kNaN;
  }
  bool run(const Bf16StreamKernel& k, int threads) {
    return linear_bf16_stream(k, x(), ldx, w.data(), bias(), y(), ldy, c.rows, c.out, c.in,
                              threads);
  }
};

// y against the float64 loop and the bound; nothing written outside y.
::testing::AssertionResult check(Data& d, const std::string& what) {
  const Case& c = d.c;
  for (int64_t m = 0; m < c.rows; ++m)
    for (int64_t n = 0; n < c.out; ++n) {
      double exact = c.bias ? d.b[n] : 0.0, magnitude = c.bias ? std::fabs(d.b[n]) : 0.0;
      for (int64_t k = 0; k < c.in; ++k) {
        const double p = static_cast<double>(attnkit_test::round_bf16(d.x()[m * d.ldx + k])) *
                         bf16_to_float(d.w[n * c.in + k]);
        exact += p;
        magnitude += std::fabs(p);
      }
      const double nu = static_cast<double>(c.in + 1) * kU;
      const double bound = nu / (1.0 - nu) * magnitude;
      const double got = d.y()[m * d.ldy + n];
      if (!(std::fabs(got - exact) <= bound))
        return ::testing::AssertionFailure()
               << what << " (" << c.describe() << "): y[" << m << ", " << n << "] = " << got
               << ", exact " << exact << ", bound " << bound;
    }
  for (size_t i = 0; i < d.ybuf.size(); ++i) {
    const int64_t j = static_cast<int64_t>(i) - c.offset;
    const bool inside = j >= 0 && j / d.ldy < c.rows && j % d.ldy < c.out;
    if (!inside && d.ybuf[i] != kSentinel)
      return ::testing::AssertionFailure()
             << what << " (" << c.describe() << "): wrote outside y at " << i;
  }
  return ::testing::AssertionSuccess();
}

std::vector<Case> cases() {
  std::vector<Case> out;
  uint64_t seed = 5000;
  attnkit_test::Rng pick(91);
  // Every row count of a decode batch, odd widths and depths around the
  // chunks (16 and 32 weights) and the tiles (3, 4 and 8 columns).
  for (int64_t rows = 1; rows <= 32; ++rows)
    out.push_back({rows, pick.integer(1, 41), pick.integer(1, 100), pick.coin() ? 5 : 0,
                   pick.coin() ? 3 : 0, pick.integer(0, 1), pick.coin(), seed++});
  for (int64_t in : {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255})
    for (int64_t out_f : {1, 3, 4, 7, 8, 9})
      out.push_back({pick.integer(1, 9), out_f, in, 0, 0, 0, in % 2 == 1, seed++});
  // Long rows, wide outputs (many column blocks), more rows than a decode.
  for (const Case& c : {Case{1, 1031, 4099, 0, 0, 0, true}, Case{5, 517, 2048, 7, 1, 1, false},
                        Case{32, 300, 1000, 0, 2, 0, true}, Case{40, 97, 130, 3, 0, 1, true},
                        Case{3, 64, 16384, 0, 0, 0, false},
                        // Past 64 rows the AMX kernel takes W's 16 rows in
                        // several passes (4 + 3 and 4 + 4 + 1 blocks of 16).
                        Case{100, 33, 64, 0, 1, 0, true}, Case{131, 50, 70, 2, 0, 1, false}}) {
    out.push_back(c);
    out.back().seed = seed++;
  }
  return out;
}

TEST(LinearBf16Stream, EveryTargetMatchesTheFloat64Loop) {
  const std::vector<const Bf16StreamKernel*> kernels = stream_kernels();
  if (kernels.empty()) GTEST_SKIP() << "no stream kernel runs on this CPU";
  for (const Bf16StreamKernel* kp : kernels) {
    const Bf16StreamKernel& k = *kp;
    for (const Case& c : cases()) {
      Data d(c);
      for (int threads : {1, 2, 3}) {
        d.reset_y();
        ASSERT_TRUE(d.run(k, threads));
        EXPECT_TRUE(check(d, std::string(k.name) + " at " + std::to_string(threads) + " threads"));
      }
    }
  }
}

// Each y[m, n] is one fixed sequence of operations: the same bits for any
// thread count, and for a row computed alone or among others.
TEST(LinearBf16Stream, ThreadsAndRowGroupsChangeNoBits) {
  for (const Bf16StreamKernel* kp : stream_kernels()) {
    const Bf16StreamKernel& k = *kp;
    for (const Case& c :
         {Case{32, 389, 1000, 0, 1, 0, true, 11}, Case{7, 1500, 333, 4, 0, 1, false, 12}}) {
      Data d(c);
      ASSERT_TRUE(d.run(k, 1));
      const std::vector<float> one = d.ybuf;
      d.reset_y();
      ASSERT_TRUE(d.run(k, 3));
      EXPECT_EQ(0, std::memcmp(one.data(), d.ybuf.data(), one.size() * sizeof(float)))
          << k.name << " " << c.describe() << " at 3 threads";
      for (int64_t group : {1, 3, 5}) {
        d.reset_y();
        for (int64_t r0 = 0; r0 < c.rows; r0 += group)
          ASSERT_TRUE(linear_bf16_stream(k, d.x() + r0 * d.ldx, d.ldx, d.w.data(), d.bias(),
                                         d.y() + r0 * d.ldy, d.ldy, std::min(group, c.rows - r0),
                                         c.out, c.in, 2));
        EXPECT_EQ(0, std::memcmp(one.data(), d.ybuf.data(), one.size() * sizeof(float)))
            << k.name << " " << c.describe() << " in groups of " << group;
      }
    }
  }
}

// NaN and Inf in W (and NaN in x) give NaN, +Inf, -Inf or a finite value
// exactly where the reference loop does: whether a sum is NaN or infinite
// does not depend on its order unless it overflows, which these values
// cannot.
TEST(LinearBf16Stream, NanAndInfPropagateAsTheReference) {
  const auto kind = [](float v) { return std::isnan(v) ? 0 : std::isinf(v) ? (v > 0 ? 1 : 2) : 3; };
  for (const Bf16StreamKernel* kp : stream_kernels()) {
    const Bf16StreamKernel& k = *kp;
    for (const Case& c : {Case{9, 70, 97, 0, 0, 0, true, 21}, Case{1, 40, 64, 0, 0, 0, false, 22},
                          Case{17, 33, 300, 2, 1, 0, false, 23}}) {
      Data d(c);
      attnkit_test::Rng rng(c.seed + 100);
      for (int i = 0; i < 12; ++i) {
        const size_t at = static_cast<size_t>(rng.integer(0, c.out * c.in - 1));
        const float v = i % 3 == 0 ? kNaN : (i % 3 == 1 ? kInf : -kInf);
        d.w[at] = float_to_bf16(v);
      }
      d.xbuf[static_cast<size_t>(c.offset + rng.integer(0, c.in - 1))] = kNaN;  // row 0
      ASSERT_TRUE(d.run(k, 2));
      std::vector<float> ref(static_cast<size_t>(c.rows * d.ldy), kSentinel);
      linear_ref(d.x(), d.ldx, Weight{d.w.data(), DType::kBF16}, d.bias(), ref.data(), d.ldy,
                 c.rows, c.out, c.in);
      int specials = 0;
      for (int64_t m = 0; m < c.rows; ++m)
        for (int64_t n = 0; n < c.out; ++n) {
          const float got = d.y()[m * d.ldy + n], want = ref[m * d.ldy + n];
          specials += kind(want) != 3;
          EXPECT_EQ(kind(want), kind(got)) << k.name << " " << c.describe() << " y[" << m << ", "
                                           << n << "] = " << got << ", reference " << want;
        }
      EXPECT_GT(specials, 0) << c.describe();
    }
  }
}

// Zero rows of W give exactly the bias (or +0), and magnitudes near the
// top of fp32's range (products up to 2^120, sums below its maximum) meet
// the same bound: no step of a kernel (widening, vdpbf16ps, the tiles)
// scales or overflows on its own.
TEST(LinearBf16Stream, ZeroAndLargeInputs) {
  for (const Bf16StreamKernel* kp : stream_kernels()) {
    const Bf16StreamKernel& k = *kp;
    for (const Case& c : {Case{16, 31, 200, 0, 0, 0, true, 41}, Case{5, 7, 33, 1, 0, 0, false, 42},
                          Case{32, 12, 64, 0, 2, 0, true, 43}}) {
      Data d(c);
      for (int64_t i = 0; i < c.out * c.in; ++i)
        d.w[i] = float_to_bf16(bf16_to_float(d.w[i]) * 0x1p60f);
      for (float& v : d.xbuf) v *= 0x1p60f;
      for (int64_t k2 = 0; k2 < c.in; ++k2) d.w[2 * c.in + k2] = float_to_bf16(0.0f);  // W row 2
      ASSERT_TRUE(d.run(k, 2));
      EXPECT_TRUE(check(d, std::string(k.name) + ", large"));
      for (int64_t m = 0; m < c.rows; ++m) {
        const float want = c.bias ? d.b[2] : 0.0f;
        EXPECT_EQ(want, d.y()[m * d.ldy + 2]) << k.name << " " << c.describe() << " row " << m;
      }
    }
  }
}

// Two normal products that cancel to below FLT_MIN: the exact sum is
// 2^-128, a subnormal. The vector kernels keep it; the tiles flush their
// running sums to zero (TDPBF16PS does), so any kernel may return 0 or the
// exact value and nothing else. The fuzzer's bound allows 2^-126 per step.
TEST(LinearBf16Stream, SumsBelowFltMinAreExactOrFlushed) {
  const float x[2] = {1.0f, 1.0f};
  const bf16 w[2] = {float_to_bf16(0x1p-122f + 0x1p-128f), float_to_bf16(-0x1p-122f)};
  const float exact = 0x1p-128f;
  ASSERT_EQ(static_cast<double>(bf16_to_float(w[0])) + bf16_to_float(w[1]), exact);
  for (const Bf16StreamKernel* k : stream_kernels()) {
    float y = kSentinel;
    ASSERT_TRUE(linear_bf16_stream(*k, x, 2, w, nullptr, &y, 1, 1, 1, 2, 1));
    EXPECT_TRUE(y == exact || y == 0.0f) << k->name << ": " << y;
  }
}

// kernels::linear runs the planned stream kernel for calls of up
// to bf16_stream_max_rows() rows (the same bits), oneDNN above; the
// forced choices both meet the bound; the names say which runs.
TEST(LinearBf16Stream, LinearFollowsThePlan) {
  const int64_t max_rows = bf16_stream_max_rows();
  const Bf16StreamKernel* active = bf16_stream_planned_kernel();
  const std::string name = linear_backend_name(DType::kBF16);
  std::printf("bf16 weights: %s\n", name.c_str());
  EXPECT_EQ(max_rows > 0, name.find("attnkit bf16 stream") != std::string::npos) << name;
  const std::string f32 = linear_backend_name(DType::kF32);
  // f32 weights are never said to be widened or streamed (the ISA's name
  // may hold "bf16": avx512_core_bf16).
  EXPECT_EQ(f32.find("widened"), std::string::npos) << f32;
  EXPECT_EQ(f32.find("stream"), std::string::npos) << f32;
  EXPECT_EQ(gemm_backend_name(DType::kBF16), name);
  EXPECT_EQ(gemm_backend_name(DType::kF32), f32);
  if (max_rows > 0) {
    EXPECT_FALSE(linear_rows_independent(Backend::kFast, DType::kBF16));
  }
  using Choice = LinearOptions::Bf16Gemm;
  for (const Case& c :
       {Case{1, 600, 700, 0, 0, 0, true, 31}, Case{4, 300, 257, 1, 2, 1, false, 32},
        Case{32, 129, 300, 0, 0, 0, true, 33}, Case{70, 65, 80, 0, 0, 0, true, 34}}) {
    Data d(c);
    for (Choice choice : {Choice::kPlan, Choice::kStream, Choice::kOneDnn}) {
      d.reset_y();
      linear(d.x(), d.ldx, Weight{d.w.data(), DType::kBF16}, d.bias(), d.y(), d.ldy, c.rows, c.out,
             c.in, {.num_threads = 2, .backend = Backend::kFast, .bf16_gemm = choice});
      EXPECT_TRUE(check(d, "linear, choice " + std::to_string(static_cast<int>(choice))));
    }
    if (active == nullptr || c.rows > max_rows) continue;
    d.reset_y();
    linear(d.x(), d.ldx, Weight{d.w.data(), DType::kBF16}, d.bias(), d.y(), d.ldy, c.rows, c.out,
           c.in, {.num_threads = 2, .backend = Backend::kFast});
    const std::vector<float> planned = d.ybuf;
    d.reset_y();
    ASSERT_TRUE(d.run(*active, 1));
    EXPECT_EQ(0, std::memcmp(planned.data(), d.ybuf.data(), planned.size() * sizeof(float)))
        << c.describe();
  }
}

}  // namespace
}  // namespace attnkit::kernels
