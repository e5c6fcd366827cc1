// Rope against an independent float64 reference written differently from
// src/ops/rope.cc: half-split through the rotate_half formula
//   out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)
// and interleaved through complex multiplication, with inverse frequencies
// computed as exp(-(2i/d) ln theta). Scaled frequencies are checked against
// values derived by hand from the published formulas for real configs.
#include "attnkit/rope.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <string>
#include <vector>

#include "common/random.h"

namespace {

using attnkit::DType;
using attnkit::Rope;
using attnkit::RopeConfig;
using attnkit::RopePairing;
using attnkit::RopeScaling;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit_test::Rng;

constexpr double kEps64 = 0x1p-52;
constexpr double kUnit32 = 0x1p-24;  // float round-to-nearest unit roundoff

// x [batch, seq, heads, head_dim] inside a larger buffer with gaps on every
// axis and the axes laid out in a non-row-major order, so apply() must honour
// all four strides. Slots outside the view hold a sentinel.
struct StridedX {
  int64_t batch, seq, heads, head_dim;
  std::vector<float> buf;
  TensorView view;

  static constexpr float kSentinel = 12345.0f;

  StridedX(int64_t b, int64_t s, int64_t h, int64_t d) : batch(b), seq(s), heads(h), head_dim(d) {
    // Memory order (outer to inner): heads, batch, head_dim, seq; each axis
    // padded by one slot.
    const int64_t st_seq = 1, st_dim = (s + 1) * st_seq, st_batch = (d + 1) * st_dim,
                  st_head = (b + 1) * st_batch;
    buf.assign(static_cast<size_t>((h + 1) * st_head), kSentinel);
    view.data = buf.data();
    view.dtype = DType::kF32;
    view.rank = 4;
    view.shape = {b, s, h, d};
    view.strides = {st_batch, st_seq, st_head, st_dim};
  }
  float& at(int64_t b, int64_t s, int64_t h, int64_t d) {
    return buf[static_cast<size_t>(b * view.strides[0] + s * view.strides[1] + h * view.strides[2] +
                                   d * view.strides[3])];
  }
  // Logical contents, row-major [batch, seq, heads, head_dim].
  std::vector<float> logical() {
    std::vector<float> out;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t s = 0; s < seq; ++s)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < head_dim; ++d) out.push_back(at(b, s, h, d));
    return out;
  }
  void set_logical(const std::vector<float>& v) {
    size_t i = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t s = 0; s < seq; ++s)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < head_dim; ++d) at(b, s, h, d) = v[i++];
  }
  size_t sentinels() const {
    size_t n = 0;
    for (float v : buf) n += v == kSentinel;
    return n;
  }
};

std::vector<double> ref_inv_freq(double theta, int64_t rotary_dim) {
  std::vector<double> f(static_cast<size_t>(rotary_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = std::exp(-(2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)) *
                    std::log(theta));
  return f;
}

// Rotates one head vector h[0..head_dim) at position pos.
std::vector<double> ref_rotate(const std::vector<double>& h, int64_t rotary_dim,
                               RopePairing pairing, const std::vector<double>& inv_freq,
                               double attention_factor, double pos) {
  std::vector<double> out = h;
  const int64_t half = rotary_dim / 2;
  if (pairing == RopePairing::kInterleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const std::complex<double> z(h[2 * i], h[2 * i + 1]);
      const std::complex<double> r =
          z * std::polar(attention_factor, pos * inv_freq[static_cast<size_t>(i)]);
      out[2 * i] = r.real();
      out[2 * i + 1] = r.imag();
    }
  } else {
    for (int64_t j = 0; j < rotary_dim; ++j) {
      const double angle = pos * inv_freq[static_cast<size_t>(j % half)];
      const double rotated = j < half ? -h[j + half] : h[j - half];
      out[j] = attention_factor * (h[j] * std::cos(angle) + rotated * std::sin(angle));
    }
  }
  return out;
}

// Reference over a whole logical [batch, seq, heads, head_dim] tensor;
// `pos_of(b, s)` gives the token's position.
template <typename PosOf>
std::vector<double> ref_apply(const std::vector<float>& x, int64_t batch, int64_t seq,
                              int64_t heads, int64_t head_dim, int64_t rotary_dim,
                              RopePairing pairing, const std::vector<double>& inv_freq,
                              double attention_factor, PosOf pos_of) {
  std::vector<double> out;
  size_t i = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> v(x.begin() + static_cast<std::ptrdiff_t>(i),
                              x.begin() + static_cast<std::ptrdiff_t>(i + head_dim));
        i += static_cast<size_t>(head_dim);
        const auto r = ref_rotate(v, rotary_dim, pairing, inv_freq, attention_factor,
                                  static_cast<double>(pos_of(b, s)));
        out.insert(out.end(), r.begin(), r.end());
      }
  return out;
}

