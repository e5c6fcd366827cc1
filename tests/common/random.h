// Seeded random fills and a tolerance-aware comparison for tests.
//
// The generator is std::mt19937_64, whose output sequence the standard fixes,
// and the float conversions below are written out by hand (the standard
// distributions differ between library implementations), so a seed gives the
// same data on every platform.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace attnkit_test {

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}

  // Uniform in [lo, hi); 24 random bits, so every value is an exact float
  // when lo and hi are small powers of two apart.
  float uniform(float lo = -1.0f, float hi = 1.0f) {
    const double u = static_cast<double>(gen_() >> 40) * 0x1p-24;
    return static_cast<float>(lo + (static_cast<double>(hi) - lo) * u);
  }
  // Standard normal via Box-Muller.
  float normal(float mean = 0.0f, float stddev = 1.0f) {
    const double u1 = (static_cast<double>(gen_() >> 11) + 1.0) * 0x1p-53;  // (0, 1]
    const double u2 = static_cast<double>(gen_() >> 11) * 0x1p-53;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    return static_cast<float>(mean + stddev * z);
  }
  // Uniform integer in [lo, hi] (inclusive); modulo bias is irrelevant here.
  int64_t integer(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(gen_() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool coin(double p_true = 0.5) { return uniform(0.0f, 1.0f) < p_true; }

 private:
  std::mt19937_64 gen_;
};

inline void fill_uniform(std::span<float> x, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  for (float& e : x) e = rng.uniform(lo, hi);
}
inline void fill_normal(std::span<float> x, Rng& rng, float mean = 0.0f, float stddev = 1.0f) {
  for (float& e : x) e = rng.normal(mean, stddev);
}
inline std::vector<float> uniform_vector(size_t n, Rng& rng, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> x(n);
  fill_uniform(x, rng, lo, hi);
  return x;
}
inline std::vector<float> normal_vector(size_t n, Rng& rng, float mean = 0.0f,
                                        float stddev = 1.0f) {
  std::vector<float> x(n);
  fill_normal(x, rng, mean, stddev);
  return x;
}

// x rounded to the nearest bfloat16 (8 significant bits, ties to even),
// computed arithmetically rather than with the bit trick the library uses,
// so a test can check one against the other. NaN stays NaN; values that
// round past the largest bf16 become Inf, as in hardware.
inline float round_bf16(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  const double ax = std::fabs(static_cast<double>(x));
  int e;
  std::frexp(ax, &e);  // ax = m * 2^e, m in [0.5, 1)
  // Quantum of an 8-bit significand at this exponent; below FLT_MIN the
  // bf16 subnormal spacing 2^-133 applies.
  const int quantum_exp = std::max(e - 8, -133);
  const double r = std::ldexp(std::nearbyint(std::ldexp(ax, -quantum_exp)), quantum_exp);
  const double rounded = r > FLT_MAX ? HUGE_VAL : r;
  return static_cast<float>(std::signbit(x) ? -rounded : rounded);
}

inline std::vector<double> widen(std::span<const float> x) {
  return std::vector<double>(x.begin(), x.end());
}

// Elementwise bound |actual - expected| <= atol + rtol * |expected|.
struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
};

// Compares `actual` with `expected` element by element. NaN must match NaN
// and an infinity must match exactly; everything else must lie within the
// bound. On failure it names the worst element (largest error / bound), both
// values and the bound. `worst_ratio`, if given, receives max error / bound
// (<= 1 means pass) so callers can report how much headroom is left.
template <typename A, typename E>
::testing::AssertionResult all_close(const std::string& what, std::span<const A> actual,
                                     std::span<const E> expected, Tolerance tol,
                                     double* worst_ratio = nullptr) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure()
           << what << ": size " << actual.size() << " != expected " << expected.size();
  double worst = 0.0;
  size_t worst_i = 0;
  size_t mismatched_special = actual.size();  // first NaN/Inf mismatch
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = static_cast<double>(actual[i]);
    const double e = static_cast<double>(expected[i]);
    if (std::isnan(e) || std::isnan(a) || std::isinf(e) || std::isinf(a)) {
      const bool same = (std::isnan(e) && std::isnan(a)) || (a == e);
      if (!same && mismatched_special == actual.size()) mismatched_special = i;
      continue;
    }
    const double bound = tol.atol + tol.rtol * std::fabs(e);
    const double err = std::fabs(a - e);
    const double ratio = bound > 0.0 ? err / bound : (err > 0.0 ? HUGE_VAL : 0.0);
    if (ratio > worst) {
      worst = ratio;
      worst_i = i;
    }
  }
  if (worst_ratio) *worst_ratio = worst;
  std::ostringstream msg;
  msg.precision(9);
  if (mismatched_special != actual.size()) {
    const size_t i = mismatched_special;
    msg << what << "[" << i << "]: actual " << static_cast<double>(actual[i]) << ", expected "
        << static_cast<double>(expected[i]) << " (NaN/Inf must match exactly)";
    return ::testing::AssertionFailure() << msg.str();
  }
  const double a = actual.empty() ? 0.0 : static_cast<double>(actual[worst_i]);
  const double e = actual.empty() ? 0.0 : static_cast<double>(expected[worst_i]);
  msg << what << " worst element [" << worst_i << "]: actual " << a << ", expected " << e
      << ", |diff| " << std::fabs(a - e) << ", bound " << tol.atol + tol.rtol * std::fabs(e)
      << " (atol " << tol.atol << ", rtol " << tol.rtol << ")";
  if (worst > 1.0) return ::testing::AssertionFailure() << msg.str();
  return ::testing::AssertionSuccess() << msg.str();
}

template <typename A, typename E>
::testing::AssertionResult all_close(const std::string& what, const std::vector<A>& actual,
                                     const std::vector<E>& expected, Tolerance tol,
                                     double* worst_ratio = nullptr) {
  return all_close(what, std::span<const A>(actual), std::span<const E>(expected), tol,
                   worst_ratio);
}

}  // namespace attnkit_test
