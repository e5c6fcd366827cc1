// copy_weight_f32 / check_no_unexpected / WeightLoader. Conversions are
// checked against values decoded from the IEEE bit fields with ldexp in
// double, for every 16-bit pattern, not against the library's converters.
#include "io/weight_loader.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace attnkit {
namespace {

using io::check_no_unexpected;
using io::copy_weight_f32;
using io::WeightLoader;

constexpr const char* kFn = "TestLayer::load";

// binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
double f16_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f)
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (exp == 0)
    v = std::ldexp(mant, -14 - 10);
  else
    v = std::ldexp(1024 + mant, exp - 15 - 10);
  return sign ? -v : v;
}

// bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
double bf16_reference(uint16_t b) {
  const int sign = b >> 15, exp = (b >> 7) & 0xff, mant = b & 0x7f;
  double v;
  if (exp == 0xff)
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (exp == 0)
    v = std::ldexp(mant, -126 - 7);
  else
    v = std::ldexp(128 + mant, exp - 127 - 7);
  return sign ? -v : v;
}

// Same value, and NaN only where NaN is expected; -0 vs +0 compared by sign.
void expect_same(double want, float got, uint32_t pattern) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << "pattern 0x" << std::hex << pattern;
    return;
  }
  EXPECT_EQ(static_cast<double>(got), want) << "pattern 0x" << std::hex << pattern;
  EXPECT_EQ(std::signbit(got), std::signbit(want)) << "pattern 0x" << std::hex << pattern;
}

