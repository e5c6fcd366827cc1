// LinearStatePool and GatedDeltaNet::forward_batch: ragged steps that mix
// prompts, prompt chunks and decodes of several sequences, each in its own
// state slot, give what GatedDeltaNet::forward gives each sequence alone
// over the same rows with its own GatedDeltaNetState: bit for bit on the
// reference backend, within f32 rounding on the fast one (whose
// projections run as one GEMM over the step's rows). The layer itself is
// held to a float64 reference in gated_deltanet_test.cc. Fork copies a
// slot, remove frees it, and every bad call changes nothing.
#include "attnkit/linear_state_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/random.h"

namespace attnkit {
namespace {

using attnkit_test::Rng;

constexpr int64_t kHidden = 32;

GatedDeltaNetConfig config() {
  GatedDeltaNetConfig c;
  c.hidden_size = kHidden;
  c.num_k_heads = 2;
  c.num_v_heads = 4;
  c.key_head_dim = 16;
  c.value_head_dim = 8;
  c.conv_kernel = 4;
  return c;
}

// Seeded weights in the ranges of gated_deltanet_test.cc's.
struct Layer {
  std::vector<std::vector<float>> storage;
  GatedDeltaNet layer;
};

Layer make_layer(uint64_t seed) {
  const GatedDeltaNetConfig c = config();
  const int64_t kd = c.num_k_heads * c.key_head_dim, vd = c.num_v_heads * c.value_head_dim;
  Rng rng(seed);
  const float s = 2.0f / std::sqrt(static_cast<float>(kHidden));
  Layer l{{}, GatedDeltaNet::create(c).value()};
  WeightMap m;
  const auto add = [&](const std::string& name, std::initializer_list<int64_t> shape, float lo,
                       float hi) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    l.storage.push_back(attnkit_test::uniform_vector(n, rng, lo, hi));
    m[name] = make_view(l.storage.back().data(), DType::kF32, shape);
  };
  add("in_proj_qkvz.weight", {2 * kd + 2 * vd, kHidden}, -s, s);
  add("in_proj_ba.weight", {2 * c.num_v_heads, kHidden}, -s, s);
  add("conv1d.weight", {2 * kd + vd, 1, c.conv_kernel}, -0.7f, 0.7f);
  add("A_log", {c.num_v_heads}, -1.2f, 2.5f);
  add("dt_bias", {c.num_v_heads}, -4.0f, 1.0f);
  add("norm.weight", {c.value_head_dim}, 0.5f, 1.5f);
  add("out_proj.weight", {kHidden, vd}, -0.3f, 0.3f);
  EXPECT_TRUE(l.layer.load_weights(m).ok());
  return l;
}

LinearStatePool make_pool(int64_t max_sequences = 0) {
  const GatedDeltaNetConfig c = config();
  auto p = LinearStatePool::create(std::span<const GatedDeltaNetConfig>(&c, 1), max_sequences);
  EXPECT_TRUE(p.ok()) << p.status().message();
  return std::move(p).value();
}

// A slot's bytes (conv state then recurrent state), to compare slots.
std::vector<float> slot_values(LinearStatePool& pool, int64_t id) {
  GatedDeltaNetState* s = pool.state(id, 0).value();
  const TensorView &c = s->conv_state(), &r = s->recurrent_state();
  std::vector<float> v(c.ptr<const float>(), c.ptr<const float>() + c.numel());
  v.insert(v.end(), r.ptr<const float>(), r.ptr<const float>() + r.numel());
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Step {
  std::vector<int64_t> ids;
  std::vector<int32_t> lengths;
};

class LinearStatePoolBackends : public ::testing::TestWithParam<Backend> {};

// The reference backend's projections are loops whose rows do not depend
// on the rows beside them: the same bits. The fast backend's GEMM over a
// step's packed rows may sum in another order than over one sequence's:
// within a few f32 roundings of the layer's output scale.
void expect_same(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  if (LinearStatePoolBackends::GetParam() == Backend::kReference) {
    EXPECT_TRUE(same_bits(got, want)) << what;
    return;
  }
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::fabs(double{want[i]}));
    worst = std::max(worst, std::fabs(double{got[i]} - want[i]));
  }
  EXPECT_LE(worst, 1e-5 * scale) << what;
}