// Bound for float output of a double computation compared with a double
// reference whose inverse frequencies may differ by ~16 eps (exp/log vs pow):
// one float rounding (relative) plus the angle discrepancy scaled by the
// input magnitude.
attnkit_test::Tolerance rope_tolerance(double max_abs_x, double attention_factor,
                                       double max_angle) {
  return {.atol = 2.0 * max_abs_x * attention_factor * kEps64 * (32.0 * max_angle + 16.0),
          .rtol = kUnit32};
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float e : v) m = std::max(m, std::fabs(static_cast<double>(e)));
  return m;
}

// Field-by-field builders (GCC warns on partial designated initializers).
RopeConfig cfg_of(int64_t head_dim, double theta = 10000.0,
                  RopePairing pairing = RopePairing::kHalfSplit, int64_t rotary_dim = 0) {
  RopeConfig c;
  c.head_dim = head_dim;
  c.rotary_dim = rotary_dim;
  c.theta = theta;
  c.pairing = pairing;
  return c;
}
RopeScaling scaling_of(RopeScaling::Type type, double factor) {
  RopeScaling s;
  s.type = type;
  s.factor = factor;
  return s;
}
RopeScaling llama3_scaling(double factor, double low, double high, int64_t orig) {
  RopeScaling s = scaling_of(RopeScaling::Type::kLlama3, factor);
  s.low_freq_factor = low;
  s.high_freq_factor = high;
  s.original_max_position_embeddings = orig;
  return s;
}
// beta_fast / beta_slow keep their 32 / 1 defaults.
RopeScaling yarn_scaling(double factor, int64_t orig, double mscale = 0.0,
                         double mscale_all_dim = 0.0) {
  RopeScaling s = scaling_of(RopeScaling::Type::kYarn, factor);
  s.original_max_position_embeddings = orig;
  s.mscale = mscale;
  s.mscale_all_dim = mscale_all_dim;
  return s;
}

Rope make_rope(const RopeConfig& c) {
  auto r = Rope::create(c);
  if (r.ok()) return std::move(r).value();
  ADD_FAILURE() << "Rope::create failed: " << r.status().to_string();
  return Rope::create(cfg_of(2)).value();
}

struct ApplyCase {
  RopePairing pairing;
  int64_t head_dim, rotary_dim;
  bool per_token_positions;
};

void check_against_reference(const ApplyCase& c, uint64_t seed) {
  const int64_t batch = 3, seq = 5, heads = 4;
  Rng rng(seed);
  const Rope rope = make_rope(cfg_of(c.head_dim, 10000.0, c.pairing, c.rotary_dim));

  StridedX x(batch, seq, heads, c.head_dim);
  const auto x0 = attnkit_test::uniform_vector(
      static_cast<size_t>(batch * seq * heads * c.head_dim), rng, -2.0f, 2.0f);
  x.set_logical(x0);
  const size_t sentinels = x.sentinels();
  // Positions: small, random up to 1e6, and the extremes 0 and 1e6.
  const int64_t npos = c.per_token_positions ? batch * seq : seq;
  std::vector<int64_t> pos(static_cast<size_t>(npos));
  for (int64_t i = 0; i < npos; ++i) pos[static_cast<size_t>(i)] = rng.integer(0, 1000000);
  pos[0] = 0;
  pos[1] = 1000000;
  pos[2] = 7;
  auto pos_of = [&](int64_t b, int64_t s) {
    return pos[static_cast<size_t>(c.per_token_positions ? b * seq + s : s)];
  };

  ASSERT_TRUE(rope.apply(x.view, pos).ok());
  const int64_t rd = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  const auto want = ref_apply(x0, batch, seq, heads, c.head_dim, rd, c.pairing,
                              ref_inv_freq(10000.0, rd), 1.0, pos_of);
  EXPECT_TRUE(
      attnkit_test::all_close("rope(x)", x.logical(), want, rope_tolerance(max_abs(x0), 1.0, 1e6)));
  EXPECT_EQ(x.sentinels(), sentinels) << "apply() wrote outside the view";
  // Features at and beyond rotary_dim pass through bit for bit.
  const auto got = x.logical();
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<int64_t>(i % static_cast<size_t>(c.head_dim)) >= rd) {
      ASSERT_EQ(got[i], x0[i]) << "pass-through feature " << i % c.head_dim << " changed";
    }
  }
}