TEST(WeightLoader, F16AllBitPatternsExact) {
  std::vector<uint16_t> src(65536);
  for (uint32_t i = 0; i < 65536; ++i) src[i] = static_cast<uint16_t>(i);
  WeightMap w{{"x", make_view(src.data(), DType::kF16, {256, 256})}};
  Tensor t;
  ASSERT_TRUE(copy_weight_f32(w, "", "x", {256, 256}, "", kFn, &t).ok());
  ASSERT_TRUE(t.view().is_contiguous());
  for (uint32_t i = 0; i < 65536; ++i) expect_same(f16_reference(i), t.ptr<float>()[i], i);
  // Spot checks that the reference itself is right: smallest subnormal,
  // largest normal.
  EXPECT_EQ(f16_reference(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(f16_reference(0x7bff), 65504.0);
}

TEST(WeightLoader, Bf16AllBitPatternsExact) {
  std::vector<uint16_t> src(65536);
  for (uint32_t i = 0; i < 65536; ++i) src[i] = static_cast<uint16_t>(i);
  WeightMap w{{"x", make_view(src.data(), DType::kBF16, {65536})}};
  Tensor t;
  ASSERT_TRUE(copy_weight_f32(w, "", "x", {65536}, "", kFn, &t).ok());
  for (uint32_t i = 0; i < 65536; ++i) expect_same(bf16_reference(i), t.ptr<float>()[i], i);
  EXPECT_EQ(bf16_reference(0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(bf16_reference(0x3f80), 1.0);
}

TEST(WeightLoader, F32AndF64Values) {
  const float f32[4] = {1.5f, -0.0f, std::numeric_limits<float>::denorm_min(),
                        std::numeric_limits<float>::infinity()};
  WeightMap w{{"a", make_view(f32, DType::kF32, {2, 2})}};
  Tensor t;
  ASSERT_TRUE(copy_weight_f32(w, "", "a", {2, 2}, "", kFn, &t).ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(std::memcmp(&t.ptr<float>()[i], &f32[i], 4), 0) << i;
  }

  // f64 -> f32 rounds to nearest: 1 + 2^-24 is a tie (rounds to even, 1),
  // 1 + 3*2^-24 rounds up to 1 + 2^-22.
  const double f64[3] = {1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24),
                         -std::numeric_limits<double>::infinity()};
  w["b"] = make_view(f64, DType::kF64, {3});
  ASSERT_TRUE(copy_weight_f32(w, "", "b", {3}, "", kFn, &t).ok());
  EXPECT_EQ(t.ptr<float>()[0], 1.0f);
  EXPECT_EQ(t.ptr<float>()[1], 1.0f + std::ldexp(1.0f, -22));
  EXPECT_EQ(t.ptr<float>()[2], -std::numeric_limits<float>::infinity());
}

TEST(WeightLoader, F64BeyondF32RangeIsAnError) {
  const double f64[2] = {1.0, 1e300};
  WeightMap w{{"b", make_view(f64, DType::kF64, {2})}};
  Tensor t;
  Status s = copy_weight_f32(w, "", "b", {2}, "", kFn, &t);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("f32 range"), std::string::npos) << s.message();
  EXPECT_EQ(t.data(), nullptr);  // untouched
}

TEST(WeightLoader, StridedAndUnalignedSources) {
  // A transposed f64 view (strides {1, 3}) over a 3x4 buffer starting one
  // byte past an aligned address.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> dist(-2, 2);
  double vals[4][3];
  for (auto& row : vals)
    for (double& v : row) v = dist(rng);
  std::vector<unsigned char> raw(1 + sizeof vals);
  std::memcpy(raw.data() + 1, vals, sizeof vals);
  TensorView v;
  v.data = raw.data() + 1;
  v.dtype = DType::kF64;
  v.rank = 2;
  v.shape = {3, 4, 0, 0};
  v.strides = {1, 3, 0, 0};
  WeightMap w{{"t", v}};
  Tensor t;
  ASSERT_TRUE(copy_weight_f32(w, "", "t", {3, 4}, "", kFn, &t).ok());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j)
      EXPECT_EQ(t.ptr<float>()[i * 4 + j], static_cast<float>(vals[j][i])) << i << "," << j;

  // A broadcast bf16 view (stride 0 on the first dim) at an odd address.
  std::vector<unsigned char> raw16(1 + 2 * 3);
  const uint16_t b[3] = {0x3f80, 0xc000, 0x0001};  // 1, -2, smallest subnormal
  std::memcpy(raw16.data() + 1, b, sizeof b);
  TensorView bv;
  bv.data = raw16.data() + 1;
  bv.dtype = DType::kBF16;
  bv.rank = 3;
  bv.shape = {2, 1, 3, 0};
  bv.strides = {0, 3, 1, 0};
  w["b"] = bv;
  ASSERT_TRUE(copy_weight_f32(w, "", "b", {2, 1, 3}, "", kFn, &t).ok());
  const float want[3] = {1.0f, -2.0f, std::ldexp(1.0f, -133)};
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(t.ptr<float>()[r * 3 + j], want[j]);
}

// copy_weight_keep_bf16 (projection matrices): a bf16 source, strided and
// unaligned, is kept as bf16 bit for bit; every other dtype becomes f32 as
// copy_weight_f32 makes it.
TEST(WeightLoader, KeepBf16KeepsBf16AndConvertsTheRest) {
  std::vector<unsigned char> raw(1 + 2 * 6);
  const uint16_t b[6] = {0x3f80, 0xc000, 0x0001, 0x7fc1, 0xff80, 0x1234};
  std::memcpy(raw.data() + 1, b, sizeof b);
  TensorView bv;  // [3, 2] as the transpose of the buffer's [2, 3]
  bv.data = raw.data() + 1;
  bv.dtype = DType::kBF16;
  bv.rank = 2;
  bv.shape = {3, 2, 0, 0};
  bv.strides = {1, 3, 0, 0};
  std::vector<uint16_t> h = {0x3c00, 0xc000};  // f16 1, -2
  WeightMap w{{"b", bv}, {"h", make_view(h.data(), DType::kF16, {2})}};
  Tensor t;
  ASSERT_TRUE(io::copy_weight_keep_bf16(w, "", "b", {3, 2}, "", kFn, &t).ok());
  ASSERT_EQ(t.dtype(), DType::kBF16);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) EXPECT_EQ(t.ptr<bf16>()[i * 2 + j].bits, b[j * 3 + i]);
  ASSERT_TRUE(io::copy_weight_keep_bf16(w, "", "h", {2}, "", kFn, &t).ok());
  ASSERT_EQ(t.dtype(), DType::kF32);
  EXPECT_EQ(t.ptr<float>()[0], 1.0f);
  EXPECT_EQ(t.ptr<float>()[1], -2.0f);
  // Rules and messages are copy_weight_f32's.
  EXPECT_EQ(io::copy_weight_keep_bf16(w, "", "b", {2, 3}, "", kFn, &t).message(),
            copy_weight_f32(w, "", "b", {2, 3}, "", kFn, &t).message());
}

