// The AMX form of the lightning indexer's scores (kernels/indexer_amx.h),
// called directly: its scores against a float64 loop over the same E4M3
// codes, and the first-digit histogram it counts as it writes them against
// add_topk_histogram over those scores (the select sums the four
// interleaved histograms, so their sums per bin are compared). Random keys
// with NaN codes among them (the key then scores -inf); 64 heads (the
// weights kept in registers) and 40 (the generic form, with a partly empty
// head block); key counts that end in a partial 16-key group; contiguous
// and strided scales and code rows. Skipped where the CPU or the OS offers
// no AMX.
#include "kernels/indexer_amx.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/random.h"
#include "kernels/cpu/fp8_bf16.h"
#include "kernels/sparse.h"

namespace attnkit::kernels {
namespace {

using attnkit_test::Rng;

double e4m3_value(int code) {
  const int e = (code >> 3) & 15, f = code & 7;
  const double magnitude = e == 0 ? std::ldexp(f / 8.0, -6) : std::ldexp(1.0 + f / 8.0, e - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

// A random E4M3 code that is not NaN.
uint8_t finite_code(Rng& rng) {
  const auto c = static_cast<uint8_t>(rng.integer(0, 253));
  return (c & 0x7f) == 0x7f ? static_cast<uint8_t>(c - 1) : c;
}

std::vector<uint32_t> digit_sums(const std::vector<uint32_t>& hist) {
  std::vector<uint32_t> sums(2048, 0);
  for (int64_t set = 0; set < 4; ++set)
    for (int64_t b = 0; b < 2048; ++b)
      sums[static_cast<size_t>(b)] += hist[static_cast<size_t>(set * 2048 + b)];
  return sums;
}

TEST(IndexerAmx, ScoresMatchAFloat64LoopAndTheHistogramCountsThem) {
  if (!indexer_amx_available()) GTEST_SKIP() << "no AMX + AVX512-VBMI here";
  constexpr int64_t D = kAmxIndexerDim;
  struct Case {
    int64_t heads, count, code_stride, ks_stride;
  };
  Rng rng(91);
  for (const Case c : {Case{64, 1000, D, 1}, Case{64, 37, D + 4, 3}, Case{40, 250, D, 1},
                       Case{64, 16, D, 1}, Case{40, 5, D + 64, 2}}) {
    const int64_t hp = (c.heads + 15) / 16 * 16;
    std::vector<uint8_t> kc(static_cast<size_t>(c.count * c.code_stride), 0);
    for (int64_t n = 0; n < c.count; ++n)
      for (int64_t f = 0; f < D; ++f) {
        uint8_t code = finite_code(rng);
        if (rng.integer(0, 4999) == 0) code = rng.coin() ? 0x7f : 0xff;  // NaN: the key scores -inf
        kc[static_cast<size_t>(n * c.code_stride + f)] = code;
      }
    std::vector<uint8_t> qc(static_cast<size_t>(c.heads * D));
    for (auto& e : qc) e = finite_code(rng);
    // The query in the kernel's tile layout, as bf16 bits (E4M3 values are
    // bf16 values): slot (h, p) holds head h's feature fp8_bf16_feature(p).
    std::vector<uint16_t> q(static_cast<size_t>(indexer_amx_query_elems(c.heads)), 0);
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t p = 0; p < D; ++p) {
        const int code = qc[static_cast<size_t>(h * D + cpu::fp8_bf16_feature(p))];
        q[static_cast<size_t>(indexer_amx_query_index(h, p))] =
            static_cast<uint16_t>(((code & 0x80) << 8) | cpu::fp8_e4m3_magnitude_bf16(code & 0x7f));
      }
    std::vector<float> w(static_cast<size_t>(hp), 0.0f);
    for (int64_t h = 0; h < c.heads; ++h) w[static_cast<size_t>(h)] = rng.uniform(-1.0f, 1.0f);
    std::vector<float> ks(static_cast<size_t>(c.count * c.ks_stride), -1.0f);
    for (int64_t n = 0; n < c.count; ++n)
      ks[static_cast<size_t>(n * c.ks_stride)] = std::ldexp(rng.uniform(0.5f, 1.0f), -8);
    std::vector<uint16_t> keys(static_cast<size_t>(64 * D));
    std::vector<float> s(static_cast<size_t>(64 * hp)), score(static_cast<size_t>(c.count));
    std::vector<uint32_t> hist(static_cast<size_t>(kTopkHistogram), 0);
    ASSERT_TRUE(indexer_amx_scores(kc.data(), c.code_stride, c.count, q.data(), c.heads, w.data(),
                                   ks.data(), c.ks_stride, keys.data(), s.data(), score.data(),
                                   hist.data()));
    for (int64_t n = 0; n < c.count; ++n) {
      bool nan_key = false;
      double total = 0.0, magnitude = 0.0;
      for (int64_t h = 0; h < c.heads; ++h) {
        double dot = 0.0, abs_dot = 0.0;
        for (int64_t f = 0; f < D; ++f) {
          const int kcode = kc[static_cast<size_t>(n * c.code_stride + f)];
          nan_key |= (kcode & 0x7f) == 0x7f;
          const double term = e4m3_value(qc[static_cast<size_t>(h * D + f)]) * e4m3_value(kcode);
          dot += term;
          abs_dot += std::fabs(term);
        }
        total += w[static_cast<size_t>(h)] * std::max(dot, 0.0);
        magnitude += std::fabs(w[static_cast<size_t>(h)]) * abs_dot;
      }
      const double scale = ks[static_cast<size_t>(n * c.ks_stride)];
      const float got = score[static_cast<size_t>(n)];
      if (nan_key) {
        EXPECT_EQ(got, -std::numeric_limits<float>::infinity()) << "key " << n;
        continue;
      }
      // Exact products, fp32 sums: far inside 3e-6 of the terms' magnitude
      // (a 1e-4 error in the scale fails it).
      EXPECT_NEAR(got, total * scale, 3e-6 * magnitude * scale + 1e-30)
          << "heads " << c.heads << " key " << n;
    }
    std::vector<uint32_t> want(static_cast<size_t>(kTopkHistogram), 0);
    add_topk_histogram(score.data(), c.count, want.data());
    EXPECT_EQ(digit_sums(hist), digit_sums(want)) << "heads " << c.heads << " count " << c.count;
  }
}

// A bad key scale (not finite and > 0) is reported; the others are used.
TEST(IndexerAmx, ReportsABadKeyScale) {
  if (!indexer_amx_available()) GTEST_SKIP() << "no AMX + AVX512-VBMI here";
  constexpr int64_t D = kAmxIndexerDim, count = 40;
  std::vector<uint8_t> kc(static_cast<size_t>(count * D), 0x38);  // every value 1
  std::vector<uint16_t> q(static_cast<size_t>(indexer_amx_query_elems(16)), 0);
  std::vector<float> w(16, 1.0f), s(static_cast<size_t>(64 * 16)), score(count);
  std::vector<uint16_t> keys(static_cast<size_t>(64 * D));
  for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), NAN}) {
    std::vector<float> ks(count, 1.0f);
    ks[33] = bad;
    EXPECT_FALSE(indexer_amx_scores(kc.data(), D, count, q.data(), 16, w.data(), ks.data(), 1,
                                    keys.data(), s.data(), score.data(), nullptr))
        << bad;
  }
  std::vector<float> ks(count, 1.0f);
  EXPECT_TRUE(indexer_amx_scores(kc.data(), D, count, q.data(), 16, w.data(), ks.data(), 1,
                                 keys.data(), s.data(), score.data(), nullptr));
}

}  // namespace
}  // namespace attnkit::kernels
