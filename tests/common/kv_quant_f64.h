// The 8-bit KV storage types' rule (ops/kv_quant.h), written again for the
// tests from its definition: per block, scale = max |x| / code_max in fp32,
// the code the nearest representable value of x * (code_max / max |x|)
// (computed in fp32 as the caches compute it), value = code * scale. The
// E4M3 rounding here picks the nearest of the format's 253 finite values
// from a table, ties to the even code, rather than the library's exponent
// and mantissa arithmetic, so a test can hold one against the other.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attnkit/tensor.h"

namespace attnkit_test {

// The E4M3 value of codes 0 .. 0x7e (the non-negative finite ones).
inline const std::vector<double>& e4m3_magnitudes() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int code = 0; code <= 0x7e; ++code) {
      const int e = code >> 3, m = code & 7;
      t.push_back(e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
    }
    return t;
  }();
  return table;
}

// y rounded to the nearest E4M3 value, ties to even codes, saturating at 448.
inline double round_e4m3(double y) {
  const std::vector<double>& t = e4m3_magnitudes();
  const double a = std::fabs(y);
  size_t best = 0;
  for (size_t i = 1; i < t.size(); ++i) {
    const double d = std::fabs(t[i] - a), db = std::fabs(t[best] - a);
    if (d < db || (d == db && i % 2 == 0)) best = i;
  }
  return std::signbit(y) ? -t[best] : t[best];
}

// x[0, n) quantized and dequantized as an 8-bit cache stores it, blocks of
// `block` values (0 = one block).
inline std::vector<double> kv_dequantized(const float* x, int64_t n, attnkit::DType dtype,
                                          int64_t block = 0) {
  const bool fp8 = dtype == attnkit::DType::kFp8E4M3;
  const float code_max = fp8 ? 448.0f : 127.0f;
  if (block == 0) block = n;
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = std::min(n, b0 + block);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = b0; i < b1; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float inv = code_max / amax;
    for (int64_t i = b0; i < b1; ++i) {
      if (!finite) {
        out[i] = std::numeric_limits<double>::quiet_NaN();
      } else if (!std::isfinite(inv)) {
        out[i] = 0.0;
      } else {
        const float y = x[i] * inv;
        const double code =
            fp8 ? round_e4m3(y) : std::min(127.0, std::max(-127.0, double(std::nearbyint(y))));
        out[i] = code * double(amax / code_max);
      }
    }
  }
  return out;
}

}  // namespace attnkit_test