TEST(WeightLoader, RankZeroAndEmpty) {
  const float x = 3.0f;
  TensorView scalar;
  scalar.data = const_cast<float*>(&x);
  scalar.rank = 0;
  TensorView empty;  // no data needed for zero elements
  empty.rank = 2;
  empty.shape = {0, 5, 0, 0};
  empty.strides = {5, 1, 0, 0};
  WeightMap w{{"s", scalar}, {"e", empty}};
  Tensor t;
  ASSERT_TRUE(copy_weight_f32(w, "", "s", {}, "", kFn, &t).ok());
  EXPECT_EQ(t.rank(), 0);
  EXPECT_EQ(t.ptr<float>()[0], 3.0f);
  ASSERT_TRUE(copy_weight_f32(w, "", "e", {0, 5}, "", kFn, &t).ok());
  EXPECT_EQ(t.dim(0), 0);
  EXPECT_EQ(t.dim(1), 5);
}

TEST(WeightLoader, ShapeMismatchMessage) {
  std::vector<float> buf(32);
  WeightMap w{
      {"model.layers.0.self_attn.q_proj.weight", make_view(buf.data(), DType::kF32, {8, 4})}};
  Tensor t;
  Status s = copy_weight_f32(w, "model.layers.0.self_attn", "q_proj.weight", {8, 16},
                             "num_heads*head_dim, hidden_size", kFn, &t);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "TestLayer::load: weight 'model.layers.0.self_attn.q_proj.weight' has shape [8, 4], "
            "expected [8, 16] (num_heads*head_dim, hidden_size)");
  EXPECT_EQ(t.data(), nullptr);

  // Rank mismatch (same element count) is also a shape error.
  s = copy_weight_f32(w, "model.layers.0.self_attn.", "q_proj.weight", {32}, "", kFn, &t);
  EXPECT_EQ(s.message(),
            "TestLayer::load: weight 'model.layers.0.self_attn.q_proj.weight' has shape [8, 4], "
            "expected [32]");
}

TEST(WeightLoader, MissingWeightIsNotFound) {
  WeightMap w;
  Tensor t;
  Status s = copy_weight_f32(w, "p", "o_proj.weight", {2, 2}, "hidden_size, hidden_size", kFn, &t);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(),
            "TestLayer::load: weight 'p.o_proj.weight' is missing; expected shape [2, 2] "
            "(hidden_size, hidden_size)");
}

TEST(WeightLoader, RejectsNonFloatAndMalformedViews) {
  int32_t ints[4] = {};
  WeightMap w{{"i", make_view(ints, DType::kI32, {4})}};
  Tensor t;
  Status s = copy_weight_f32(w, "", "i", {4}, "", kFn, &t);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("dtype i32"), std::string::npos) << s.message();

  TensorView neg = make_view(ints, DType::kF32, {2, 2});
  neg.strides[0] = -2;
  w["n"] = neg;
  s = copy_weight_f32(w, "", "n", {2, 2}, "", kFn, &t);
  EXPECT_NE(s.message().find("strides[0] = -2"), std::string::npos) << s.message();

  TensorView null = make_view(static_cast<void*>(nullptr), DType::kF32, {2, 2});
  w["z"] = null;
  s = copy_weight_f32(w, "", "z", {2, 2}, "", kFn, &t);
  EXPECT_NE(s.message().find("no data"), std::string::npos) << s.message();

  TensorView huge = make_view(ints, DType::kF32, {2, 2});
  huge.strides[0] = int64_t{1} << 62;
  w["h"] = huge;
  s = copy_weight_f32(w, "", "h", {2, 2}, "", kFn, &t);
  EXPECT_NE(s.message().find("overflows"), std::string::npos) << s.message();
  EXPECT_EQ(t.data(), nullptr);
}