TEST(RopeApply, HalfSplitMatchesRotateHalfReference) {
  check_against_reference({RopePairing::kHalfSplit, 64, 0, true}, 1);
  check_against_reference({RopePairing::kHalfSplit, 6, 0, false}, 2);
  check_against_reference({RopePairing::kHalfSplit, 2, 0, true}, 3);
}

TEST(RopeApply, InterleavedMatchesComplexReference) {
  check_against_reference({RopePairing::kInterleaved, 64, 0, true}, 4);
  check_against_reference({RopePairing::kInterleaved, 10, 0, false}, 5);
  check_against_reference({RopePairing::kInterleaved, 2, 0, false}, 6);
}

TEST(RopeApply, PartialRotaryLeavesTailUnchanged) {
  // Phi/NeoX-style partial rotary: 32 of 80 features, and odd tails.
  check_against_reference({RopePairing::kHalfSplit, 80, 32, true}, 7);
  check_against_reference({RopePairing::kInterleaved, 80, 32, false}, 8);
  check_against_reference({RopePairing::kHalfSplit, 7, 4, false}, 9);
  check_against_reference({RopePairing::kInterleaved, 9, 2, true}, 10);
}

TEST(RopeApply, SharedPositionsEqualRepeatedPerTokenPositions) {
  const int64_t batch = 4, seq = 3, heads = 2, dim = 16;
  Rng rng(11);
  const Rope rope = make_rope(cfg_of(dim, 500000.0));
  const auto x0 = attnkit_test::uniform_vector(batch * seq * heads * dim, rng);
  const std::vector<int64_t> shared = {5, 123456, 42};
  std::vector<int64_t> per_token;
  for (int64_t b = 0; b < batch; ++b)
    per_token.insert(per_token.end(), shared.begin(), shared.end());
  auto a = x0, b = x0;
  ASSERT_TRUE(
      rope.apply(attnkit::make_view(a.data(), DType::kF32, {batch, seq, heads, dim}), shared).ok());
  ASSERT_TRUE(
      rope.apply(attnkit::make_view(b.data(), DType::kF32, {batch, seq, heads, dim}), per_token)
          .ok());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, x0);
}

TEST(RopeApply, InterleavedIsPermutedHalfSplit) {
  // mla.md §4: with P = [0, 2, 4, .., 1, 3, 5, ..], rope_interleaved(x)[P] ==
  // rope_halfsplit(x[P]). Both rotate the same pair by the same angle, so
  // the results agree bit for bit.
  const int64_t batch = 2, seq = 6, heads = 3, dim = 64;
  Rng rng(12);
  std::vector<int64_t> pos(seq);
  for (auto& p : pos) p = rng.integer(0, 1000000);
  RopeConfig cfg = cfg_of(dim);
  cfg.scaling = yarn_scaling(40.0, 4096, 1.0, 0.707);
  cfg.pairing = RopePairing::kInterleaved;
  const Rope gptj = make_rope(cfg);
  cfg.pairing = RopePairing::kHalfSplit;
  const Rope neox = make_rope(cfg);

  std::vector<int64_t> perm;
  for (int64_t i = 0; i < dim; i += 2) perm.push_back(i);
  for (int64_t i = 1; i < dim; i += 2) perm.push_back(i);

  auto x = attnkit_test::normal_vector(batch * seq * heads * dim, rng);
  std::vector<float> xp(x.size());
  for (size_t r = 0; r < x.size(); r += dim)
    for (int64_t j = 0; j < dim; ++j) xp[r + j] = x[r + perm[j]];
  ASSERT_TRUE(
      gptj.apply(attnkit::make_view(x.data(), DType::kF32, {batch, seq, heads, dim}), pos).ok());
  ASSERT_TRUE(
      neox.apply(attnkit::make_view(xp.data(), DType::kF32, {batch, seq, heads, dim}), pos).ok());
  for (size_t r = 0; r < x.size(); r += dim)
    for (int64_t j = 0; j < dim; ++j)
      ASSERT_EQ(x[r + perm[j]], xp[r + j]) << "row " << r / dim << " feature " << j;
}

