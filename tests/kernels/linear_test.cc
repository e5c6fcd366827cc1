// kernels::linear (oneDNN behind the pool) and its loop twin against a
// float64 loop written here, on seeded random inputs: edge sizes (1, odd,
// around the block grid, large K), padded row strides, misaligned
// pointers, bias or none, 1-7 threads, concurrent callers, and bit-exact
// results across thread counts and row groupings.
//
// Bound, per element (Higham, Accuracy and Stability, 3.1): any fp32
// evaluation of a K-term dot product, in any order, with or without FMA,
// and one more add for the bias, is within
//   gamma(K + 1) * (sum_k |x[m, k] w[n, k]| + |bias[n]|),
//   gamma(n) = n u / (1 - n u), u = 2^-24,
// of the exact value, so a correct kernel can never exceed it, and a wrong
// index or a lost term exceeds it by orders of magnitude.
//
// bf16 weights: the contract rounds x to bf16 before the product, and every
// product of two bf16 values is exact in fp32, so the same bound holds
// around sum_k bf16(x[m, k]) w[n, k]. A kernel that skipped the rounding
// would be off by up to 2^-9 sum_k |x w|, hundreds of times the bound.
#include "kernels/linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/machine.h"
#include "common/random.h"

namespace attnkit::kernels {
namespace {

constexpr double kU = 0x1p-24;  // fp32 unit roundoff
constexpr float kSentinel = -7777.25f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  int64_t rows = 1, out = 1, in = 1;
  int64_t x_pad = 0, y_pad = 0;  // extra elements per row beyond in / out
  int64_t offset = 0;            // misaligns x and y by this many floats
  bool bias = false;
  uint64_t seed = 1;
  DType weight = DType::kF32;  // or kBF16

  std::string describe() const {
    std::ostringstream s;
    s << "rows=" << rows << " out=" << out << " in=" << in << " x_pad=" << x_pad
      << " y_pad=" << y_pad << " offset=" << offset << " bias=" << bias << " seed=" << seed
      << " weight=" << dtype_name(weight);
    return s.str();
  }
};

// Inputs for one case; y's rows are padded with the sentinel, and the
// elements linear must write start as NaN (beta 0 must not read them).
struct Data {
  Case c;
  int64_t ldx, ldy;
  std::vector<float> xbuf, w, b, ybuf;  // w: the weights' values (bf16's, widened)
  std::vector<bf16> wb;                 // the weights as bf16, for kBF16
  std::vector<double> xused;            // xbuf as the product sees it (rounded for kBF16)
  const float* x() const { return xbuf.data() + c.offset; }
  float* y() { return ybuf.data() + c.offset; }
  const float* bias() const { return c.bias ? b.data() : nullptr; }
  Weight weight() const {
    return c.weight == DType::kBF16 ? Weight{wb.data(), DType::kBF16} : Weight{w.data()};
  }
  // x[i] as the product sees it: rounded to bf16 for bf16 weights.
  double x_used(int64_t i) const { return xused[static_cast<size_t>(c.offset + i)]; }

