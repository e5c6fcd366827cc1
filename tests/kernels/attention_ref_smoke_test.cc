#include <gtest/gtest.h>

#include <cmath>

#include "attnkit/attention.h"

TEST(Sdpa, Smoke) {
  float q[2] = {1, 0}, k[4] = {1, 0, 0, 0}, v[4] = {1, 2, 3, 4}, out[2] = {};
  attnkit::AttentionOptions o;
  o.softmax_scale = 1.0f;
  auto st = attnkit::sdpa(attnkit::make_view(q, attnkit::DType::kF32, {1, 1, 1, 2}),
                          attnkit::make_view(k, attnkit::DType::kF32, {1, 2, 1, 2}),
                          attnkit::make_view(v, attnkit::DType::kF32, {1, 2, 1, 2}),
                          attnkit::make_view(out, attnkit::DType::kF32, {1, 1, 1, 2}), o);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_NEAR(out[0], w0 * 1 + (1 - w0) * 3, 1e-6);
}
