// Numerical edge cases through the public sdpa() on the default (fast)
// backend, against the float64 oracle of tests/common/attention_f64.h:
// a 131072-key decode, logits of +-1e30, subnormal inputs, scales and caps,
// fully masked rows, non-finite inputs, and windows near INT64_MAX.
//
// Tolerance (derived as in tests/kernels/attention_fast_test.cc, with
// Σ p|v| in place of max|v|): with u = 2^-24, n = keys in the row,
// S = scale * max_j Σ_d |q_d k_jd| and A = Σ_j p_j |v_j| (the oracle run
// on |v|):
//   score error  E <= (d + 4) u S + d 2^-149 (max|k| + 1)
//                     (+ 2^-8 S with bf16 K/V: vdpbf16ps rounds q to bf16)
//   out error      <= A (expm1(2E) + (3n + 48) u) + n 2^-126 max|v|
//                     + (3n + 32) 2^-149 (+ 2^-8 A with bf16 K/V)
//   lse error      <= E + (3n + 48) u + 4 u |lse|
// (3n u: the blocked fp32 sums of the weights and of P.V in any order;
// n 2^-126: weights below e^-87.3 flushed to 0; 2^-149 terms: products in
// the subnormal range.) The bound is worst-case; a kernel that drops a key
// range, misaligns the causal diagonal or mis-merges a split is off by O(1)
// in the cases below, which place heavy keys where such bugs would lose them.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"
#include "common/attention_f64.h"
#include "common/random.h"

namespace {

using attnkit::AttentionOptions;
using attnkit::Backend;
using attnkit::DType;
using attnkit::Status;
using attnkit::TensorView;
using attnkit_test::OracleOptions;
using attnkit_test::OracleResult;
using attnkit_test::Rng;

constexpr double kU = 0x1p-24;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSentinel = -4242.0f;

// One contiguous sdpa problem: q [B, Sq, H, D], k [B, Sk, Hkv, D],
// v [B, Sk, Hkv, Dv] (f32, or bf16 storage of the same values).
struct Problem {
  OracleOptions o;  // shapes and options, shared with the oracle
  std::vector<float> q, k, v;
  DType kv = DType::kF32;
  std::vector<float> mask_add;  // [o.mask_shape], optional
  float softcap = 0.0f;
  float scale = 0.0f;

