// libFuzzer target: the bf16-weight GEMM's stream kernels
// (kernels/linear_bf16.h), each SIMD target's this CPU runs and the AMX
// tile kernel where the process has AMX, against a float64 loop, on
// fuzzer-chosen shapes (1-140 rows, 1-70 columns, depth 1-300), row
// strides, biases, thread counts and values.
//
// Two kinds of values, never both in one call:
//   specials   magnitudes up to 2^40 (no sum can overflow fp32), with NaN
//              and +-Inf placed in x and W by the input: each y must be
//              NaN, +Inf, -Inf or finite exactly where the float64 loop's
//              is, and a finite one within gamma(K + 1) of the sum of its
//              terms' magnitudes;
//   subnormal  values down to fp32's subnormals (in x, and W's bf16): the
//              kernels may count a product with a subnormal factor (x's
//              before or after its rounding) or a subnormal result as zero
//              (vdpbf16ps and the tiles do), so those products' magnitudes
//              widen the bound; and the tiles flush a running sum that
//              falls below FLT_MIN, which loses less than 2^-126 per step.
// And: nothing written outside y (the gaps between rows hold sentinels),
// the same bits at another thread count. x, W and y are allocated at
// exactly their extents, so ASan reports a vector read or write past them
// (the AMX tile loads are not instrumented: the kernel copies W's last,
// partial blocks instead of reading past W, which the values check covers).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/tensor.h"
#include "core/cpu_features.h"
#include "kernels/linear_bf16.h"

namespace {

using attnkit::bf16;
using attnkit::kernels::Bf16StreamKernel;

constexpr float kSentinel = -7777.25f;
constexpr double kMinNormal = 0x1p-126;

std::string g_case;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "linear_fuzz: %s (%s)\n", what.c_str(), g_case.c_str());
  std::abort();
}

std::vector<const Bf16StreamKernel*> kernels() {
  std::vector<const Bf16StreamKernel*> out;
  for (attnkit::SimdTarget t : attnkit::kAllSimdTargets)
    if (attnkit::kernels::bf16_stream_kernel(t) != nullptr && attnkit::simd_target_available(t))
      out.push_back(attnkit::kernels::bf16_stream_kernel(t));
  if (attnkit::kernels::bf16_stream_amx_kernel() != nullptr)
    out.push_back(attnkit::kernels::bf16_stream_amx_kernel());
  return out;
}

// 0 NaN, 1 +Inf, 2 -Inf, 3 finite.
int kind(double v) { return std::isnan(v) ? 0 : std::isinf(v) ? (v > 0 ? 1 : 2) : 3; }

