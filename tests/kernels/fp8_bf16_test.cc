// The exact fp8 E4M3 -> bf16 decoding of AMX's indexer
// (kernels/cpu/fp8_bf16.h): the table of every magnitude, the order in
// which the vector decoder writes its words, and the decoder itself on all
// 256 codes, bit for bit, against the E4M3 values computed here from the
// format's definition (1 sign, 4 exponent bits of bias 7, 3 mantissa bits;
// exponent 0 is subnormal; magnitude 0x7f is NaN, there is no infinity).
#include "kernels/cpu/fp8_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/indexer_amx.h"

namespace attnkit::kernels::cpu {
namespace {

double e4m3_value(int code) {
  const int e = (code >> 3) & 15, f = code & 7;
  const double magnitude = e == 0 ? std::ldexp(f / 8.0, -6) : std::ldexp(1.0 + f / 8.0, e - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof x);
  return x;
}

// AMX reads bf16 denormals as 0: the decoder must never produce one.
bool is_bf16_denormal(uint16_t bits) { return (bits & 0x7f80) == 0 && (bits & 0x7f) != 0; }

TEST(Fp8Bf16, EveryMagnitudeIsItsE4M3ValueInANormalBf16) {
  for (int m = 0; m < 128; ++m) {
    const uint16_t bits = fp8_e4m3_magnitude_bf16(m);
    EXPECT_FALSE(is_bf16_denormal(bits)) << m;
    if (m == 0x7f) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(bits)));
    } else {
      EXPECT_EQ(static_cast<double>(bf16_bits_to_float(bits)), e4m3_value(m)) << m;
    }
  }
}

TEST(Fp8Bf16, DecodedOrderIsAPermutationOfEachBlockOf64) {
  for (int64_t block = 0; block < 3; ++block) {
    std::vector<int> seen(64, 0);
    for (int64_t p = 0; p < 64; ++p) {
      const int64_t c = fp8_bf16_feature(block * 64 + p);
      ASSERT_GE(c, block * 64);
      ASSERT_LT(c, block * 64 + 64);
      ++seen[static_cast<size_t>(c - block * 64)];
    }
    EXPECT_EQ(seen, std::vector<int>(64, 1));
  }
}

// All 256 codes in four blocks of 64, in a scrambled order, so that a
// decoder whose permutation differed from fp8_bf16_feature would fail.
TEST(Fp8Bf16, DecoderWritesEveryCodeBitForBit) {
  // The vector decoder needs AVX512-VBMI, which the AMX form checks for.
  if (!indexer_amx_available()) GTEST_SKIP() << "no AMX + AVX512-VBMI here";
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 77 + 5);
  std::vector<uint16_t> out(256, 0xdead);
  fp8_bf16_decode(codes.data(), 256, out.data());
  std::vector<int> seen(256, 0);
  for (int64_t p = 0; p < 256; ++p) {
    const int code = codes[static_cast<size_t>(fp8_bf16_feature(p))];
    ++seen[static_cast<size_t>(code)];
    const uint16_t bits = out[static_cast<size_t>(p)];
    EXPECT_FALSE(is_bf16_denormal(bits)) << code;
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(bits))) << code;
    } else {
      // Bit for bit: the value, and the sign of zero (0x80 is -0).
      EXPECT_EQ(bits,
                static_cast<uint16_t>((code & 0x80) << 8 | fp8_e4m3_magnitude_bf16(code & 0x7f)))
          << code;
      EXPECT_EQ(static_cast<double>(bf16_bits_to_float(bits)), e4m3_value(code)) << code;
      EXPECT_EQ(std::signbit(bf16_bits_to_float(bits)), (code & 0x80) != 0) << code;
    }
  }
  EXPECT_EQ(seen, std::vector<int>(256, 1));  // every code went through
}

#if defined(__x86_64__) || defined(_M_X64)
// The in-order form on 64 codes at a time, with the chosen tables.
ATTNKIT_FP8_BF16_TARGET void decode_in_order(const Fp8Bf16Bytes& bytes, const uint8_t* codes,
                                             uint16_t* out) {
  const Fp8Bf16Tables t = fp8_bf16_tables(bytes);
  const __m512i order = _mm512_load_si512(kFp8Bf16Order.at);
  __m512i first, second;
  fp8_bf16_words_in_order(t, order, _mm512_loadu_si512(codes), &first, &second);
  _mm512_storeu_si512(out, first);
  _mm512_storeu_si512(out + 32, second);
}

// The in-order form (AMX decode's keys and values) puts code p at word p,
// bit for bit, for all 256 codes scrambled over four blocks; with
// kFp8Bf16Bytes480 the NaN codes are +-480 (0x43f0), the rest unchanged.
TEST(Fp8Bf16, InOrderDecoderWritesCodePAtWordP) {
  if (!indexer_amx_available()) GTEST_SKIP() << "no AMX + AVX512-VBMI here";
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 77 + 5);
  for (bool finite : {false, true}) {
    std::vector<uint16_t> out(256, 0xdead);
    for (int64_t b = 0; b < 256; b += 64)
      decode_in_order(finite ? kFp8Bf16Bytes480 : kFp8Bf16Bytes, codes.data() + b, out.data() + b);
    for (size_t p = 0; p < 256; ++p) {
      const int code = codes[p];
      const uint16_t sign = static_cast<uint16_t>((code & 0x80) << 8);
      const uint16_t want =
          (code & 0x7f) == 0x7f && finite
              ? static_cast<uint16_t>(sign | 0x43f0)
              : static_cast<uint16_t>(sign | fp8_e4m3_magnitude_bf16(code & 0x7f));
      EXPECT_EQ(out[p], want) << "code " << code << " finite " << finite;
    }
  }
  EXPECT_EQ(static_cast<double>(bf16_bits_to_float(0x43f0)), 480.0);
}
#endif

}  // namespace
}  // namespace attnkit::kernels::cpu