TEST_P(LinearStatePoolBackends, RaggedStepsEqualEachSequenceAlone) {
  Layer l = make_layer(5);
  LinearStatePool pool = make_pool();
  const RunOptions run{GetParam(), 0};
  // Prompts of 37 and 1 tokens, a later prompt in two chunks, decodes, a
  // sequence absent from a step and one with zero rows.
  const std::vector<Step> steps = {{{7, 2}, {37, 1}},
                                   {{7, 2, 11}, {1, 1, 20}},
                                   {{11, 2}, {13, 0}},
                                   {{2, 7, 11}, {1, 1, 1}},
                                   {{11, 7}, {1, 1}},
                                   // Longer than the layer's 256-row block:
                                   // pieces, decodes sharing their blocks.
                                   {{7, 11, 2}, {1, 300, 1}}};
  for (int64_t id : {7, 2, 11}) ASSERT_TRUE(pool.add_sequence(id).ok());
  EXPECT_EQ(pool.num_sequences(), 3);
  std::map<int64_t, GatedDeltaNetState> alone;
  for (int64_t id : {7, 2, 11}) alone.emplace(id, l.layer.new_state(1).value());
  Rng rng(9);
  for (const Step& step : steps) {
    std::vector<int32_t> cu = {0};
    for (int32_t n : step.lengths) cu.push_back(cu.back() + n);
    const int64_t total = cu.back();
    const std::vector<float> x = attnkit_test::uniform_vector(total * kHidden, rng);
    std::vector<float> out(x.size(), -1.0f);
    ASSERT_TRUE(l.layer
                    .forward_batch(make_view(x.data(), DType::kF32, {total, kHidden}), cu, step.ids,
                                   pool, 0, make_view(out.data(), DType::kF32, {total, kHidden}),
                                   run)
                    .ok());
    for (size_t s = 0; s < step.ids.size(); ++s) {
      const int64_t n = step.lengths[s];
      if (n == 0) continue;
      std::vector<float> want(static_cast<size_t>(n * kHidden));
      ASSERT_TRUE(l.layer
                      .forward(make_view(x.data() + cu[s] * kHidden, DType::kF32, {1, n, kHidden}),
                               make_view(want.data(), DType::kF32, {1, n, kHidden}),
                               &alone.at(step.ids[s]), run)
                      .ok());
      const std::vector<float> got(out.begin() + cu[s] * kHidden,
                                   out.begin() + cu[s + 1] * kHidden);
      expect_same(got, want, "sequence " + std::to_string(step.ids[s]));
    }
  }
  for (int64_t id : {7, 2, 11}) {
    const TensorView &c = alone.at(id).conv_state(), &r = alone.at(id).recurrent_state();
    std::vector<float> want(c.ptr<const float>(), c.ptr<const float>() + c.numel());
    want.insert(want.end(), r.ptr<const float>(), r.ptr<const float>() + r.numel());
    expect_same(slot_values(pool, id), want, "slot of " + std::to_string(id));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearStatePoolBackends,
                         ::testing::Values(Backend::kReference, Backend::kFast));

TEST(LinearStatePool, ForkCopiesTheSlotAndTheCopiesThenDiverge) {
  Layer l = make_layer(6);
  LinearStatePool pool = make_pool();
  ASSERT_TRUE(pool.add_sequence(0).ok());
  Rng rng(3);
  const auto step = [&](int64_t id, const std::vector<float>& x) {
    std::vector<float> out(x.size());
    const int64_t n = static_cast<int64_t>(x.size()) / kHidden;
    const std::vector<int32_t> cu = {0, static_cast<int32_t>(n)};
    EXPECT_TRUE(l.layer
                    .forward_batch(make_view(x.data(), DType::kF32, {n, kHidden}), cu,
                                   std::vector<int64_t>{id}, pool, 0,
                                   make_view(out.data(), DType::kF32, {n, kHidden}))
                    .ok());
    return out;
  };
  step(0, attnkit_test::uniform_vector(9 * kHidden, rng));
  ASSERT_TRUE(pool.fork(0, 4).ok());
  EXPECT_TRUE(same_bits(slot_values(pool, 0), slot_values(pool, 4)));
  const std::vector<float> next = attnkit_test::uniform_vector(kHidden, rng);
  EXPECT_TRUE(same_bits(step(0, next), step(4, next)));  // the same start, the same output
  const std::vector<float> before = slot_values(pool, 0);
  step(4, attnkit_test::uniform_vector(3 * kHidden, rng));
  EXPECT_TRUE(same_bits(slot_values(pool, 0), before));  // the fork's step leaves src alone
  EXPECT_FALSE(same_bits(slot_values(pool, 4), before));
}

TEST(LinearStatePool, RemoveFreesAndAReusedIdStartsFromZero) {
  Layer l = make_layer(7);
  LinearStatePool pool = make_pool();
  ASSERT_TRUE(pool.add_sequence(3).ok());
  EXPECT_EQ(pool.bytes_per_sequence(),
            (config().state_values() + config().conv_state_values()) * 4);
  Rng rng(4);
  const std::vector<float> x = attnkit_test::uniform_vector(5 * kHidden, rng);
  std::vector<float> out(x.size());
  const std::vector<int32_t> cu = {0, 5};
  ASSERT_TRUE(l.layer
                  .forward_batch(make_view(x.data(), DType::kF32, {5, kHidden}), cu,
                                 std::vector<int64_t>{3}, pool, 0,
                                 make_view(out.data(), DType::kF32, {5, kHidden}))
                  .ok());
  ASSERT_TRUE(pool.remove(3).ok());
  EXPECT_EQ(pool.num_sequences(), 0);
  EXPECT_FALSE(pool.contains(3));
  EXPECT_FALSE(pool.state(3, 0).ok());
  ASSERT_TRUE(pool.add_sequence(3).ok());
  for (float v : slot_values(pool, 3)) ASSERT_EQ(v, 0.0f);
}

TEST(LinearStatePool, BadCallsNameTheArgumentAndChangeNothing) {
  Layer l = make_layer(8);
  LinearStatePool pool = make_pool(2);
  ASSERT_TRUE(pool.add_sequence(0).ok());
  ASSERT_TRUE(pool.add_sequence(1).ok());
  Rng rng(5);
  const std::vector<float> x = attnkit_test::uniform_vector(4 * kHidden, rng);
  std::vector<float> warm(x.size());
  const std::vector<int32_t> cu = {0, 3, 4};
  const std::vector<int64_t> ids = {0, 1};
  const TensorView xv = make_view(x.data(), DType::kF32, {4, kHidden});
  ASSERT_TRUE(
      l.layer.forward_batch(xv, cu, ids, pool, 0, make_view(warm.data(), DType::kF32, {4, kHidden}))
          .ok());
  const std::vector<float> s0 = slot_values(pool, 0), s1 = slot_values(pool, 1);
  std::vector<float> out(x.size(), 7.0f);
  const TensorView ov = make_view(out.data(), DType::kF32, {4, kHidden});
  const auto expect_refused = [&](const Status& st, const std::string& says) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
    for (float v : out) ASSERT_EQ(v, 7.0f);
    EXPECT_TRUE(same_bits(slot_values(pool, 0), s0));
    EXPECT_TRUE(same_bits(slot_values(pool, 1), s1));
    EXPECT_EQ(pool.num_sequences(), 2);
  };
  expect_refused(l.layer.forward_batch(xv, cu, std::vector<int64_t>{0, 9}, pool, 0, ov),
                 "seq_id = 9 is not held");
  expect_refused(l.layer.forward_batch(xv, cu, std::vector<int64_t>{1, 1}, pool, 0, ov),
                 "seq_ids[1] = 1 appears twice");
  expect_refused(l.layer.forward_batch(xv, std::vector<int32_t>{0, 3, 5}, ids, pool, 0, ov),
                 "cu_seqlens_q");
  expect_refused(l.layer.forward_batch(xv, std::vector<int32_t>{0, 4, 3, 4},
                                       std::vector<int64_t>{0, 1, 0}, pool, 0, ov),
                 "must not decrease");
  expect_refused(l.layer.forward_batch(xv, cu, ids, pool, 1, ov), "layer_index = 1");
  expect_refused(l.layer.forward_batch(xv, cu, ids, pool, 0, xv), "overlaps");
  GatedDeltaNetConfig other = config();
  other.value_head_dim = 16;
  LinearStatePool wrong =
      LinearStatePool::create(std::span<const GatedDeltaNetConfig>(&other, 1)).value();
  EXPECT_NE(l.layer.forward_batch(xv, cu, ids, wrong, 0, ov).message().find("another shape"),
            std::string::npos);
  expect_refused(pool.add_sequence(0), "seq_id = 0 is already held");
  expect_refused(pool.add_sequence(-2), "seq_id = -2 must be >= 0");
  expect_refused(pool.fork(5, 6), "src = 5 is not held");
  expect_refused(pool.fork(0, 1), "dst = 1 is already held");
  expect_refused(pool.remove(8), "seq_id = 8 is not held");
  EXPECT_EQ(pool.add_sequence(2).code(), StatusCode::kResourceExhausted);  // max_sequences 2
  EXPECT_EQ(pool.fork(0, 2).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.num_sequences(), 2);
  EXPECT_FALSE(LinearStatePool::create({}, -1).ok());
  GatedDeltaNetConfig bad = config();
  bad.num_v_heads = 3;
  EXPECT_NE(LinearStatePool::create(std::span<const GatedDeltaNetConfig>(&bad, 1))
                .status()
                .message()
                .find("layers[0]"),
            std::string::npos);
}

}  // namespace
}  // namespace attnkit
