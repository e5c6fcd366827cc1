// gpt-oss's MoE feed-forward (MoeWeightNaming::kGptOss, kGptOssSwiGlu)
// against a float64 port of transformers' GptOssMLP written here from
// modeling_gpt_oss.py: router logits with bias, top-k of the logits, softmax
// over the k chosen; per expert gate_up = x @ gate_up_proj[e] + bias, gate
// the even columns, up the odd ones, gate clamped above at the limit, up
// clamped to +-limit, (up + 1) * gate * sigmoid(1.702 gate), then
// @ down_proj[e] + bias, weighted and summed.
//
// Tolerance: 1e-5 of the largest |output| (the layer sums at most 24 f32
// products per dot product and 2 experts; its error is ~1e-7 relative). The
// limit is set where the clamps engage on a good share of the values, and
// a layer that ignored them, read gate and up the other way round, or
// transposed down_proj would be off by O(0.1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "attnkit/moe.h"
#include "common/random.h"

namespace {

using attnkit::DType;
using attnkit::MoeConfig;
using attnkit::MoeLayer;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit::WeightMap;
using attnkit_test::Rng;

MoeConfig gpt_oss_config() {
  MoeConfig c;
  c.model_type = "gpt_oss";
  c.naming = attnkit::MoeWeightNaming::kGptOss;
  c.activation = attnkit::MoeActivation::kGptOssSwiGlu;
  c.hidden_size = 16;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.scoring_func = attnkit::MoeScoringFunc::kSoftmax;
  c.norm_topk_prob = true;
  c.swiglu_limit = 0.6;  // gpt-oss: 7.0; small here so the clamps engage
  c.router_bias = c.expert_bias = true;
  return c;
}

struct GptOssWeights {
  std::vector<float> router, router_bias, gate_up, gate_up_bias, down, down_bias;
};

GptOssWeights random_weights(const MoeConfig& c, Rng& rng) {
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  auto u = [&](int64_t n, float a) { return attnkit_test::uniform_vector(size_t(n), rng, -a, a); };
  GptOssWeights w;
  w.router = u(E * H, 1.0f);
  w.router_bias = u(E, 0.5f);
  w.gate_up = u(E * H * 2 * I, 1.0f);
  w.gate_up_bias = u(E * 2 * I, 0.5f);
  w.down = u(E * I * H, 0.5f);
  w.down_bias = u(E * H, 0.5f);
  return w;
}

WeightMap weight_map(GptOssWeights& w, const MoeConfig& c, const std::string& prefix) {
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  WeightMap m;
  m[prefix + "mlp.router.weight"] = attnkit::make_view(w.router.data(), DType::kF32, {E, H});
  m[prefix + "mlp.router.bias"] = attnkit::make_view(w.router_bias.data(), DType::kF32, {E});
  m[prefix + "mlp.experts.gate_up_proj"] =
      attnkit::make_view(w.gate_up.data(), DType::kF32, {E, H, 2 * I});
  m[prefix + "mlp.experts.gate_up_proj_bias"] =
      attnkit::make_view(w.gate_up_bias.data(), DType::kF32, {E, 2 * I});
  m[prefix + "mlp.experts.down_proj"] = attnkit::make_view(w.down.data(), DType::kF32, {E, I, H});
  m[prefix + "mlp.experts.down_proj_bias"] =
      attnkit::make_view(w.down_bias.data(), DType::kF32, {E, H});
  return m;
}

// x [T, H] -> y [T, H]; also the chosen experts per token (best first) and
// how many gate / up values the clamps changed.
std::vector<double> reference(const MoeConfig& c, const GptOssWeights& w,
                              const std::vector<float>& x, int64_t T, std::vector<int>* chosen,
                              int64_t* clamped) {
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size,
                K = c.num_experts_per_tok;
  const double limit = c.swiglu_limit;
  std::vector<double> y(static_cast<size_t>(T * H), 0.0), logits(static_cast<size_t>(E)),
      gu(static_cast<size_t>(2 * I)), act(static_cast<size_t>(I));
  std::vector<int> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      double acc = w.router_bias[size_t(e)];
      for (int64_t h = 0; h < H; ++h)
        acc += double(x[size_t(t * H + h)]) * w.router[size_t(e * H + h)];
      logits[size_t(e)] = acc;
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return logits[size_t(a)] > logits[size_t(b)]; });
    // Softmax over the top-k logits.
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k)
      sum += std::exp(logits[size_t(order[size_t(k)])] - logits[size_t(order[0])]);
    for (int64_t k = 0; k < K; ++k) {
      const int e = order[size_t(k)];
      chosen->push_back(e);
      const double weight = std::exp(logits[size_t(e)] - logits[size_t(order[0])]) / sum;
      for (int64_t j = 0; j < 2 * I; ++j) {
        double acc = w.gate_up_bias[size_t(e * 2 * I + j)];
        for (int64_t h = 0; h < H; ++h)
          acc += double(x[size_t(t * H + h)]) * w.gate_up[size_t((e * H + h) * 2 * I + j)];
        gu[size_t(j)] = acc;
      }
      for (int64_t i = 0; i < I; ++i) {
        const double g0 = gu[size_t(2 * i)], u0 = gu[size_t(2 * i + 1)];
        const double g = std::min(g0, limit), u = std::clamp(u0, -limit, limit);
        *clamped += (g != g0) + (u != u0);
        act[size_t(i)] = (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
      }
      for (int64_t h = 0; h < H; ++h) {
        double acc = w.down_bias[size_t(e * H + h)];
        for (int64_t i = 0; i < I; ++i) acc += act[size_t(i)] * w.down[size_t((e * I + i) * H + h)];
        y[size_t(t * H + h)] += weight * acc;
      }
    }
  }
  return y;
}