TEST(RopeApply, DotProductDependsOnlyOnRelativePosition) {
  // <R_m q, R_n k> = f(m - n) for both pairings, with and without scaling
  // (YaRN's attention_factor scales every such product by af^2).
  const int64_t dim = 128;
  Rng rng(13);
  const auto q = attnkit_test::normal_vector(dim, rng);
  const auto k = attnkit_test::normal_vector(dim, rng);
  double qq = 0, kk = 0;
  for (int64_t i = 0; i < dim; ++i) {
    qq += double{q[i]} * q[i];
    kk += double{k[i]} * k[i];
  }
  const double qk_norms = std::sqrt(qq * kk);  // |q| |k|
  for (RopePairing pairing : {RopePairing::kHalfSplit, RopePairing::kInterleaved}) {
    for (bool yarn : {false, true}) {
      RopeConfig cfg = cfg_of(dim, 1e6, pairing);
      if (yarn) cfg.scaling = yarn_scaling(4.0, 32768);
      const Rope rope = make_rope(cfg);
      const double af2 = rope.attention_factor() * rope.attention_factor();
      auto dot_at = [&](int64_t m, int64_t n) {
        auto qm = q, kn = k;
        EXPECT_TRUE(rope.apply(attnkit::make_view(qm.data(), DType::kF32, {1, 1, 1, dim}),
                               std::vector<int64_t>{m})
                        .ok());
        EXPECT_TRUE(rope.apply(attnkit::make_view(kn.data(), DType::kF32, {1, 1, 1, dim}),
                               std::vector<int64_t>{n})
                        .ok());
        double d = 0;
        for (int64_t i = 0; i < dim; ++i) d += double{qm[i]} * double{kn[i]};
        return d;
      };
      // Each rotated element carries one float rounding (relative u), so by
      // Cauchy-Schwarz a product is off by at most 2 u af^2 |q||k| from the
      // exact one, twice that between two products; angles (<= 2e5 rad)
      // add ~1e-10 relative.
      const double bound = (4.0 * kUnit32 + 1e-9) * af2 * qk_norms;
      for (int64_t delta : {0, 1, 17, -5, 1000}) {
        const double base = dot_at(50 + delta, 50);
        for (int64_t shift : {1, 999, 123456}) {
          const double shifted = dot_at(50 + delta + shift, 50 + shift);
          EXPECT_NEAR(shifted, base, bound) << "delta " << delta << " shift " << shift;
        }
      }
      // And it does depend on m - n (a no-op rotation would pass the above).
      EXPECT_GT(std::fabs(dot_at(60, 50) - dot_at(50, 50)), 100 * bound);
    }
  }
}

TEST(RopeApply, YarnAttentionFactorScalesCosAndSin) {
  // Qwen-style YaRN (factor 4, no mscale): cos and sin carry 1 + 0.1 ln 4,
  // so even position 0 scales x by it.
  const int64_t batch = 2, seq = 4, heads = 2, dim = 128;
  Rng rng(14);
  RopeConfig cfg = cfg_of(dim, 1e6);
  cfg.scaling = yarn_scaling(4.0, 32768);
  const Rope rope = make_rope(cfg);
  const double af = 1.0 + 0.1 * std::log(4.0);
  StridedX x(batch, seq, heads, dim);
  const auto x0 = attnkit_test::uniform_vector(batch * seq * heads * dim, rng);
  x.set_logical(x0);
  const std::vector<int64_t> pos = {0, 3, 40000, 1000000};
  ASSERT_TRUE(rope.apply(x.view, pos).ok());
  // Frequencies come from Rope (checked against the formulas below); the
  // rotation and the factor are the reference's own.
  const std::vector<double> f(rope.inv_freq().begin(), rope.inv_freq().end());
  const auto want = ref_apply(x0, batch, seq, heads, dim, dim, RopePairing::kHalfSplit, f, af,
                              [&](int64_t, int64_t s) { return pos[s]; });
  EXPECT_TRUE(attnkit_test::all_close("yarn rope(x)", x.logical(), want,
                                      rope_tolerance(max_abs(x0), af, 1e6)));
}

TEST(RopeApply, LargestPositionIsAcceptedAndPreservesNorm) {
  const int64_t dim = 8;
  const Rope rope = make_rope(cfg_of(dim, 10000.0, RopePairing::kInterleaved));
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const auto x0 = x;
  ASSERT_TRUE(rope.apply(attnkit::make_view(x.data(), DType::kF32, {1, 1, 1, dim}),
                         std::vector<int64_t>{(int64_t{1} << 53) - 1})
                  .ok());
  for (int i = 0; i < dim; i += 2) {
    const double before = std::hypot(double{x0[i]}, double{x0[i + 1]});
    const double after = std::hypot(double{x[i]}, double{x[i + 1]});
    EXPECT_NEAR(after, before, 4 * kUnit32 * before) << "pair " << i / 2;
  }
}

TEST(RopeApply, EmptyTensorsAreAccepted) {
  const Rope rope = make_rope(cfg_of(4));
  float dummy[4] = {1, 2, 3, 4};
  EXPECT_TRUE(rope.apply(attnkit::make_view(dummy, DType::kF32, {0, 3, 1, 4}),
                         std::vector<int64_t>{0, 1, 2})
                  .ok());
  EXPECT_TRUE(rope.apply(attnkit::make_view(dummy, DType::kF32, {2, 0, 1, 4}), {}).ok());
  EXPECT_EQ(dummy[0], 1.0f);
}