  void resize() {
    q.assign(size_t(o.batch * o.seqlen_q * o.num_heads * o.head_dim), 0.0f);
    k.assign(size_t(o.batch * o.seqlen_k * o.num_kv_heads * o.head_dim), 0.0f);
    v.assign(size_t(o.batch * o.seqlen_k * o.num_kv_heads * o.head_dim_v), 0.0f);
  }
  float& qa(int64_t b, int64_t i, int64_t h, int64_t x) {
    return q[size_t(((b * o.seqlen_q + i) * o.num_heads + h) * o.head_dim + x)];
  }
  float& ka(int64_t b, int64_t j, int64_t g, int64_t x) {
    return k[size_t(((b * o.seqlen_k + j) * o.num_kv_heads + g) * o.head_dim + x)];
  }
  float& va(int64_t b, int64_t j, int64_t g, int64_t x) {
    return v[size_t(((b * o.seqlen_k + j) * o.num_kv_heads + g) * o.head_dim_v + x)];
  }
};

struct Result {
  std::vector<float> out, lse;
};

Result run(const Problem& p, Backend backend = Backend::kAuto, int num_threads = 0) {
  const auto& o = p.o;
  Result r;
  r.out.assign(size_t(o.batch * o.seqlen_q * o.num_heads * o.head_dim_v), kSentinel);
  r.lse.assign(size_t(o.batch * o.num_heads * o.seqlen_q), kSentinel);
  std::vector<attnkit::bf16> kb, vb;
  TensorView k = attnkit::make_view(p.k.data(), DType::kF32,
                                    {o.batch, o.seqlen_k, o.num_kv_heads, o.head_dim});
  TensorView v = attnkit::make_view(p.v.data(), DType::kF32,
                                    {o.batch, o.seqlen_k, o.num_kv_heads, o.head_dim_v});
  if (p.kv == DType::kBF16) {
    for (float x : p.k) kb.push_back(attnkit::float_to_bf16(x));
    for (float x : p.v) vb.push_back(attnkit::float_to_bf16(x));
    k.data = kb.data();
    k.dtype = DType::kBF16;
    v.data = vb.data();
    v.dtype = DType::kBF16;
  }
  AttentionOptions opt;
  opt.causal = o.causal;
  opt.window_size = {o.window_left, o.window_right};
  opt.softcap = p.softcap;
  opt.softmax_scale = p.scale;
  opt.backend = backend;
  opt.num_threads = num_threads;
  opt.seqlens_k = o.seqlens_k;
  if (!p.mask_add.empty())
    opt.mask =
        attnkit::make_view(p.mask_add.data(), DType::kF32,
                           {o.mask_shape[0], o.mask_shape[1], o.mask_shape[2], o.mask_shape[3]});
  const Status st = attnkit::sdpa(
      attnkit::make_view(p.q.data(), DType::kF32, {o.batch, o.seqlen_q, o.num_heads, o.head_dim}),
      k, v,
      attnkit::make_view(r.out.data(), DType::kF32,
                         {o.batch, o.seqlen_q, o.num_heads, o.head_dim_v}),
      opt, attnkit::make_view(r.lse.data(), DType::kF32, {o.batch, o.num_heads, o.seqlen_q}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

// The oracle on the values the kernel sees (bf16-rounded K/V where stored
// as bf16); with abs_v, V is replaced by |V| so that out = Σ p |v| (A).
OracleResult oracle(const Problem& p, bool abs_v = false) {
  OracleOptions o = p.o;
  o.softmax_scale = p.scale;
  o.softcap = p.softcap;
  if (!p.mask_add.empty()) o.add_mask.assign(p.mask_add.begin(), p.mask_add.end());
  auto stored = [&](const std::vector<float>& x, bool take_abs) {
    std::vector<double> d(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const float s = p.kv == DType::kBF16 ? attnkit_test::round_bf16(x[i]) : x[i];
      d[i] = take_abs ? std::fabs(double(s)) : double(s);
    }
    return d;
  };
  const std::vector<double> q(p.q.begin(), p.q.end());
  return attnkit_test::attention_f64(o, q, stored(p.k, false), stored(p.v, abs_v));
}

// Checks every row of `r` against the oracle with the bound of the header.
// `exact_scores`: the scores are exact in fp32 (E = 0 apart from softcap).
// `bias_swamps`: every finite bias is 0 or so large that it absorbs the
// score in fp32 and in double alike, so it adds no error term.
// Returns the worst error as a fraction of its bound.
double expect_within_bound(const Problem& p, const Result& r, bool exact_scores = false,
                           bool bias_swamps = false) {
  const auto& o = p.o;
  const OracleResult ref = oracle(p), ref_abs = oracle(p, true);
  const double scale =
      p.scale > 0.0f ? p.scale : double(float(1.0 / std::sqrt(double(o.head_dim))));
  const int64_t group = o.num_heads / o.num_kv_heads;
  const bool bf16 = p.kv == DType::kBF16;
  double k_max = 0.0, v_max = 0.0, bias_max = 0.0;
  for (float x : p.k) k_max = std::max(k_max, std::fabs(double(x)));
  for (float x : p.v) v_max = std::max(v_max, std::fabs(double(x)));
  for (float x : p.mask_add)
    if (std::isfinite(x)) bias_max = std::max(bias_max, std::fabs(double(x)));
  double worst = 0.0;
  std::string worst_at;
  for (int64_t b = 0; b < o.batch; ++b)
    for (int64_t i = 0; i < o.seqlen_q; ++i)
      for (int64_t h = 0; h < o.num_heads; ++h) {
        double s_max = 0.0;
        for (int64_t j = 0; j < o.seqlen_k; ++j) {
          double dot = 0.0;
          for (int64_t x = 0; x < o.head_dim; ++x)
            dot += std::fabs(double(
                       p.q[size_t(((b * o.seqlen_q + i) * o.num_heads + h) * o.head_dim + x)])) *
                   std::fabs(double(p.k[size_t(
                       ((b * o.seqlen_k + j) * o.num_kv_heads + h / group) * o.head_dim + x)]));
          s_max = std::max(s_max, scale * dot);
        }
        const double n = double(o.seqlen_k);
        double e = exact_scores
                       ? 0.0
                       : (o.head_dim + 4) * kU * s_max + o.head_dim * 0x1p-149 * (k_max + 1);
        if (p.softcap > 0.0f) e += 8 * kU * p.softcap;
        if (!p.mask_add.empty() && !exact_scores && !bias_swamps) e += kU * (s_max + bias_max);
        if (bf16) e += 0x1p-8 * s_max;
        const size_t lse_at = size_t((b * o.num_heads + h) * o.seqlen_q + i);
        for (int64_t c = 0; c < o.head_dim_v; ++c) {
          const size_t at = size_t(((b * o.seqlen_q + i) * o.num_heads + h) * o.head_dim_v + c);
          const double a_c = ref_abs.out[at];
          double bound = a_c * (std::expm1(2 * e) + (3 * n + 48) * kU) + n * 0x1p-126 * v_max +
                         (3 * n + 32) * 0x1p-149;
          if (bf16) bound += 0x1p-8 * a_c + 0x1p-125;
          if (!std::isfinite(r.out[at])) {
            ADD_FAILURE() << "out not finite at row b=" << b << " i=" << i << " h=" << h;
            return HUGE_VAL;
          }
          const double err = std::fabs(double(r.out[at]) - ref.out[at]);
          if (err / bound > worst) {
            worst = err / bound;
            worst_at = "out[b=" + std::to_string(b) + " i=" + std::to_string(i) +
                       " h=" + std::to_string(h) + " c=" + std::to_string(c) + "]: actual " +
                       std::to_string(r.out[at]) + " expected " + std::to_string(ref.out[at]) +
                       " bound " + std::to_string(bound);
          }
        }
        if (std::isinf(ref.lse[lse_at])) {
          EXPECT_EQ(r.lse[lse_at], -kInf);
          continue;
        }
        const double lse_bound = e + (3 * n + 48) * kU + 4 * kU * std::fabs(ref.lse[lse_at]);
        const double lse_err = std::fabs(double(r.lse[lse_at]) - ref.lse[lse_at]);
        if (lse_err / lse_bound > worst) {
          worst = lse_err / lse_bound;
          worst_at = "lse[b=" + std::to_string(b) + " h=" + std::to_string(h) +
                     " i=" + std::to_string(i) + "]: actual " + std::to_string(r.lse[lse_at]) +
                     " expected " + std::to_string(ref.lse[lse_at]) + " bound " +
                     std::to_string(lse_bound);
        }
      }
  EXPECT_LE(worst, 1.0) << "worst element " << worst_at;
  return worst;
}

// ---- 128K context ------------------------------------------------------------

// Decode of 4 queries over 131072 cached keys (one kv head shared by two
// query heads), causal. Head 0's query points along û; three "needle" keys
// along û (at 0, 65536 and 131070) each carry about a quarter of the
// softmax mass against 131069 random keys, with values +4, -4 and +2: a
// dropped key split, a wrong merge or a causal diagonal off by one (key
// 131070 is visible to rows 2 and 3 only) moves the output by O(1), while
// the bound allows ~0.05. Head 1 looks the other way (query -û), so it
// averages the random keys: the long fp32 sum with no dominant term.
void long_context(DType kv) {
  Problem p;
  p.kv = kv;
  p.o.batch = 1;
  p.o.seqlen_q = 4;
  p.o.seqlen_k = 131072;
  p.o.num_heads = 2;
  p.o.num_kv_heads = 1;
  p.o.head_dim = p.o.head_dim_v = 16;
  p.o.causal = true;
  p.resize();
  Rng rng(131072);
  std::vector<double> u(16);
  double norm = 0.0;
  for (double& x : u) {
    x = rng.normal();
    norm += x * x;
  }
  for (double& x : u) x /= std::sqrt(norm);
  // q = 4 û: scores of random keys are N(0, 1) after the 1/4 scale.
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t x = 0; x < 16; ++x) {
      p.qa(0, i, 0, x) = float(4.0 * u[size_t(x)]);
      p.qa(0, i, 1, x) = float(-4.0 * u[size_t(x)]);
    }
  for (int64_t j = 0; j < p.o.seqlen_k; ++j)
    for (int64_t x = 0; x < 16; ++x) {
      p.ka(0, j, 0, x) = rng.normal();
      p.va(0, j, 0, x) = rng.uniform(-1.0f, 1.0f);
    }
  // n e^(1/2) ~ 2.2e5 ~ e^12.3: a needle scoring 12.3 weighs as much as
  // all random keys together.
  const struct {
    int64_t j;
    float value;
  } needles[] = {{0, 4.0f}, {65536, -4.0f}, {131070, 2.0f}};
  for (const auto& nd : needles)
    for (int64_t x = 0; x < 16; ++x) {
      p.ka(0, nd.j, 0, x) = float(12.3 / (0.25 * 4.0) * u[size_t(x)]);
      p.va(0, nd.j, 0, x) = nd.value;
    }
  const Result r = run(p);
  const double worst = expect_within_bound(p, r);
  std::printf("[ reliability ] 131072-key decode, %s K/V: worst error %.3g of the bound\n",
              attnkit::dtype_name(kv), worst);
  // The needle at 131070 is seen by rows 2 and 3 only: head 0's output
  // moves by about +2 * (its share) between rows 1 and 2.
  const OracleResult ref = oracle(p);
  EXPECT_GT(ref.out[size_t((2 * 2 + 0) * 16)] - ref.out[size_t((1 * 2 + 0) * 16)], 0.3)
      << "the case no longer separates rows that see the last needle";
}

TEST(ReliabilityNumerics, DecodeOver131072KeysF32MatchesFloat64) { long_context(DType::kF32); }
TEST(ReliabilityNumerics, DecodeOver131072KeysBf16MatchesFloat64) { long_context(DType::kBF16); }

// ---- huge logits ---------------------------------------------------------------

// Scores up to +-1.9e30 after scaling (scale 2^60, q = m 2^21, k = n 0.75
// 2^19 with small integers m, n), with ties: every score is exact in fp32
// and double, so E = 0 and the bound is the summation term alone. Rows
// whose largest scores tie average those keys; others put all weight on
// one key. With softcap 30 the capped scores are +-30 or 0 exactly.
TEST(ReliabilityNumerics, LogitsOfPlusMinus1e30StayFiniteAndExact) {
  for (float softcap : {0.0f, 30.0f})
    for (bool causal : {false, true}) {
      SCOPED_TRACE("softcap=" + std::to_string(softcap) + " causal=" + std::to_string(causal));
      Problem p;
      p.o.batch = 2;
      p.o.seqlen_q = 5;
      p.o.seqlen_k = 700;  // past a decode split (512 keys)
      p.o.num_heads = 2;
      p.o.num_kv_heads = 1;
      p.o.head_dim = 1;
      p.o.head_dim_v = 4;
      p.o.causal = causal;
      p.scale = 0x1p60f;
      p.softcap = softcap;
      p.resize();
      for (size_t i = 0; i < p.q.size(); ++i) p.q[i] = float(int(i % 3) - 1) * 0x1p21f;
      for (size_t i = 0; i < p.k.size(); ++i) p.k[i] = float(int(i % 5) - 2) * 0x1p19f * 0.75f;
      Rng rng(30);
      attnkit_test::fill_uniform(p.v, rng);
      const Result r = run(p);
      double s_max = 0.0;
      for (float qx : p.q)
        for (float kx : p.k) s_max = std::max(s_max, 0x1p60 * std::fabs(double(qx) * kx));
      ASSERT_GT(s_max, 1e30);  // the case reaches the advertised magnitude
      expect_within_bound(p, r, /*exact_scores=*/true);
      for (float x : r.lse) EXPECT_TRUE(std::isfinite(x));
    }
}

// An additive bias of -1e30 on every key of a row is a (very) negative
// score, not a mask: the row averages its values (fp32 and double both lose
// the O(1) scores next to 1e30), and in a mixed row the biased keys get
// weight 0. The fast kernel must agree with the oracle.
TEST(ReliabilityNumerics, HugeNegativeBiasOnTheFastPath) {
  Problem p;
  p.o.batch = 1;
  p.o.seqlen_q = 3;
  p.o.seqlen_k = 100;
  p.o.num_heads = p.o.num_kv_heads = 1;
  p.o.head_dim = p.o.head_dim_v = 8;
  p.resize();
  Rng rng(31);
  attnkit_test::fill_uniform(p.q, rng);
  attnkit_test::fill_uniform(p.k, rng);
  attnkit_test::fill_uniform(p.v, rng);
  p.o.mask_shape = {1, 1, 3, 100};
  p.mask_add.assign(300, 0.0f);
  for (int64_t j = 0; j < 100; ++j) {
    p.mask_add[size_t(j)] = -1e30f;                        // row 0: all biased
    if (j % 2) p.mask_add[size_t(100 + j)] = -1e30f;       // row 1: every other key
    p.mask_add[size_t(200 + j)] = j == 7 ? 0.0f : -1e30f;  // row 2: one key left
  }
  const Result r = run(p);
  // -1e30 has a double ulp of 2^47: it swamps O(1) scores in both.
  expect_within_bound(p, r, /*exact_scores=*/false, /*bias_swamps=*/true);
  for (int64_t c = 0; c < 8; ++c) {
    double mean = 0.0;
    for (int64_t j = 0; j < 100; ++j) mean += p.va(0, j, 0, c) / 100.0;
    EXPECT_NEAR(r.out[size_t(c)], mean, 1e-5) << "row 0 must average all keys";
    EXPECT_EQ(r.out[size_t(16 + c)], p.va(0, 7, 0, c)) << "row 2 must copy key 7's value";
  }
}

// ---- subnormals -------------------------------------------------------------------

// Subnormal q and k (and a subnormal softmax_scale) give scores of ~0:
// uniform weights, out = the mean of the visible values, never NaN.
TEST(ReliabilityNumerics, SubnormalQueriesKeysAndScale) {
  for (float scale : {0.0f, 1e-40f})
    for (bool causal : {false, true}) {
      SCOPED_TRACE("scale=" + std::to_string(scale) + " causal=" + std::to_string(causal));
      Problem p;
      p.o.batch = 2;
      p.o.seqlen_q = 3;
      p.o.seqlen_k = 77;
      p.o.num_heads = 4;
      p.o.num_kv_heads = 2;
      p.o.head_dim = 16;
      p.o.head_dim_v = 5;
      p.o.causal = causal;
      p.scale = scale;
      p.resize();
      Rng rng(40);
      for (float& x : p.q) x = float(rng.integer(-8, 8)) * 0x1p-140f;
      for (float& x : p.k) x = float(rng.integer(-8, 8)) * 0x1p-140f;
      attnkit_test::fill_uniform(p.v, rng);
      const Result r = run(p);
      expect_within_bound(p, r);
    }
}

// Subnormal values: out is a weighted mean of numbers of order 2^-134, which
// fp32 holds to an absolute 2^-149 per operation; a kernel that flushed
// subnormals to zero would be off by ~2^-134, 100 times the bound.
// (f32 K/V: with bf16 K/V on AVX512_BF16, vdpbf16ps itself treats
// subnormal inputs as zero; docs/RELIABILITY.md says so.)
TEST(ReliabilityNumerics, SubnormalValuesAreAveragedNotFlushed) {
  Problem p;
  p.o.batch = 1;
  p.o.seqlen_q = 4;
  p.o.seqlen_k = 64;
  p.o.num_heads = p.o.num_kv_heads = 2;
  p.o.head_dim = 8;
  p.o.head_dim_v = 8;
  p.resize();
  Rng rng(41);
  attnkit_test::fill_uniform(p.q, rng, -0.25f, 0.25f);
  attnkit_test::fill_uniform(p.k, rng, -0.25f, 0.25f);
  for (float& x : p.v) x = float(rng.integer(32, 64)) * 0x1p-140f;  // all positive
  const Result r = run(p);
  expect_within_bound(p, r);
  for (float x : r.out) EXPECT_GT(x, 0.0f) << "a subnormal mean must not flush to 0";
}

// Scores whose differences reach e^-100 (weights below FLT_MIN): the tiny
// weights may be flushed (n 2^-126 max|v| in the bound) but nothing may
// become NaN or Inf.
TEST(ReliabilityNumerics, WeightsInTheSubnormalRange) {
  Problem p;
  p.o.batch = 1;
  p.o.seqlen_q = 2;
  p.o.seqlen_k = 200;
  p.o.num_heads = p.o.num_kv_heads = 1;
  p.o.head_dim = 1;
  p.o.head_dim_v = 3;
  p.scale = 1.0f;
  p.resize();
  p.q = {1.0f, -1.0f};
  for (int64_t j = 0; j < 200; ++j) p.k[size_t(j)] = -0.5f * float(j);  // 0 .. -99.5
  Rng rng(42);
  attnkit_test::fill_uniform(p.v, rng);
  const Result r = run(p);
  expect_within_bound(p, r);
}

// A softcap of FLT_MIN works; a subnormal one is rejected with a message
// (the fast kernels multiply by 1 / softcap, which would be +inf).
TEST(ReliabilityNumerics, SoftcapDownToFltMinAndSubnormalRejected) {
  Problem p;
  p.o.batch = 1;
  p.o.seqlen_q = 2;
  p.o.seqlen_k = 9;
  p.o.num_heads = p.o.num_kv_heads = 1;
  p.o.head_dim = p.o.head_dim_v = 4;
  p.resize();
  Rng rng(43);
  attnkit_test::fill_uniform(p.q, rng);
  attnkit_test::fill_uniform(p.k, rng);
  attnkit_test::fill_uniform(p.v, rng);
  p.q[0] = p.q[1] = p.q[2] = p.q[3] = 0.0f;  // row 0: every score exactly 0
  p.softcap = FLT_MIN;
  expect_within_bound(p, run(p));

  std::vector<float> out(8, kSentinel);
  AttentionOptions opt;
  opt.softcap = 1e-40f;
  const Status st = attnkit::sdpa(attnkit::make_view(p.q.data(), DType::kF32, {1, 2, 1, 4}),
                                  attnkit::make_view(p.k.data(), DType::kF32, {1, 9, 1, 4}),
                                  attnkit::make_view(p.v.data(), DType::kF32, {1, 9, 1, 4}),
                                  attnkit::make_view(out.data(), DType::kF32, {1, 2, 1, 4}), opt);
  EXPECT_EQ(st.code(), attnkit::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("softcap = 1e-40"), std::string::npos) << st.message();
  for (float x : out) EXPECT_EQ(x, kSentinel);
}

// ---- non-finite inputs on the fast path ---------------------------------------

// The decode-shaped fast path (keys split, 3 threads): NaN in a query
// poisons that row only; NaN in K poisons exactly the rows that see that
// key (same batch item, same kv group, causally after it); +Inf in V turns
// only the rows that see it non-finite; NaN in keys beyond seqlens_k, or
// masked by -inf bias, reaches nothing.
TEST(ReliabilityNumerics, NonFiniteInputsReachOnlyTheRowsThatSeeThem) {
  Problem p;
  p.o.batch = 2;
  p.o.seqlen_q = 3;
  p.o.seqlen_k = 1200;
  p.o.num_heads = 4;
  p.o.num_kv_heads = 2;
  p.o.head_dim = 8;
  p.o.head_dim_v = 4;
  p.o.causal = true;
  p.o.seqlens_k = {1200, 1000};
  p.resize();
  Rng rng(44);
  attnkit_test::fill_uniform(p.q, rng);
  attnkit_test::fill_uniform(p.k, rng);
  attnkit_test::fill_uniform(p.v, rng);
  p.qa(0, 0, 3, 2) = kNaN;     // row (b0, i0, h3)
  p.ka(1, 998, 0, 5) = kNaN;   // item 1 (L = 1000): rows i >= 1 of heads 0, 1
  p.va(0, 600, 1, 0) = kInf;   // item 0, group 1: every row of heads 2, 3
  p.ka(1, 1100, 1, 0) = kNaN;  // beyond seqlens_k[1]: never seen
  p.va(1, 1150, 0, 2) = kNaN;
  const Result r = run(p, Backend::kAuto, 3);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t h = 0; h < 4; ++h) {
        const bool q_nan = b == 0 && i == 0 && h == 3;
        const bool k_nan = b == 1 && i >= 1 && h / 2 == 0;
        const bool v_inf = b == 0 && h / 2 == 1;
        for (int64_t c = 0; c < 4; ++c) {
          const float x = r.out[size_t(((b * 3 + i) * 4 + h) * 4 + c)];
          SCOPED_TRACE("b=" + std::to_string(b) + " i=" + std::to_string(i) +
                       " h=" + std::to_string(h) + " c=" + std::to_string(c));
          if (q_nan || k_nan) {
            EXPECT_TRUE(std::isnan(x));
          } else if (v_inf && c == 0) {
            EXPECT_FALSE(std::isfinite(x));  // +Inf (or NaN from Inf - Inf in a merge)
          } else {
            EXPECT_TRUE(std::isfinite(x));
          }
        }
      }
}

// Rows with no visible key output exactly +0 and lse -inf on the fast
// path, also in a split decode: item 0 has no keys (seqlens_k 0); in item
// 1 the window (0, 0) leaves each row its own position only, and row 0's
// key (898 = 0 + 900 - 2) is masked by a -inf bias.
TEST(ReliabilityNumerics, FullyMaskedRowsAreZeroOnTheFastPath) {
  Problem p;
  p.o.batch = 2;
  p.o.seqlen_q = 2;
  p.o.seqlen_k = 900;
  p.o.num_heads = 2;
  p.o.num_kv_heads = 1;
  p.o.head_dim = p.o.head_dim_v = 8;
  p.o.seqlens_k = {0, 900};
  p.o.window_left = 0;
  p.o.window_right = 0;
  p.o.mask_shape = {1, 1, 2, 900};
  p.resize();
  Rng rng(45);
  attnkit_test::fill_uniform(p.q, rng);
  attnkit_test::fill_uniform(p.k, rng);
  attnkit_test::fill_uniform(p.v, rng);
  p.mask_add.assign(1800, 0.0f);
  p.mask_add[898] = -kInf;
  const Result r = run(p);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t h = 0; h < 2; ++h) {
        const bool empty = b == 0 || i == 0;
        SCOPED_TRACE("b=" + std::to_string(b) + " i=" + std::to_string(i) +
                     " h=" + std::to_string(h));
        const float lse = r.lse[size_t((b * 2 + h) * 2 + i)];
        EXPECT_EQ(lse == -kInf, empty) << lse;
        for (int64_t c = 0; c < 8; ++c) {
          const float x = r.out[size_t(((b * 2 + i) * 2 + h) * 8 + c)];
          if (empty)
            EXPECT_TRUE(x == 0.0f && !std::signbit(x)) << x;
          else
            EXPECT_EQ(x, p.va(1, 899, 0, c)) << "row 1 sees key 899 alone";
        }
      }
  expect_within_bound(p, r);
}

// ---- windows near INT64_MAX -----------------------------------------------------

// window_size is any value >= -1; near INT64_MAX it means "unlimited" and
// must not overflow position arithmetic (UBSan checks this in CI). On
// both backends, (max, max) equals no window and (max, 0) equals causal.
TEST(ReliabilityNumerics, WindowsNearInt64MaxMeanUnlimited) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (Backend backend : {Backend::kReference, Backend::kFast}) {
    Problem p;
    p.o.batch = 1;
    p.o.seqlen_q = 6;
    p.o.seqlen_k = 600;
    p.o.num_heads = 2;
    p.o.num_kv_heads = 1;
    p.o.head_dim = p.o.head_dim_v = 8;
    p.resize();
    Rng rng(46);
    attnkit_test::fill_uniform(p.q, rng);
    attnkit_test::fill_uniform(p.k, rng);
    attnkit_test::fill_uniform(p.v, rng);
    const Result unlimited = run(p, backend);
    p.o.causal = true;
    const Result causal = run(p, backend);
    p.o.causal = false;
    for (int64_t right : {kMax, kMax - 1, kMax / 2}) {
      p.o.window_left = kMax - 3;
      p.o.window_right = right;
      const Result r = run(p, backend);
      EXPECT_EQ(0, std::memcmp(r.out.data(), unlimited.out.data(), r.out.size() * 4));
    }
    p.o.window_left = kMax;
    p.o.window_right = 0;
    const Result r = run(p, backend);
    EXPECT_EQ(0, std::memcmp(r.out.data(), causal.out.data(), r.out.size() * 4));
  }
}

// Empty calls with row-major strides of an empty shape (which contain 0,
// as make_view and numpy compute them) are valid and write nothing.
TEST(ReliabilityNumerics, EmptyOutputsWithZeroStridesAreAccepted) {
  std::vector<float> buf(64, 1.0f), out(8, kSentinel), lse(8, kSentinel);
  const TensorView q = attnkit::make_view(buf.data(), DType::kF32, {2, 0, 2, 4});
  const TensorView k = attnkit::make_view(buf.data(), DType::kF32, {2, 3, 1, 4});
  const TensorView o = attnkit::make_view(out.data(), DType::kF32, {2, 0, 2, 4});
  const TensorView l = attnkit::make_view(lse.data(), DType::kF32, {2, 2, 0});
  ASSERT_EQ(o.strides[0], 0);  // what the test is about
  const Status st = attnkit::sdpa(q, k, k, o, {}, l);
  EXPECT_TRUE(st.ok()) << st.to_string();
  for (float x : out) EXPECT_EQ(x, kSentinel);
  for (float x : lse) EXPECT_EQ(x, kSentinel);
}

}  // namespace