TEST(MoeGptOss, MatchesFloat64PortOfTheAuthorsCode) {
  const MoeConfig c = gpt_oss_config();
  Rng rng(31);
  GptOssWeights w = random_weights(c, rng);
  auto layer = MoeLayer::create(c);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  const auto st = layer->load_weights(weight_map(w, c, "model.layers.1."), "model.layers.1.");
  ASSERT_TRUE(st.ok()) << st.to_string();
  const int64_t B = 3, S = 7, T = B * S, H = c.hidden_size;
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(T * H), rng);
  std::vector<int> chosen;
  int64_t clamped = 0;
  const std::vector<double> want = reference(c, w, x, T, &chosen, &clamped);
  EXPECT_GT(clamped, T * 2 * c.moe_intermediate_size / 10) << "the clamps must engage";
  for (const attnkit::Backend backend : {attnkit::Backend::kReference, attnkit::Backend::kFast}) {
    std::vector<float> got(x.size(), -7.0f);
    attnkit::MoeRouting routing;
    const auto fst = layer->forward(attnkit::make_view(x.data(), DType::kF32, {B, S, H}),
                                    attnkit::make_view(got.data(), DType::kF32, {B, S, H}),
                                    &routing, {backend, 0});
    ASSERT_TRUE(fst.ok()) << fst.to_string();
    EXPECT_EQ(std::vector<int>(routing.expert_ids.begin(), routing.expert_ids.end()), chosen);
    double mag = 0.0, worst = 0.0;
    for (double v : want) mag = std::max(mag, std::fabs(v));
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
    EXPECT_LE(worst, 1e-5 * mag) << "backend " << int(backend);
  }
  // The router's own weight and bias stay readable; the fused experts are
  // repacked and say so.
  EXPECT_EQ(layer->weight("mlp.router.bias").value().numel(), c.n_routed_experts);
  const auto fused = layer->weight("mlp.experts.gate_up_proj");
  EXPECT_EQ(fused.status().code(), StatusCode::kNotFound);
  EXPECT_NE(fused.status().message().find("repacked"), std::string::npos);
}

TEST(MoeGptOss, MisShapedFusedWeightsAreRejectedAndChangeNothing) {
  const MoeConfig c = gpt_oss_config();
  Rng rng(5);
  GptOssWeights w = random_weights(c, rng);
  auto layer = MoeLayer::create(c).value();
  ASSERT_TRUE(layer.load_weights(weight_map(w, c, "")).ok());
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(4 * H), rng);
  std::vector<float> before(x.size()), after(x.size());
  const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {1, 4, H});
  ASSERT_TRUE(layer.forward(xv, attnkit::make_view(before.data(), DType::kF32, {1, 4, H})).ok());
  GptOssWeights other = random_weights(c, rng);
  WeightMap m = weight_map(other, c, "");
  // nn.Linear's [E, 2I, H] instead of gate_up_proj's [E, H, 2I].
  m["mlp.experts.gate_up_proj"] =
      attnkit::make_view(other.gate_up.data(), DType::kF32, {E, 2 * I, H});
  auto st = layer.load_weights(m);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("mlp.experts.gate_up_proj"), std::string::npos) << st.message();
  m = weight_map(other, c, "");
  m.erase("mlp.experts.down_proj_bias");
  st = layer.load_weights(m);
  EXPECT_NE(st.message().find("mlp.experts.down_proj_bias"), std::string::npos) << st.message();
  ASSERT_TRUE(layer.forward(xv, attnkit::make_view(after.data(), DType::kF32, {1, 4, H})).ok());
  EXPECT_EQ(before, after);

  MoeConfig bad = c;
  bad.swiglu_limit = 0.0;
  EXPECT_NE(MoeLayer::create(bad).status().message().find("swiglu_limit"), std::string::npos);
  bad = c;
  bad.naming = attnkit::MoeWeightNaming::kMixtral;
  EXPECT_NE(MoeLayer::create(bad).status().message().find("router_bias"), std::string::npos);
}

}  // namespace
