// The 8-bit KV storage types' rule (ops/kv_quant.h) and the E4M3
// conversions (attnkit/tensor.h) against kv_quant_f64.h, which computes the
// same rule independently: every E4M3 code, ties and saturation of the
// rounding, blocks, zero, tiny and non-finite rows, and the row layout.
#include "ops/kv_quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attnkit/kv_cache.h"
#include "common/kv_quant_f64.h"
#include "common/random.h"

namespace {

using attnkit::DType;

TEST(KvQuant, E4M3DecodesEveryCode) {
  const std::vector<double>& t = attnkit_test::e4m3_magnitudes();
  for (int code = 0; code < 256; ++code) {
    const float x = attnkit::fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      continue;
    }
    const double want = (code & 0x80) ? -t[code & 0x7f] : t[code & 0x7f];
    EXPECT_EQ(double(x), want) << code;
    EXPECT_EQ(std::signbit(x), (code & 0x80) != 0) << code;
  }
  EXPECT_EQ(attnkit::fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(attnkit::fp8_e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(attnkit::fp8_e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
}

TEST(KvQuant, E4M3RoundsToNearestEvenAndSaturates) {
  std::vector<float> xs;
  const std::vector<double>& t = attnkit_test::e4m3_magnitudes();
  for (size_t i = 0; i + 1 < t.size(); ++i) {
    const double mid = (t[i] + t[i + 1]) / 2;  // a tie: goes to the even code
    for (double x : {t[i], mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9)})
      xs.push_back(float(x));
  }
  for (float x : {448.0f, 460.0f, 464.0f, 470.0f, 1e30f, INFINITY, 1e-30f, 0.0f}) xs.push_back(x);
  attnkit_test::Rng rng(5);
  for (float x : attnkit_test::uniform_vector(2000, rng)) xs.push_back(x * 500.0f);
  for (float x : xs)
    for (float s : {x, -x}) {
      const uint8_t code = attnkit::float_to_fp8_e4m3(s);
      EXPECT_EQ(double(attnkit::fp8_e4m3_to_float(code)), attnkit_test::round_e4m3(s)) << s;
    }
  EXPECT_EQ(attnkit::float_to_fp8_e4m3(NAN) & 0x7f, 0x7f);
  EXPECT_EQ(attnkit::float_to_fp8_e4m3(-0.0f), 0x80);
}

TEST(KvQuant, RowsMatchTheRuleInEveryBlock) {
  attnkit_test::Rng rng(9);
  for (DType dtype : {DType::kI8, DType::kFp8E4M3})
    for (int64_t n : {1, 5, 64, 130})
      for (int64_t block : {0, 16, 64}) {
        SCOPED_TRACE(std::string(attnkit::dtype_name(dtype)) + " n=" + std::to_string(n) +
                     " block=" + std::to_string(block));
        std::vector<float> x = attnkit_test::uniform_vector(size_t(n), rng);
        if (n > 5) x[3] *= 300.0f;                  // an outlier in the first block
        if (n >= 64) x[size_t(n - 1)] = 0x1p-140f;  // a tiny value
        const int64_t blocks = block == 0 ? 1 : (n + block - 1) / block;
        // Strided input: every other float.
        std::vector<float> strided(size_t(2 * n), NAN);
        for (int64_t i = 0; i < n; ++i) strided[size_t(2 * i)] = x[size_t(i)];
        std::vector<uint8_t> codes(size_t(n), 0xee);
        std::vector<float> scales(size_t(blocks) + 1, -1.0f);
        attnkit::quantize_kv(strided.data(), 2, n, dtype, block, codes.data(), scales.data());
        EXPECT_EQ(scales[size_t(blocks)], -1.0f);  // nothing written past the blocks
        const std::vector<double> want = attnkit_test::kv_dequantized(x.data(), n, dtype, block);
        for (int64_t i = 0; i < n; ++i) {
          const float scale = scales[size_t(block == 0 ? 0 : i / block)];
          EXPECT_EQ(double(attnkit::kv_code_value(dtype, codes[size_t(i)])) * scale,
                    want[size_t(i)])
              << i;
          if (dtype == DType::kI8) {
            EXPECT_NE(codes[size_t(i)], 0x80) << "-128 is never written";
          }
        }
      }
}

TEST(KvQuant, ZeroTinyAndNonFiniteBlocks) {
  for (DType dtype : {DType::kI8, DType::kFp8E4M3}) {
    const float rows[4][3] = {
        {0.0f, -0.0f, 0.0f}, {1e-38f, -2e-38f, 0.0f}, {1.0f, NAN, 2.0f}, {1.0f, -INFINITY, 2.0f}};
    for (const auto& row : rows) {
      uint8_t codes[3] = {1, 1, 1};
      float scale = -1.0f;
      attnkit::quantize_kv(row, 1, 3, dtype, 0, codes, &scale);
      const bool finite = std::isfinite(row[1]);
      EXPECT_EQ(std::isnan(scale), !finite);
      if (finite) {
        EXPECT_EQ(scale, 0.0f);
      }
      for (uint8_t c : codes) EXPECT_EQ(c, 0);
    }
  }
}

TEST(KvQuant, RowLayoutPutsScalesAfterTheCodes) {
  // GQA 8 x 128: 1024 codes, 8 scales: 1056 bytes (a multiple of 32).
  attnkit::KvRowLayout l = attnkit::kv_row_layout(8, 128, DType::kI8);
  EXPECT_EQ(l.row, 1056);
  EXPECT_EQ(l.scale_offset, 1024);
  EXPECT_EQ(l.scales_per_head, 1);
  // MLA's latent row: 576 codes and 9 scales of 64 channels: 612 -> 640.
  l = attnkit::kv_row_layout(1, 576, DType::kFp8E4M3, attnkit::kLatentScaleBlock);
  EXPECT_EQ(l.row, 640);
  EXPECT_EQ(l.scale_offset, 576);
  EXPECT_EQ(l.scales_per_head, 9);
  // Odd sizes align the scales to 4 bytes; rows of whole 2 KiB are padded.
  EXPECT_EQ(attnkit::kv_row_layout(3, 5, DType::kI8).scale_offset, 16);
  EXPECT_EQ(attnkit::kv_row_layout(3, 5, DType::kI8).row, 32);
  EXPECT_EQ(attnkit::kv_row_layout(1, 2040, DType::kI8).row, 2048 + 64);
  EXPECT_EQ(attnkit::kv_row_layout(0, 8, DType::kI8).row, 0);
  EXPECT_EQ(attnkit::kv_row_layout(int64_t{1} << 62, 8, DType::kI8).row, 0);
  EXPECT_EQ(attnkit::kv_token_stride(8, 128, DType::kFp8E4M3), 1056);
}

}  // namespace