  explicit Data(const Case& cs) : c(cs), ldx(cs.in + cs.x_pad), ldy(cs.out + cs.y_pad) {
    attnkit_test::Rng rng(cs.seed);
    xbuf = attnkit_test::uniform_vector(static_cast<size_t>(c.offset + c.rows * ldx), rng);
    w = attnkit_test::uniform_vector(static_cast<size_t>(c.out * c.in), rng);
    b = attnkit_test::uniform_vector(static_cast<size_t>(c.out), rng);
    if (c.weight == DType::kBF16)
      for (float& v : w) {
        wb.push_back(float_to_bf16(v));
        v = bf16_to_float(wb.back());
      }
    for (float v : xbuf)
      xused.push_back(c.weight == DType::kBF16 ? attnkit_test::round_bf16(v) : v);
    reset_y();
  }
  void reset_y() {
    ybuf.assign(static_cast<size_t>(c.offset + c.rows * ldy), kSentinel);
    for (int64_t m = 0; m < c.rows; ++m)
      for (int64_t n = 0; n < c.out; ++n) y()[m * ldy + n] = kNaN;
  }
};

// Checks y against the float64 loop and the bound above, and that nothing
// outside y's [rows, out] elements was written.
::testing::AssertionResult check(Data& d, const std::string& what) {
  const Case& c = d.c;
  double worst = -1.0;
  std::ostringstream worst_msg;
  for (int64_t m = 0; m < c.rows; ++m) {
    for (int64_t n = 0; n < c.out; ++n) {
      double exact = 0.0, magnitude = 0.0;
      for (int64_t k = 0; k < c.in; ++k) {
        const double p = d.x_used(m * d.ldx + k) * d.w[n * c.in + k];
        exact += p;
        magnitude += std::fabs(p);
      }
      if (c.bias) {
        exact += d.b[n];
        magnitude += std::fabs(d.b[n]);
      }
      const double nu = static_cast<double>(c.in + 1) * kU;
      const double bound = nu / (1.0 - nu) * magnitude;
      const double got = d.y()[m * d.ldy + n];
      const double err = std::isnan(got) ? HUGE_VAL : std::fabs(got - exact);
      const double ratio = bound > 0.0 ? err / bound : (err > 0.0 ? HUGE_VAL : 0.0);
      if (ratio > worst) {
        worst = ratio;
        worst_msg.str("");
        worst_msg.precision(9);
        worst_msg << "y[" << m << ", " << n << "] = " << got << ", exact " << exact << ", |diff| "
                  << err << ", bound " << bound;
      }
    }
  }
  if (worst > 1.0)
    return ::testing::AssertionFailure()
           << what << " (" << c.describe() << "): worst " << worst_msg.str();
  for (size_t i = 0; i < d.ybuf.size(); ++i) {
    const int64_t j = static_cast<int64_t>(i) - c.offset;
    const bool inside = j >= 0 && j / d.ldy < c.rows && j % d.ldy < c.out;
    if (!inside && d.ybuf[i] != kSentinel)
      return ::testing::AssertionFailure()
             << what << " (" << c.describe() << "): wrote outside y at buffer index " << i;
  }
  return ::testing::AssertionSuccess();
}

void run(Data& d, int threads, Backend backend, bool gemv = false) {
  linear(d.x(), d.ldx, d.weight(), d.bias(), d.y(), d.ldy, d.c.rows, d.c.out, d.c.in,
         {.num_threads = threads, .backend = backend, .gemv_for_one_row = gemv});
}

// Both backends (and the fast one's GEMV for one row) at 1, 2 and 3 threads.
void check_case(const Case& c) {
  Data d(c);
  struct Variant {
    Backend backend;
    bool gemv;
    const char* name;
  };
  for (const Variant v :
       {Variant{Backend::kFast, false, "fast"}, Variant{Backend::kFast, true, "fast+gemv"},
        Variant{Backend::kReference, false, "reference"}}) {
    if (v.gemv && c.rows != 1) continue;
    for (int threads : {1, 2, 3}) {
      d.reset_y();
      run(d, threads, v.backend, v.gemv);
      EXPECT_TRUE(check(d, std::string(v.name) + " at " + std::to_string(threads) + " threads"));
    }
  }
}

TEST(Linear, EdgeSizes) {
  uint64_t seed = 1;
  for (int64_t rows : {1, 2, 3, 7})
    for (int64_t out : {1, 3, 16, 17, 65})
      for (int64_t in : {1, 2, 7, 8, 9, 33})
        for (bool bias : {false, true}) check_case({rows, out, in, 0, 0, 0, bias, seed++});
}

TEST(Linear, StridesAndMisalignedPointers) {
  uint64_t seed = 100;
  for (int64_t rows : {1, 2, 5, 40})
    for (int64_t x_pad : {0, 1, 13})
      for (int64_t y_pad : {0, 3})
        for (int64_t offset : {0, 1})
          check_case({rows, 37, 29, x_pad, y_pad, offset, true, seed++});
}

// Shapes the block grid splits: by columns (one row, and short inputs),
// by rows (long inputs), with ragged last blocks, and a long reduction.
TEST(Linear, AcrossTheBlockGrid) {
  const Case cases[] = {
      {1, 4099, 1031, 0, 0, 0, true, 201},   // one row: column blocks, GEMV
      {1, 2048, 2048, 5, 7, 1, false, 202},  // one row, strided and misaligned
      {16, 2051, 256, 0, 0, 0, true, 203},   // short: column blocks, ragged last
      {13, 1000, 517, 3, 5, 0, false, 204},  // short, strided: packed x, dense y copies
      {600, 300, 67, 0, 0, 0, true, 205},    // long: row blocks, ragged last
      {517, 129, 96, 11, 3, 1, false, 206},  // long, strided
      {3, 64, 16384, 0, 0, 0, true, 207},    // large K
      {255, 257, 128, 0, 1, 0, true, 208},   // just below the row split
      {512, 64, 200, 0, 0, 0, false, 209},   // exactly two row blocks
  };
  for (const Case& c : cases) check_case(c);
}

TEST(Linear, RandomShapes) {
  attnkit_test::Rng pick(77);
  for (int i = 0; i < 60; ++i) {
    Case c;
    c.rows = pick.integer(1, pick.coin(0.3) ? 700 : 20);
    c.out = pick.integer(1, pick.coin(0.3) ? 1500 : 90);
    c.in = pick.integer(1, pick.coin(0.2) ? 3000 : 150);
    c.x_pad = pick.coin() ? pick.integer(1, 9) : 0;
    c.y_pad = pick.coin() ? pick.integer(1, 9) : 0;
    c.offset = pick.integer(0, 1);
    c.bias = pick.coin();
    c.seed = 1000 + static_cast<uint64_t>(i);
    Data d(c);
    for (Backend backend : {Backend::kFast, Backend::kReference}) {
      d.reset_y();
      const bool gemv = pick.coin();
      run(d, static_cast<int>(pick.integer(1, 4)), backend, gemv);
      EXPECT_TRUE(
          check(d, backend == Backend::kFast ? (gemv ? "fast+gemv" : "fast") : "reference"));
    }
  }
}

// The block grid depends on the shape only: any thread count gives the
// same bits.
TEST(Linear, FastIsBitIdenticalAcrossThreadCounts) {
  for (const Case& c :
       {Case{1, 3000, 700, 0, 0, 0, true, 301}, Case{9, 2500, 600, 2, 1, 0, false, 302},
        Case{700, 200, 300, 0, 0, 1, true, 303}}) {
    for (bool gemv : {false, true}) {
      Data d(c);
      run(d, 1, Backend::kFast, gemv);
      const std::vector<float> one = d.ybuf;
      for (int threads : {2, 3, 7}) {
        d.reset_y();
        run(d, threads, Backend::kFast, gemv);
        EXPECT_EQ(0, std::memcmp(one.data(), d.ybuf.data(), one.size() * sizeof(float)))
            << c.describe() << " gemv=" << gemv << " at " << threads << " threads";
      }
    }
  }
}

// Where linear_rows_independent() says so (always for the reference), a
// row of y depends on its row of x and on W only: computing the rows one at
// a time, or in other groups, gives the same bits as all at once (the MoE
// layer then shards tokens by thread and relies on this). Without brgemm
// (AVX2) the fast backend says it does not, and is not held to it.
TEST(Linear, RowsDoNotDependOnTheOtherRowsWhereSaid) {
  EXPECT_TRUE(linear_rows_independent(Backend::kReference));
  const bool fast = linear_rows_independent(Backend::kFast);
  if (!fast) std::printf("fast rows not independent: %s\n", linear_backend_name());
  for (Backend backend : {Backend::kFast, Backend::kReference}) {
    if (!linear_rows_independent(backend)) continue;
    for (const Case& c :
         {Case{600, 700, 300, 3, 0, 0, true, 311}, Case{40, 2100, 1100, 0, 2, 1, false, 312}}) {
      Data d(c);
      run(d, 2, backend);
      const std::vector<float> all = d.ybuf;
      for (int64_t group : {1, 2, 7, 33, 257}) {
        d.reset_y();
        for (int64_t r0 = 0; r0 < c.rows; r0 += group)
          linear(d.x() + r0 * d.ldx, d.ldx, d.w.data(), d.bias(), d.y() + r0 * d.ldy, d.ldy,
                 std::min(group, c.rows - r0), c.out, c.in, {.backend = backend});
        EXPECT_EQ(0, std::memcmp(all.data(), d.ybuf.data(), all.size() * sizeof(float)))
            << c.describe() << " in groups of " << group
            << (backend == Backend::kFast ? " fast" : " reference");
      }
    }
  }
}

// bf16 weights (kept as bf16 by the layers): both backends at 1-3 threads
// on edge sizes, strides and misaligned pointers, the block grid's shapes
// and random ones, within the bound around the bf16-rounded x.
TEST(LinearBf16, EdgeSizesStridesAndTheBlockGrid) {
  std::printf("bf16 weights: %s\n", linear_backend_name());
  uint64_t seed = 2000;
  std::vector<Case> cases;
  for (int64_t rows : {1, 2, 7})
    for (int64_t out : {1, 17, 65})
      for (int64_t in : {1, 2, 9, 33}) cases.push_back({rows, out, in, 0, 0, 0, in % 2 == 1});
  for (int64_t rows : {1, 5, 40})
    for (int64_t x_pad : {0, 13}) cases.push_back({rows, 37, 29, x_pad, 3, 1, true});
  for (const Case& c : {Case{1, 4099, 1031, 0, 0, 0, true}, Case{16, 2051, 256, 0, 0, 0, true},
                        Case{13, 1000, 517, 3, 5, 0, false}, Case{600, 300, 67, 0, 0, 0, true},
                        Case{3, 64, 16384, 0, 0, 0, true}})
    cases.push_back(c);
  attnkit_test::Rng pick(78);
  for (int i = 0; i < 12; ++i)
    cases.push_back({pick.integer(1, pick.coin(0.3) ? 300 : 20),
                     pick.integer(1, pick.coin(0.3) ? 600 : 90),
                     pick.integer(1, pick.coin(0.2) ? 1000 : 150), pick.coin() ? 3 : 0,
                     pick.coin() ? 2 : 0, pick.integer(0, 1), pick.coin()});
  for (Case c : cases) {
    c.seed = seed++;
    c.weight = DType::kBF16;
    check_case(c);
  }
}

// bf16 weights give the same bits for any thread count, and, where
// linear_rows_independent(backend, kBF16) says so, for any row grouping.
TEST(LinearBf16, ThreadCountsAndRowGroupsChangeNoBits) {
  EXPECT_TRUE(linear_rows_independent(Backend::kReference, DType::kBF16));
  for (const Case& c : {Case{20, 32, 32, 0, 0, 0, false, 320, DType::kBF16},
                        Case{1, 3000, 700, 0, 0, 0, true, 321, DType::kBF16},
                        Case{600, 700, 300, 3, 0, 0, true, 322, DType::kBF16},
                        Case{40, 2100, 1100, 0, 2, 1, false, 323, DType::kBF16}}) {
    for (Backend backend : {Backend::kFast, Backend::kReference}) {
      Data d(c);
      run(d, 1, backend);
      const std::vector<float> one = d.ybuf;
      for (int threads : {2, 3}) {
        d.reset_y();
        run(d, threads, backend);
        EXPECT_EQ(0, std::memcmp(one.data(), d.ybuf.data(), one.size() * sizeof(float)))
            << c.describe() << " at " << threads << " threads";
      }
      if (!linear_rows_independent(backend, DType::kBF16)) continue;
      for (int64_t group : {1, 7, 257}) {
        d.reset_y();
        for (int64_t r0 = 0; r0 < c.rows; r0 += group)
          linear(d.x() + r0 * d.ldx, d.ldx, d.weight(), d.bias(), d.y() + r0 * d.ldy, d.ldy,
                 std::min(group, c.rows - r0), c.out, c.in, {.backend = backend});
        EXPECT_EQ(0, std::memcmp(one.data(), d.ybuf.data(), one.size() * sizeof(float)))
            << c.describe() << " in groups of " << group
            << (backend == Backend::kFast ? " fast" : " reference");
      }
    }
  }
}

// The reference backend is the loop twin, bit for bit.
TEST(Linear, ReferenceBackendIsTheLoop) {
  Data d({5, 41, 23, 2, 3, 1, true, 401});
  run(d, 2, Backend::kReference);
  const std::vector<float> via_backend = d.ybuf;
  d.reset_y();
  linear_ref(d.x(), d.ldx, d.w.data(), d.bias(), d.y(), d.ldy, 5, 41, 23);
  EXPECT_EQ(0, std::memcmp(via_backend.data(), d.ybuf.data(), d.ybuf.size() * sizeof(float)));
}

// Empty dimensions: no rows or no outputs write nothing; no inputs write
// the bias (or zeros).
TEST(Linear, EmptyDimensions) {
  for (Backend backend : {Backend::kFast, Backend::kReference}) {
    std::vector<float> x(8, 1.0f), w(8, 1.0f), b = {0.5f, -2.0f}, y(8, kSentinel);
    const LinearOptions opt{.num_threads = 2, .backend = backend};
    linear(x.data(), 4, w.data(), b.data(), y.data(), 2, 0, 2, 4, opt);
    linear(x.data(), 4, w.data(), b.data(), y.data(), 2, 2, 0, 4, opt);
    for (float v : y) EXPECT_EQ(v, kSentinel);
    linear(x.data(), 4, w.data(), b.data(), y.data(), 3, 2, 2, 0, opt);
    EXPECT_EQ(y[0], 0.5f);
    EXPECT_EQ(y[1], -2.0f);
    EXPECT_EQ(y[2], kSentinel);
    EXPECT_EQ(y[3], 0.5f);
    EXPECT_EQ(y[4], -2.0f);
    linear(x.data(), 4, w.data(), nullptr, y.data(), 2, 1, 2, 0,
           {.backend = backend, .gemv_for_one_row = true});
    EXPECT_EQ(y[0], 0.0f);
    EXPECT_EQ(y[1], 0.0f);
  }
}

// Input rows that overlap (ldx < in_features) are legal; BLAS refuses
// them, so the fast backend must still get them right.
TEST(Linear, OverlappingInputRows) {
  Case c{6, 50, 40, 0, 0, 0, true, 501};
  Data d(c);
  d.ldx = 7;  // row m starts at x[7 m] and reads 40 elements
  d.reset_y();
  run(d, 2, Backend::kFast);
  EXPECT_TRUE(check(d, "fast, ldx < in_features"));
}

// Several threads calling at once, as the MoE experts' shards do: the
// matmul cache and per-thread scratch are shared state.
TEST(Linear, ConcurrentCallers) {
  std::vector<Data> data;
  for (int i = 0; i < 6; ++i)
    data.emplace_back(Case{1 + 7 * i, 300 + 50 * (i % 3), 129, i % 2, i % 3, 0, i % 2 == 0,
                           600 + static_cast<uint64_t>(i)});
  std::vector<std::thread> threads;
  for (Data& d : data)
    threads.emplace_back([&d] {
      for (int rep = 0; rep < 3; ++rep) {
        d.reset_y();
        run(d, 2, Backend::kFast);
      }
    });
  for (std::thread& t : threads) t.join();
  for (Data& d : data) EXPECT_TRUE(check(d, "fast, concurrent"));
}

TEST(Linear, BackendNameSaysWhichGemm) {
  const std::string name = linear_backend_name();
  EXPECT_EQ(name.rfind("oneDNN ", 0), 0u) << name;
  EXPECT_EQ(name.find("unknown"), std::string::npos) << name;
  EXPECT_EQ(name, std::string(gemm_backend_name()));  // the public name is the same
}

// linear_nn: y = x W with W stored [in, out] (row stride ldw), both
// backends, against the float64 loop with the same bound as linear's, and
// nothing written outside y's [rows, out] elements.
TEST(LinearNN, RandomShapesAndStrides) {
  attnkit_test::Rng rng(77);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t rows = rng.integer(1, 9), out = rng.integer(1, 70), in = rng.integer(1, 150);
    const int64_t ldx = in + rng.integer(0, 3), ldw = out + rng.integer(0, 5),
                  ldy = out + rng.integer(0, 4);
    const std::vector<float> x = attnkit_test::uniform_vector(size_t(rows * ldx), rng);
    std::vector<float> w = attnkit_test::uniform_vector(size_t(in * ldw), rng);
    // Odd trials: bf16 W (x then rounded to bf16 by the contract).
    const bool bf16w = trial % 2 == 1;
    std::vector<bf16> wb;
    if (bf16w)
      for (float& v : w) {
        wb.push_back(float_to_bf16(v));
        v = bf16_to_float(wb.back());
      }
    const Weight weight = bf16w ? Weight{wb.data(), DType::kBF16} : Weight{w.data()};
    for (Backend backend : {Backend::kFast, Backend::kReference}) {
      std::vector<float> y(size_t(rows * ldy), kSentinel);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t n = 0; n < out; ++n) y[size_t(m * ldy + n)] = kNaN;  // beta 0: never read
      linear_nn(x.data(), ldx, weight, ldw, y.data(), ldy, rows, out, in, backend);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t n = 0; n < ldy; ++n) {
          const float got = y[size_t(m * ldy + n)];
          if (n >= out) {
            ASSERT_EQ(got, kSentinel) << "wrote outside y at row " << m << " column " << n;
            continue;
          }
          double exact = 0.0, magnitude = 0.0;
          for (int64_t k = 0; k < in; ++k) {
            const float xv = x[size_t(m * ldx + k)];
            const double p =
                double(bf16w ? attnkit_test::round_bf16(xv) : xv) * w[size_t(k * ldw + n)];
            exact += p;
            magnitude += std::fabs(p);
          }
          const double nu = double(in + 1) * kU;
          ASSERT_LE(std::fabs(got - exact), nu / (1.0 - nu) * magnitude)
              << (backend == Backend::kFast ? "fast" : "reference") << (bf16w ? " bf16" : "")
              << " rows=" << rows << " out=" << out << " in=" << in << " y[" << m << ", " << n
              << "] = " << got << ", exact " << exact;
        }
    }
  }
}

}  // namespace
}  // namespace attnkit::kernels