// ---------------------------------------------------------------- frequencies

TEST(RopeFreq, DefaultIsThetaPowerAndRotaryDimDefaultsToHeadDim) {
  const Rope rope = make_rope(cfg_of(128));
  EXPECT_EQ(rope.rotary_dim(), 128);
  EXPECT_EQ(rope.attention_factor(), 1.0);
  ASSERT_EQ(rope.inv_freq().size(), 64u);
  EXPECT_EQ(rope.inv_freq()[0], 1.0);
  EXPECT_NEAR(rope.inv_freq()[32], 0.01, 1e-17);  // 10000^(-64/128)
  const auto want = ref_inv_freq(10000.0, 128);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(rope.inv_freq()[i], want[i], 16 * kEps64 * want[i]) << i;
  // Partial: the exponent's denominator is rotary_dim, not head_dim.
  const Rope partial = make_rope(cfg_of(80, 10000.0, RopePairing::kHalfSplit, 20));
  ASSERT_EQ(partial.inv_freq().size(), 10u);
  EXPECT_NEAR(partial.inv_freq()[5], 0.01, 1e-17);
}

TEST(RopeFreq, LinearDividesEveryFrequency) {
  RopeConfig cfg = cfg_of(64);
  cfg.scaling = scaling_of(RopeScaling::Type::kLinear, 0.5);  // < 1 is legal for linear
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(10000.0, 64);
  for (size_t i = 0; i < base.size(); ++i)
    EXPECT_NEAR(rope.inv_freq()[i], base[i] * 2.0, 32 * kEps64 * base[i]) << i;
  EXPECT_EQ(rope.attention_factor(), 1.0);
}

TEST(RopeFreq, Llama31MatchesHandComputedBands) {
  // Llama-3.1-8B: theta 500000, head_dim 128, rope_scaling {llama3, factor 8,
  // low_freq_factor 1, high_freq_factor 4, original 8192}. Wavelength
  // 2*pi*500000^(2i/128) < 8192/4 = 2048 for i <= 28 (kept), > 8192/1 for
  // i >= 35 (divided by 8); i = 29..34 blend with
  // s = (8192 / wavelen - 1) / (4 - 1).
  RopeConfig cfg = cfg_of(128, 500000.0);
  cfg.scaling = llama3_scaling(8.0, 1.0, 4.0, 8192);
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(500000.0, 128);
  ASSERT_EQ(rope.inv_freq().size(), 64u);
  for (size_t i = 0; i < 64; ++i) {
    double want;
    if (i <= 28) {
      want = base[i];
    } else if (i >= 35) {
      want = base[i] / 8.0;
    } else {
      const double wavelen = 2 * std::numbers::pi / base[i];
      const double s = (8192.0 / wavelen - 1.0) / 3.0;
      ASSERT_GT(s, 0.0);
      ASSERT_LT(s, 1.0);
      want = base[i] * ((1 - s) / 8.0 + s);
    }
    EXPECT_NEAR(rope.inv_freq()[i], want, 64 * kEps64 * want) << "pair " << i;
  }
  // Spot values: pair 32 has wavelength 2*pi*sqrt(500000) = 4442.88,
  // s = 0.2812826, so its frequency is (0.71/8 + 0.28) of the base one.
  EXPECT_NEAR(rope.inv_freq()[32] / base[32], (1 - 0.28128260516) / 8 + 0.28128260516, 1e-10);
  EXPECT_EQ(rope.attention_factor(), 1.0);
}

TEST(RopeFreq, Llama3WithEqualFactorsHasNoBlendBand) {
  // Llama-4-Scout: theta 500000, rotary 128, llama3 {factor 16,
  // low_freq_factor 1, high_freq_factor 1, original 8192}: pairs whose
  // wavelength passes 8192 are divided by 16, the others kept; nothing
  // blends (transformers would divide 0 by 0 only at exactly 8192).
  RopeConfig cfg = cfg_of(128, 500000.0);
  cfg.scaling = llama3_scaling(16.0, 1.0, 1.0, 8192);
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(500000.0, 128);
  int divided = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / base[i];
    const double want = wavelen > 8192.0 ? base[i] / 16.0 : base[i];
    divided += wavelen > 8192.0;
    EXPECT_NEAR(rope.inv_freq()[i], want, 64 * kEps64 * want) << "pair " << i;
  }
  EXPECT_EQ(divided, 29);  // pairs 35..63
}