TEST(WeightLoader, UnexpectedNamesUnderPrefix) {
  float x = 0;
  const TensorView v = make_view(&x, DType::kF32, {1});
  WeightMap w{{"model.layers.0.self_attn.q_proj.weight", v},
              {"model.layers.0.self_attn.q_proj.bias", v},
              {"model.layers.0.self_attn_extra.weight", v},  // shares characters, not the prefix
              {"model.layers.1.self_attn.q_proj.weight", v}};
  EXPECT_TRUE(
      check_no_unexpected(w, "model.layers.0.self_attn", {"q_proj.weight", "q_proj.bias"}, kFn)
          .ok());
  Status s = check_no_unexpected(w, "model.layers.0.self_attn.", {"q_proj.weight"}, kFn);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "TestLayer::load: unexpected weight 'model.layers.0.self_attn.q_proj.bias' under "
            "'model.layers.0.self_attn.' (expected only: q_proj.weight; the buffers "
            "rotary_emb.inv_freq, .cos_cached and .sin_cached are ignored)");
  // An empty prefix covers every name.
  s = check_no_unexpected(w, "", {"model.layers.0.self_attn.q_proj.weight"}, kFn);
  EXPECT_NE(s.message().find("'model.layers.0.self_attn.q_proj.bias'"), std::string::npos);
}

TEST(WeightLoader, KnownBuffersAreSkippedOtherNamesAreNot) {
  // Exported state dicts of older transformers versions carry RoPE buffers
  // next to the projections; they are not weights.
  float x = 0;
  const TensorView v = make_view(&x, DType::kF32, {1});
  WeightMap w{{"l.q_proj.weight", v},
              {"l.rotary_emb.inv_freq", v},
              {"l.rotary_emb.cos_cached", v},
              {"l.rotary_emb.sin_cached", v}};
  EXPECT_TRUE(check_no_unexpected(w, "l", {"q_proj.weight"}, kFn).ok());
  // Only those exact names: another name under rotary_emb, or the buffer
  // name outside its module, is still an error.
  w.emplace("l.rotary_emb.scale", v);
  Status s = check_no_unexpected(w, "l", {"q_proj.weight"}, kFn);
  EXPECT_NE(s.message().find("unexpected weight 'l.rotary_emb.scale'"), std::string::npos)
      << s.message();
  WeightMap bare{{"l.q_proj.weight", v}, {"l.inv_freq", v}};
  EXPECT_FALSE(check_no_unexpected(bare, "l", {"q_proj.weight"}, kFn).ok());
}

TEST(WeightLoader, LoaderStagesAndChecksStrictly) {
  std::vector<float> q(6), o(4);
  for (int i = 0; i < 6; ++i) q[i] = static_cast<float>(i);
  WeightMap w{{"l.q_proj.weight", make_view(q.data(), DType::kF32, {3, 2})},
              {"l.o_proj.weight", make_view(o.data(), DType::kF32, {2, 2})},
              {"l.o_proj.bias", make_view(o.data(), DType::kF32, {2})}};
  WeightLoader loader(w, "l", kFn);
  Tensor wq, wo;
  ASSERT_TRUE(loader.load("q_proj.weight", {3, 2}, "out, in", &wq).ok());
  ASSERT_TRUE(loader.load("o_proj.weight", {2, 2}, "out, in", &wo).ok());
  EXPECT_TRUE(loader.contains("o_proj.bias"));
  EXPECT_FALSE(loader.contains("q_proj.bias"));
  Status s = loader.finish();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unexpected weight 'l.o_proj.bias'"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("expected only: q_proj.weight, o_proj.weight"), std::string::npos)
      << s.message();
  EXPECT_EQ(wq.ptr<float>()[5], 5.0f);

  Tensor bias;
  ASSERT_TRUE(loader.load("o_proj.bias", {2}, "hidden_size", &bias).ok());
  EXPECT_TRUE(loader.finish().ok());
}

}  // namespace
}  // namespace attnkit