bool subnormal(double v) { return v != 0.0 && std::fabs(v) < kMinNormal; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<const Bf16StreamKernel*> all = kernels();
  if (all.empty()) return 0;
  FuzzedDataProvider fdp(data, size);
  const Bf16StreamKernel& k = *all[fdp.ConsumeIntegralInRange<size_t>(0, all.size() - 1)];
  const int64_t rows = fdp.ConsumeIntegralInRange<int64_t>(1, fdp.ConsumeBool() ? 140 : 20);
  const int64_t out = fdp.ConsumeIntegralInRange<int64_t>(1, 70);
  const int64_t in = fdp.ConsumeIntegralInRange<int64_t>(1, 300);
  const int64_t ldx = in + fdp.ConsumeIntegralInRange<int64_t>(0, 5);
  const int64_t ldy = out + fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  const bool has_bias = fdp.ConsumeBool(), specials = fdp.ConsumeBool();
  const int threads = fdp.ConsumeIntegralInRange<int>(1, 3);
  const int exponent = fdp.ConsumeIntegralInRange<int>(0, 40);
  g_case = std::string(k.name) + " rows=" + std::to_string(rows) + " out=" + std::to_string(out) +
           " in=" + std::to_string(in) + " ldx=" + std::to_string(ldx) +
           " ldy=" + std::to_string(ldy) + " bias=" + std::to_string(has_bias) +
           " specials=" + std::to_string(specials) + " threads=" + std::to_string(threads);

  // A generator seeded by the input for the bulk; later bytes place the
  // special values.
  std::mt19937_64 next(fdp.ConsumeIntegral<uint64_t>());
  const auto value = [&] {
    const double u = static_cast<double>(next() >> 11) * 0x1p-53 * 2.0 - 1.0;
    // specials: up to 2^exponent; subnormal: spread down past 2^-126.
    const int e = specials ? exponent : -static_cast<int>(next() % 150);
    return static_cast<float>(std::ldexp(u, e));
  };
  std::vector<float> x(static_cast<size_t>((rows - 1) * ldx + in));
  std::vector<bf16> w(static_cast<size_t>(out * in));
  std::vector<float> bias(has_bias ? static_cast<size_t>(out) : 0);
  for (float& v : x) v = value();
  for (bf16& v : w) v = attnkit::float_to_bf16(value());
  for (float& v : bias) v = specials ? value() : static_cast<float>(next() % 3) - 1.0f;
  if (specials) {
    const float pick[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
    for (int i = fdp.ConsumeIntegralInRange<int>(0, 6); i > 0; --i) {
      const float v = pick[fdp.ConsumeIntegralInRange<int>(0, 2)];
      if (fdp.ConsumeBool())
        x[fdp.ConsumeIntegralInRange<size_t>(0, x.size() - 1)] = v;
      else
        w[fdp.ConsumeIntegralInRange<size_t>(0, w.size() - 1)] = attnkit::float_to_bf16(v);
    }
  }

  std::vector<float> y(static_cast<size_t>((rows - 1) * ldy + out), kSentinel);
  const auto run = [&](int t) {
    if (!attnkit::kernels::linear_bf16_stream(k, x.data(), ldx, w.data(),
                                              has_bias ? bias.data() : nullptr, y.data(), ldy, rows,
                                              out, in, t))
      fail("no scratch");
  };
  run(threads);

  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < out; ++n) {
      double exact = has_bias ? bias[n] : 0.0, magnitude = has_bias ? std::fabs(bias[n]) : 0.0;
      double flushable = 0.0;
      for (int64_t c = 0; c < in; ++c) {
        const double a = attnkit::bf16_to_float(attnkit::float_to_bf16(x[m * ldx + c]));
        const double b = attnkit::bf16_to_float(w[n * in + c]);
        const double p = a * b;
        exact += p;
        magnitude += std::fabs(p);
        // The AMX kernel's conversion of x also reads fp32 subnormals as
        // zero, even where they round up to bf16's smallest normal.
        if (subnormal(x[m * ldx + c]) || subnormal(a) || subnormal(b) || std::fabs(p) < kMinNormal)
          flushable += std::fabs(p);
      }
      const double got = y[m * ldy + n];
      const std::string at = "y[" + std::to_string(m) + ", " + std::to_string(n) +
                             "] = " + std::to_string(got) + ", exact " + std::to_string(exact);
      if (kind(got) != kind(exact)) fail("kind differs: " + at);
      if (kind(exact) != 3) continue;
      const double nu = static_cast<double>(in + 1) * 0x1p-24;
      // A running sum below FLT_MIN may be flushed (TDPBF16PS flushes its
      // results to zero) or lose what fp32's subnormals cannot hold: less
      // than 2^-126 at each of at most `in` steps.
      const double bound = nu / (1.0 - nu) * magnitude + flushable + in * kMinNormal;
      if (!(std::fabs(got - exact) <= bound)) fail("off by more than the bound: " + at);
    }
    if (m + 1 < rows)
      for (int64_t n = out; n < ldy; ++n)
        if (y[m * ldy + n] != kSentinel) fail("wrote between rows " + std::to_string(m));
  }

  const std::vector<float> first = y;
  std::fill(y.begin(), y.end(), kSentinel);
  run(threads % 3 + 1);
  if (std::memcmp(first.data(), y.data(), y.size() * sizeof(float)) != 0)
    fail("bits differ at another thread count");
  return 0;
}