RopeConfig deepseek_v3_rope() {
  RopeConfig cfg = cfg_of(64, 10000.0, RopePairing::kInterleaved);
  cfg.scaling = yarn_scaling(40.0, 4096, 1.0, 1.0);
  cfg.scaling.beta_fast = 32.0;
  cfg.scaling.beta_slow = 1.0;
  return cfg;
}

TEST(RopeFreq, YarnDeepSeekV3MatchesHandComputedRamp) {
  // d = 64, theta 1e4, original 4096: correction dims
  //   beta_fast 32: 64 ln(4096 / (64 pi)) / (2 ln 1e4) = 10.47 -> floor 10
  //   beta_slow 1:  64 ln(4096 / (2 pi))  / (2 ln 1e4) = 22.51 -> ceil 23
  // so pairs 0..10 keep their frequency, 23..31 are divided by 40 and
  // ramp = (i - 10) / 13 blends in between.
  const Rope rope = make_rope(deepseek_v3_rope());
  const auto base = ref_inv_freq(10000.0, 64);
  ASSERT_EQ(rope.inv_freq().size(), 32u);
  for (size_t i = 0; i < 32; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - 10.0) / 13.0, 0.0, 1.0);
    const double want = base[i] / 40.0 * ramp + base[i] * (1.0 - ramp);
    EXPECT_NEAR(rope.inv_freq()[i], want, 64 * kEps64 * want) << "pair " << i;
  }
  // mla.md's checks: pair 0 kept, last pair divided by 40.
  EXPECT_EQ(rope.inv_freq()[0], 1.0);
  EXPECT_NEAR(rope.inv_freq()[31], base[31] / 40.0, 64 * kEps64 * base[31]);
  // mscale == mscale_all_dim: the cos/sin factor is exactly 1.
  EXPECT_EQ(rope.attention_factor(), 1.0);
}

TEST(RopeFreq, YarnBoundsAreFloorAndCeil) {
  // Qwen-style YaRN (factor 4, no mscale) on a Llama-2-shaped head: d = 128,
  // theta 1e4, original 4096. Correction dims 20.94 (beta_fast 32) and 45.03
  // (beta_slow 1): low = floor = 20 and high = ceil = 46, where rounding
  // would give 21 and 45.
  RopeConfig cfg = cfg_of(128);
  cfg.scaling = yarn_scaling(4.0, 4096);
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(10000.0, 128);
  ASSERT_EQ(rope.inv_freq().size(), 64u);
  for (size_t i = 0; i < 64; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - 20.0) / 26.0, 0.0, 1.0);
    const double want = base[i] / 4.0 * ramp + base[i] * (1.0 - ramp);
    EXPECT_NEAR(rope.inv_freq()[i], want, 64 * kEps64 * want) << "pair " << i;
  }
  EXPECT_NEAR(rope.attention_factor(), 1.0 + 0.1 * std::log(4.0), 1e-15);

  // Clamping: theta 2, d 64, original 55 puts the correction dims at -59.8
  // and 100.2, so low = 0 and high = min(101, d - 1) = 63.
  RopeConfig wide = cfg_of(64, 2.0);
  wide.scaling = yarn_scaling(4.0, 55);
  const Rope clamped = make_rope(wide);
  const auto base2 = ref_inv_freq(2.0, 64);
  for (size_t i = 0; i < 32; ++i) {
    const double ramp = static_cast<double>(i) / 63.0;
    const double want = base2[i] / 4.0 * ramp + base2[i] * (1.0 - ramp);
    EXPECT_NEAR(clamped.inv_freq()[i], want, 64 * kEps64 * want) << "pair " << i;
  }
}

TEST(RopeFreq, YarnFactorOneLeavesFrequenciesUnchanged) {
  RopeConfig cfg = deepseek_v3_rope();
  cfg.scaling.factor = 1.0;
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(10000.0, 64);
  for (size_t i = 0; i < base.size(); ++i)
    EXPECT_NEAR(rope.inv_freq()[i], base[i], 16 * kEps64 * base[i]) << i;
  EXPECT_EQ(rope.attention_factor(), 1.0);
}

