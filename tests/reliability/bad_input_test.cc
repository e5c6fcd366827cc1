// Bad inputs that docs/RELIABILITY.md lists and the per-module error tests
// do not already cover: each must fail with a message naming the argument,
// its value and the rule, and change nothing (outputs, caches).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"
#include "reliability/test_layers.h"

namespace {

using attnkit::DType;
using attnkit::KVCache;
using attnkit::Status;
using attnkit::StatusCode;
using attnkit::TensorView;

constexpr float kSentinel = 3.25f;

// KVCache::attend rejects an out whose rows share memory (the kernel's
// threads would write them concurrently), like sdpa does, and the cache
// keeps its length and contents.
TEST(ReliabilityBadInput, KVCacheAttendRejectsAnOutThatOverlapsItself) {
  auto cache = KVCache::create({1, 8, 1, 4});
  ASSERT_TRUE(cache.ok());
  std::vector<float> q(2 * 2 * 4, 0.5f), kv(2 * 4, 0.25f), out(2 * 2 * 4, kSentinel);
  const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {1, 2, 2, 4});
  const TensorView kvv = attnkit::make_view(kv.data(), DType::kF32, {1, 2, 1, 4});
  for (int axis : {1, 2, 3}) {
    TensorView ov = attnkit::make_view(out.data(), DType::kF32, {1, 2, 2, 4});
    ov.strides[axis] = 0;
    const Status st = cache->attend(qv, kvv, kvv, ov);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("KVCache::attend: out.strides[" + std::to_string(axis) + "] = 0"),
              std::string::npos)
        << st.message();
    EXPECT_EQ(cache->length(), 0);
    for (float x : out) EXPECT_EQ(x, kSentinel);
  }
  // The same views with distinct rows work.
  const TensorView ok = attnkit::make_view(out.data(), DType::kF32, {1, 2, 2, 4});
  EXPECT_TRUE(cache->attend(qv, kvv, kvv, ok).ok());
  EXPECT_EQ(cache->length(), 2);
}

// make_view over a shape whose strides overflow 64 bits is well defined
// (its strides saturate), and every entry point rejects the view.
TEST(ReliabilityBadInput, ViewsOfShapesWhoseStridesOverflow) {
  std::vector<float> buf(16, 1.0f), out(16, kSentinel);
  const int64_t big = int64_t{1} << 40;
  const TensorView k = attnkit::make_view(buf.data(), DType::kF32, {2, big, big, 4});
  EXPECT_EQ(k.strides[0], std::numeric_limits<int64_t>::max());
  const TensorView q = attnkit::make_view(buf.data(), DType::kF32, {2, 1, big, 4});
  const TensorView o = attnkit::make_view(out.data(), DType::kF32, {2, 1, big, 4});
  const Status st = attnkit::sdpa(q, k, k, o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("overflows"), std::string::npos) << st.message();
  for (float x : out) EXPECT_EQ(x, kSentinel);
}

// The layers reject an out whose elements share memory (a stride of 0 on a
// dim of size > 1), as sdpa does, and write nothing: otherwise their last
// write would win, and the result would depend on the write order.
TEST(ReliabilityBadInput, LayersRejectAnOutThatOverlapsItself) {
  attnkit_reliability::OwnedWeights attention_weights, moe_weights;
  attnkit::AttentionLayer layer = attnkit_reliability::make_attention_layer(
      attnkit_reliability::gqa_config(0), attention_weights, 7);
  const attnkit::MoeLayer moe = attnkit_reliability::make_moe_layer(moe_weights, 8);
  const int64_t T = 3;
  for (bool is_moe : {false, true}) {
    const int64_t hidden = is_moe ? moe.config().hidden_size : layer.config().hidden_size;
    std::vector<float> x(static_cast<size_t>(T * hidden), 0.5f), out(x.size(), kSentinel);
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {1, T, hidden});
    for (int axis : {1, 2}) {
      TensorView ov = attnkit::make_view(out.data(), DType::kF32, {1, T, hidden});
      ov.strides[axis] = 0;
      std::vector<std::pair<std::string, Status>> calls;
      if (is_moe) {
        calls.emplace_back("MoeLayer::forward", moe.forward(xv, ov));
      } else {
        calls.emplace_back("AttentionLayer::forward", layer.forward(xv, ov));
        calls.emplace_back("AttentionLayer::forward_qkv", layer.forward_qkv(xv, xv, xv, ov));
      }
      for (const auto& [fn, st] : calls) {
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << fn << ": " << st.to_string();
        EXPECT_NE(st.message().find(fn + ": out.strides[" + std::to_string(axis) + "] = 0"),
                  std::string::npos)
            << st.message();
      }
      for (float v : out) ASSERT_EQ(v, kSentinel);
    }
    // The same buffer as a plain row-major out works.
    const TensorView ok = attnkit::make_view(out.data(), DType::kF32, {1, T, hidden});
    EXPECT_TRUE((is_moe ? moe.forward(xv, ok) : layer.forward(xv, ok)).ok());
  }
}

// validate() rejects a subnormal softcap, which sdpa would reject on every
// forward call: a layer that can never run is not built.
TEST(ReliabilityBadInput, ConfigWithSubnormalSoftcapIsRejected) {
  attnkit::AttentionConfig c = attnkit_reliability::gqa_config(0);
  c.softcap = 1e-40f;
  const Status st = attnkit::validate(c);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("softcap = 1e-40 is subnormal"), std::string::npos) << st.message();
  EXPECT_FALSE(attnkit::AttentionLayer::create(c).ok());
  c.softcap = std::numeric_limits<float>::min();
  EXPECT_TRUE(attnkit::validate(c).ok());
}

}  // namespace
