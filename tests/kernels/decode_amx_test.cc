// The AMX-INT8 products of multi-token decode over int8 K/V
// (kernels/cpu/decode_amx.h), called directly against float64 loops:
//  - amx_qk_i8 over keys read in place (cache rows apart, a prefetch
//    offset spread over the products) and over a copy with zero rows up to
//    32 keys: s = kscale qf (256 sum k hi + sum k lo), the queries' int16
//    rows split by amx_split_q;
//  - amx_pv_i8: o = alpha o + f sum_n w16 code, the int16 weights computed
//    here with the same fp32 steps the kernel's contract names, so that
//    the sums compare exactly and only fp32 rounding of the result is
//    allowed: a factor off by 1e-5, a column block or a key quad out of
//    place fails.
// Random codes over the full int8 range, value rows in any order and
// stride, key counts that end in a partial quad, block or tile, head dims
// whose last column block is partial, rows whose weights are all zero.
// Skipped where the CPU or the OS offers no AMX-INT8.
#include "kernels/cpu/decode_amx.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/random.h"
#include "kernels/amx.h"

namespace attnkit::kernels::cpu {
namespace {

using attnkit_test::Rng;

int8_t code(Rng& rng) { return static_cast<int8_t>(rng.integer(-128, 127)); }

TEST(DecodeAmx, Int8ScoresInPlaceAndCopiedMatchAFloat64Loop) {
  if (!amx_int8_available()) GTEST_SKIP() << "no AMX-INT8 tiles here";
  struct Case {
    int64_t nk, head_dim, stride;  // stride 0: a copy, rows kd apart
  };
  Rng rng(7);
  for (const Case c : {Case{64, 128, 1088}, Case{32, 64, 200}, Case{64, 256, 256}, Case{40, 128, 0},
                       Case{17, 96, 0}}) {
    const int64_t kd = (c.head_dim + 63) / 64 * 64, stride = c.stride > 0 ? c.stride : kd;
    const int64_t rows = (c.nk + 31) / 32 * 32, fetch = rows * stride;  // prefetch the next tile
    std::vector<int8_t> keys(static_cast<size_t>(2 * fetch), 0);
    for (int64_t n = 0; n < c.nk; ++n)
      for (int64_t d = 0; d < c.head_dim; ++d) keys[n * stride + d] = code(rng);
    const int64_t qt = (c.head_dim + 31) / 32 * 32;
    std::vector<int16_t> q16(static_cast<size_t>(16 * qt), 0);
    for (int64_t m = 0; m < 16; ++m)
      for (int64_t d = 0; d < c.head_dim; ++d)
        q16[m * qt + d] = static_cast<int16_t>(rng.integer(-kAmxQ16Max, kAmxQ16Max));
    std::vector<float> qf(16), kscale(static_cast<size_t>(c.nk));
    for (float& x : qf) x = rng.uniform(1e-5f, 1e-3f);
    for (float& x : kscale) x = rng.uniform(0.001f, 0.02f);
    std::vector<int8_t> hi(static_cast<size_t>(16 * kd)), lo(hi.size());
    std::vector<float> s(static_cast<size_t>(64 * 16), -1.0f);
    std::vector<int32_t> c32(1024);
    amx_split_q(q16.data(), qt, c.head_dim, hi.data(), lo.data(), kd);
    amx_tiles_begin();
    amx_qk_i8(keys.data(), c.nk, stride, kd, hi.data(), lo.data(), qf.data(), kscale.data(),
              s.data(), 16, c32.data(), c.stride > 0 ? fetch : 0);
    amx_tiles_end();
    for (int64_t n = 0; n < c.nk; ++n)
      for (int64_t m = 0; m < 16; ++m) {
        double dot = 0;
        for (int64_t d = 0; d < c.head_dim; ++d)
          dot += double(keys[n * stride + d]) * double(q16[m * qt + d]);
        const double want = dot * double(qf[m]) * double(kscale[n]);
        const double bound = 4e-7 * std::abs(want) + 1e-30;
        ASSERT_LE(std::abs(double(s[n * 16 + m]) - want), bound)
            << "nk " << c.nk << " head_dim " << c.head_dim << " key " << n << " row " << m;
      }
  }
}

TEST(DecodeAmx, Int8ValuesMatchAFloat64LoopOverTheirInt16Weights) {
  if (!amx_int8_available()) GTEST_SKIP() << "no AMX-INT8 tiles here";
  struct Case {
    int64_t nk, dv, stride;
  };
  Rng rng(11);
  for (const Case c : {Case{64, 128, 1088}, Case{64, 80, 96}, Case{40, 200, 256}, Case{17, 64, 64},
                       Case{1, 48, 48}, Case{63, 512, 520}}) {
    const int64_t dv_pad = (c.dv + 15) / 16 * 16;
    // Value rows in a shuffled order, as a page table may put them.
    std::vector<int8_t> v(static_cast<size_t>(c.nk * c.stride), 0);
    for (int8_t& x : v) x = code(rng);
    std::vector<int64_t> order(static_cast<size_t>(c.nk));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = c.nk - 1; i > 0; --i) std::swap(order[i], order[rng.integer(0, i)]);
    std::vector<const void*> rows(static_cast<size_t>(c.nk));
    std::vector<int64_t> fetch(static_cast<size_t>(c.nk), 0);
    for (int64_t n = 0; n < c.nk; ++n) rows[n] = v.data() + order[n] * c.stride;
    fetch[0] = c.stride;
    // Weights (key-major, 16 a key) in [0, 1], row 3 all zero; value scales.
    std::vector<float> s(static_cast<size_t>(c.nk * 16)), vscale(static_cast<size_t>(c.nk));
    for (int64_t n = 0; n < c.nk; ++n)
      for (int64_t m = 0; m < 16; ++m) s[n * 16 + m] = m == 3 ? 0.0f : rng.uniform(0.0f, 1.0f);
    for (float& x : vscale) x = rng.uniform(0.001f, 0.02f);
    std::vector<float> alpha(16), o(static_cast<size_t>(16 * dv_pad));
    for (float& x : alpha) x = rng.uniform(0.25f, 1.0f);
    for (float& x : o) x = rng.uniform(-4.0f, 4.0f);
    const std::vector<float> o0 = o;
    std::vector<int8_t> quads(static_cast<size_t>(64 * dv_pad)), w(2048);
    std::vector<int32_t> c32(2048);
    amx_tiles_begin();
    amx_pv_i8(rows.data(), fetch.data(), c.nk, c.dv, dv_pad, s.data(), 16, vscale.data(), o.data(),
              alpha.data(), quads.data(), w.data(), c32.data());
    amx_tiles_end();
    for (int64_t m = 0; m < 16; ++m) {
      // The int16 weights by the contract's fp32 steps.
      std::vector<float> wm(static_cast<size_t>(c.nk));
      float mx = 0.0f;
      for (int64_t n = 0; n < c.nk; ++n) mx = std::max(mx, wm[n] = s[n * 16 + m] * vscale[n]);
      const float inv = mx > 0.0f ? float(kAmxQ16Max) / mx : 0.0f;
      const float f = mx * (1.0f / float(kAmxQ16Max));
      for (int64_t col = 0; col < dv_pad; ++col) {
        int64_t sum = 0;
        for (int64_t n = 0; n < c.nk && col < c.dv; ++n)
          sum += static_cast<int64_t>(std::nearbyint(wm[n] * inv)) * v[order[n] * c.stride + col];
        const double want =
            double(alpha[m]) * double(o0[m * dv_pad + col]) + double(f) * double(sum);
        const double scale = double(alpha[m]) * std::abs(double(o0[m * dv_pad + col])) +
                             std::abs(double(f) * double(sum));
        ASSERT_LE(std::abs(double(o[m * dv_pad + col]) - want), 4e-7 * scale + 1e-30)
            << "nk " << c.nk << " dv " << c.dv << " row " << m << " column " << col;
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::kernels::cpu