TEST(RopeFreq, YarnAttentionFactorRules) {
  auto af = [](double factor, double mscale, double mscale_all_dim, double explicit_af) {
    RopeConfig cfg = deepseek_v3_rope();
    cfg.scaling.factor = factor;
    cfg.scaling.mscale = mscale;
    cfg.scaling.mscale_all_dim = mscale_all_dim;
    cfg.scaling.attention_factor = explicit_af;
    return make_rope(cfg).attention_factor();
  };
  // Qwen-style: no mscale -> 0.1 ln(factor) + 1.
  EXPECT_NEAR(af(4, 0, 0, 0), 1.138629436111989, 1e-15);
  // DeepSeek-V2 (0.707 / 0.707) and V3 (1 / 1): ratio 1.
  EXPECT_NEAR(af(40, 0.707, 0.707, 0), 1.0, 1e-15);
  // Different mscales: (0.1 ln 40 + 1) / (0.0707 ln 40 + 1).
  EXPECT_NEAR(af(40, 1.0, 0.707, 0), 1.0857263992561355, 1e-14);
  // Only one of the two given: falls back to get_mscale(factor).
  EXPECT_NEAR(af(40, 0.707, 0, 0), 0.1 * std::log(40.0) + 1, 1e-15);
  EXPECT_NEAR(af(40, 0, 0.707, 0), 0.1 * std::log(40.0) + 1, 1e-15);
  // An explicit attention_factor wins.
  EXPECT_EQ(af(40, 1.0, 0.707, 0.5), 0.5);
  // factor 1: nothing to correct.
  EXPECT_EQ(af(1, 0, 0, 0), 1.0);
}

TEST(RopeFreq, YarnEqualBoundsUseTheGuard) {
  // original 6 (< 2 pi): both correction dims are in (-1, 0], so
  // low = high = 0 and the ramp's +0.001 guard applies: pair 0 kept, all
  // others divided by the factor. Without the guard pair 0 would be 0/0.
  RopeConfig cfg = deepseek_v3_rope();
  cfg.scaling.original_max_position_embeddings = 6;
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(10000.0, 64);
  EXPECT_EQ(rope.inv_freq()[0], 1.0);
  for (size_t i = 1; i < 32; ++i)
    EXPECT_NEAR(rope.inv_freq()[i], base[i] / 40.0, 64 * kEps64 * base[i]) << i;
}

TEST(RopeFreq, YarnKimiK2EqualBetasAreAccepted) {
  // Kimi-K2 ships beta_fast = beta_slow = 1 (theta 5e4, factor 32): corr = 19.16,
  // so low = 19, high = 20: pairs <= 19 kept, >= 20 divided by 32.
  RopeConfig cfg = deepseek_v3_rope();
  cfg.theta = 50000.0;
  cfg.scaling.factor = 32.0;
  cfg.scaling.beta_fast = 1.0;
  cfg.scaling.beta_slow = 1.0;
  const Rope rope = make_rope(cfg);
  const auto base = ref_inv_freq(50000.0, 64);
  for (size_t i = 0; i < 32; ++i) {
    const double want = i <= 19 ? base[i] : base[i] / 32.0;
    EXPECT_NEAR(rope.inv_freq()[i], want, 64 * kEps64 * want) << i;
  }
}

// ---------------------------------------------------------------- errors

void expect_create_error(const RopeConfig& cfg, const std::string& field) {
  auto r = Rope::create(cfg);
  ASSERT_FALSE(r.ok()) << "accepted a config with bad " << field;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(field), std::string::npos)
      << "message does not name " << field << ": " << r.status().message();
  EXPECT_NE(r.status().message().find("Rope::create"), std::string::npos) << r.status().message();
}

