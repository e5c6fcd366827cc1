// Bad inputs that docs/RELIABILITY.md lists and the per-module error tests
// do not already cover: each must fail with a message naming the argument,
// its value and the rule, and change nothing (outputs, caches).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"

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

}  // namespace