TEST(RopeErrors, CreateRejectsEveryBadField) {
  const double inf = INFINITY, nan = NAN;
  expect_create_error(cfg_of(0), "head_dim");
  expect_create_error(cfg_of(-4), "head_dim");
  expect_create_error(cfg_of(8, 1e4, RopePairing::kHalfSplit, 3), "rotary_dim");
  expect_create_error(cfg_of(8, 1e4, RopePairing::kHalfSplit, 10), "rotary_dim");
  expect_create_error(cfg_of(8, 1e4, RopePairing::kHalfSplit, -2), "rotary_dim");
  expect_create_error(cfg_of(7), "rotary_dim");  // odd head_dim, full rotary
  expect_create_error(cfg_of(8, 1.0), "theta");
  expect_create_error(cfg_of(8, 0.5), "theta");
  expect_create_error(cfg_of(8, inf), "theta");
  expect_create_error(cfg_of(8, nan), "theta");
  expect_create_error(cfg_of(8, 1e4, static_cast<RopePairing>(7)), "pairing");

  auto with = [](RopeScaling s) {
    RopeConfig c = cfg_of(64);
    c.scaling = s;
    return c;
  };
  using T = RopeScaling::Type;
  expect_create_error(with(scaling_of(static_cast<T>(9), 1.0)), "scaling.type");
  expect_create_error(with(scaling_of(T::kLinear, 0.0)), "scaling.factor");
  expect_create_error(with(scaling_of(T::kLinear, -2.0)), "scaling.factor");
  expect_create_error(with(scaling_of(T::kLinear, nan)), "scaling.factor");
  const RopeScaling llama3 = llama3_scaling(8, 1, 4, 8192);
  ASSERT_TRUE(Rope::create(with(llama3)).ok());
  auto l = llama3;
  l.factor = 0.5;
  expect_create_error(with(l), "scaling.factor");
  l = llama3;
  l.factor = inf;
  expect_create_error(with(l), "scaling.factor");
  l = llama3;
  l.original_max_position_embeddings = 0;
  expect_create_error(with(l), "scaling.original_max_position_embeddings");
  l = llama3;
  l.high_freq_factor = 0.5;  // below low_freq_factor = 1
  expect_create_error(with(l), "scaling.high_freq_factor");
  l = llama3;
  l.low_freq_factor = 0.0;
  expect_create_error(with(l), "scaling.low_freq_factor");
  l = llama3;
  l.high_freq_factor = nan;
  expect_create_error(with(l), "scaling.high_freq_factor");

  const RopeScaling yarn = deepseek_v3_rope().scaling;
  ASSERT_TRUE(Rope::create(with(yarn)).ok());
  auto y = yarn;
  y.factor = 0.9;
  expect_create_error(with(y), "scaling.factor");
  y = yarn;
  y.original_max_position_embeddings = -1;
  expect_create_error(with(y), "scaling.original_max_position_embeddings");
  y = yarn;
  y.beta_fast = 0.5;  // below beta_slow = 1
  expect_create_error(with(y), "scaling.beta_fast");
  y = yarn;
  y.beta_slow = 0.0;
  expect_create_error(with(y), "scaling.beta_slow");
  y = yarn;
  y.mscale = -1.0;
  expect_create_error(with(y), "scaling.mscale");
  y = yarn;
  y.mscale_all_dim = nan;
  expect_create_error(with(y), "scaling.mscale_all_dim");
  y = yarn;
  y.attention_factor = inf;
  expect_create_error(with(y), "scaling.attention_factor");
  // kNone ignores the scaling fields.
  EXPECT_TRUE(Rope::create(with(scaling_of(T::kNone, -1))).ok());
}

void expect_apply_error(const Rope& rope, TensorView x, const std::vector<int64_t>& pos,
                        const std::string& field) {
  std::vector<float> before;
  if (x.data && x.dtype == DType::kF32) {
    const float* p = x.ptr<float>();
    before.assign(p, p + 64);
  }
  const auto st = rope.apply(x, pos);
  ASSERT_FALSE(st.ok()) << "accepted bad " << field;
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(field), std::string::npos)
      << "message does not name " << field << ": " << st.message();
  EXPECT_NE(st.message().find("Rope::apply"), std::string::npos) << st.message();
  if (!before.empty()) {
    const float* p = x.ptr<float>();
    EXPECT_TRUE(std::equal(before.begin(), before.end(), p)) << "x changed on failure";
  }
}

TEST(RopeErrors, ApplyRejectsBadInputsAndWritesNothing) {
  const Rope rope = make_rope(cfg_of(4));
  Rng rng(15);
  auto buf = attnkit_test::uniform_vector(64, rng);
  auto view = [&](std::initializer_list<int64_t> shape, DType dt = DType::kF32) {
    return attnkit::make_view(buf.data(), dt, shape);
  };
  const std::vector<int64_t> pos4 = {0, 1, 2, 3};
  expect_apply_error(rope, TensorView{}, pos4, "x is missing");
  expect_apply_error(rope, view({4, 4, 4}), pos4, "rank");
  expect_apply_error(rope, view({1, 4, 2, 4}, DType::kBF16), pos4, "x.dtype");
  expect_apply_error(rope, view({1, 4, 2, 8}), pos4, "head_dim");
  auto neg = view({1, 4, 2, 4});
  neg.strides[1] = -8;
  expect_apply_error(rope, neg, pos4, "x.strides[1]");
  auto bcast = view({2, 4, 2, 4});
  bcast.strides[0] = 0;
  expect_apply_error(rope, bcast, {0, 1, 2, 3}, "x.strides[0]");
  expect_apply_error(rope, view({2, 4, 2, 4}), {0, 1, 2}, "positions");
  expect_apply_error(rope, view({2, 4, 2, 4}), {0, 1, 2, 3, 4, 5, 6, 7, 8}, "positions");
  // A bad position after valid ones: nothing may be rotated before the
  // check reaches it.
  expect_apply_error(rope, view({2, 4, 2, 4}), {0, 1, 2, 3, 4, 5, 6, -1}, "positions[7] = -1");
  expect_apply_error(rope, view({1, 4, 2, 4}), {5, 6, 7, int64_t{1} << 53}, "positions[3]");
}

}  // namespace
