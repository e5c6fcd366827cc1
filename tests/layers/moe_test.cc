// MoeLayer against a float64 oracle written here: routing recomputed from
// scratch (full stable sort, groups masked to -inf) and a dense loop that
// runs every expert on every token and weights it by the routing (0 when not
// chosen). The layer runs only the chosen experts, so agreement checks the
// dispatch as well as the arithmetic. Tolerance: the issue's 1e-5 relative
// to the largest output magnitude (observed errors are ~1e-7); routing ids
// must match exactly, which the tests guard by asserting that every random
// token's top-k (and group) decision has a margin far above fp32 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "attnkit/moe.h"
#include "common/random.h"

namespace {

using attnkit::DType;
using attnkit::MoeConfig;
using attnkit::MoeLayer;
using attnkit::MoeRouting;
using attnkit::MoeScoringFunc;
using attnkit::MoeTopkMethod;
using attnkit::MoeWeightNaming;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit::WeightMap;
using attnkit_test::Rng;

constexpr double kInf = std::numeric_limits<double>::infinity();

size_t sz(int64_t v) { return static_cast<size_t>(v); }

// Weights under Hugging Face names, owned here; views() exposes them.
struct Weights {
  std::map<std::string, std::vector<float>> data;
  std::map<std::string, std::vector<int64_t>> shape;

  void put(const std::string& name, std::vector<int64_t> dims, std::vector<float> values) {
    data[name] = std::move(values);
    shape[name] = std::move(dims);
  }
  std::vector<float>& at(const std::string& name) { return data.at(name); }
  const std::vector<float>& at(const std::string& name) const { return data.at(name); }
  WeightMap views() const {
    WeightMap m;
    for (const auto& [name, v] : data) {
      const auto& s = shape.at(name);
      m[name] = s.size() == 1 ? attnkit::make_view(v.data(), DType::kF32, {s[0]})
                              : attnkit::make_view(v.data(), DType::kF32, {s[0], s[1]});
    }
    return m;
  }
};

// The HF names of one block, spelled out here independently of the layer.
struct Names {
  std::string gate, bias, shared_gate, shared_up, shared_down;
  std::string shared_expert_gate;  // Qwen2-MoE / Qwen3-Next: mlp.shared_expert_gate.weight
  std::string expert(int e, int which) const {  // which: 0 gate, 1 up, 2 down
    static const char* mix[] = {"w1", "w3", "w2"};
    static const char* ds[] = {"gate_proj", "up_proj", "down_proj"};
    return block + ".experts." + std::to_string(e) + "." + (mixtral ? mix : ds)[which] + ".weight";
  }
  std::string block;
  bool mixtral = false;
};

Names names_for(const MoeConfig& c, const std::string& prefix) {
  Names n;
  n.mixtral = c.naming == MoeWeightNaming::kMixtral;
  // The layer's prefix rule: "model.layers.5" and "model.layers.5." agree.
  const std::string p = prefix.empty() || prefix.back() == '.' ? prefix : prefix + ".";
  n.block = p + (n.mixtral ? "block_sparse_moe" : "mlp");
  n.gate = n.block + ".gate.weight";
  n.bias = n.block + ".gate.e_score_correction_bias";
  // Qwen2-MoE / Qwen3-Next: one shared expert, named singular, and its gate.
  const std::string shared = c.shared_expert_gate ? ".shared_expert." : ".shared_experts.";
  n.shared_gate = n.block + shared + "gate_proj.weight";
  n.shared_up = n.block + shared + "up_proj.weight";
  n.shared_down = n.block + shared + "down_proj.weight";
  n.shared_expert_gate = n.block + ".shared_expert_gate.weight";
  return n;
}

// Random weights: gate rows scaled so logits are O(gate_scale), experts
// with fan-in scaling, correction bias uniform in [-bias_scale, bias_scale].
Weights random_weights(const MoeConfig& c, const std::string& prefix, Rng& rng,
                       float gate_scale = 2.0f, float bias_scale = 0.3f) {
  const Names n = names_for(c, prefix);
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const float gs = gate_scale / std::sqrt(static_cast<float>(H));
  const float in_s = 1.0f / std::sqrt(static_cast<float>(H));
  const float mid_s = 1.0f / std::sqrt(static_cast<float>(I));
  Weights w;
  w.put(n.gate, {E, H}, attnkit_test::normal_vector(sz(E * H), rng, 0.0f, gs));
  if (c.topk_method == MoeTopkMethod::kNoauxTc)
    w.put(n.bias, {E}, attnkit_test::uniform_vector(sz(E), rng, -bias_scale, bias_scale));
  for (int e = 0; e < E; ++e) {
    w.put(n.expert(e, 0), {I, H}, attnkit_test::uniform_vector(sz(I * H), rng, -in_s, in_s));
    w.put(n.expert(e, 1), {I, H}, attnkit_test::uniform_vector(sz(I * H), rng, -in_s, in_s));
    w.put(n.expert(e, 2), {H, I}, attnkit_test::uniform_vector(sz(H * I), rng, -mid_s, mid_s));
  }
  if (c.n_shared_experts > 0) {
    const int64_t S = I * c.n_shared_experts;
    const float s_s = 1.0f / std::sqrt(static_cast<float>(S));
    w.put(n.shared_gate, {S, H}, attnkit_test::uniform_vector(sz(S * H), rng, -in_s, in_s));
    w.put(n.shared_up, {S, H}, attnkit_test::uniform_vector(sz(S * H), rng, -in_s, in_s));
    w.put(n.shared_down, {H, S}, attnkit_test::uniform_vector(sz(H * S), rng, -s_s, s_s));
    // Gate logits O(1): sigmoid well inside (0, 1), so a wrong gate shows.
    if (c.shared_expert_gate)
      w.put(n.shared_expert_gate, {1, H}, attnkit_test::normal_vector(sz(H), rng, 0.0f, in_s));
  }
  return w;
}

struct Oracle {
  std::vector<double> out;      // [T, H]
  std::vector<int32_t> ids;     // [T, K] best first
  std::vector<double> weights;  // [T, K]
  std::vector<int64_t> counts;  // [E]
  double min_margin = kInf;     // smallest top-k / group decision gap
  // bf16 weights only: per output element, what rounding the down
  // projection's input to bf16 may move it by (see oracle()).
  std::vector<double> bf16_bound;  // [T, H]
};

// down(silu(gate x) * up x) in double; w_gate/w_up [I, H], w_down [H, I].
// mag, if given, receives sum_i |w_down[d, i] h_i| per output d.
std::vector<double> mlp_f64(const double* x, const float* wg, const float* wu, const float* wd,
                            int64_t H, int64_t I, std::vector<double>* mag = nullptr) {
  std::vector<double> h(sz(I)), y(sz(H), 0.0);
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t d = 0; d < H; ++d) {
      g += double(wg[i * H + d]) * x[d];
      u += double(wu[i * H + d]) * x[d];
    }
    h[sz(i)] = g / (1.0 + std::exp(-g)) * u;
  }
  for (int64_t d = 0; d < H; ++d)
    for (int64_t i = 0; i < I; ++i) y[sz(d)] += double(wd[d * I + i]) * h[sz(i)];
  if (mag) {
    mag->assign(sz(H), 0.0);
    for (int64_t d = 0; d < H; ++d)
      for (int64_t i = 0; i < I; ++i) (*mag)[sz(d)] += std::fabs(double(wd[d * I + i]) * h[sz(i)]);
  }
  return y;
}

// bf16: the weights hold bf16 values and the layer keeps them as bf16, so
// each projection rounds its input to bf16 first (kernels/linear.h). For
// the router and the experts' gate and up projections that input is x,
// rounded here exactly as the layer does; the down projection's input h is
// computed, so its rounding (2^-9 |h_i| at most) goes into bf16_bound.
Oracle oracle(const MoeConfig& c, const Weights& w, const std::string& prefix,
              const std::vector<float>& x, int64_t T, bool bf16 = false) {
  const Names n = names_for(c, prefix);
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size,
                K = c.num_experts_per_tok;
  Oracle o;
  o.out.assign(sz(T * H), 0.0);
  o.ids.resize(sz(T * K));
  o.weights.resize(sz(T * K));
  o.counts.assign(sz(E), 0);
  o.bf16_bound.assign(sz(T * H), 0.0);
  const float* gate = w.at(n.gate).data();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    if (bf16)
      for (double& v : xt) v = attnkit_test::round_bf16(static_cast<float>(v));
    std::vector<double> logit(sz(E)), score(sz(E)), choice(sz(E));
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t d = 0; d < H; ++d) s += double(gate[e * H + d]) * xt[sz(d)];
      logit[sz(e)] = s;
    }
    if (c.scoring_func == MoeScoringFunc::kSoftmax) {
      const double m = *std::max_element(logit.begin(), logit.end());
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(logit[sz(e)] - m);
      for (int64_t e = 0; e < E; ++e) score[sz(e)] = std::exp(logit[sz(e)] - m) / z;
    } else {
      for (int64_t e = 0; e < E; ++e) score[sz(e)] = 1.0 / (1.0 + std::exp(-logit[sz(e)]));
    }
    for (int64_t e = 0; e < E; ++e)
      choice[sz(e)] =
          score[sz(e)] +
          (c.topk_method == MoeTopkMethod::kNoauxTc ? double(w.at(n.bias)[sz(e)]) : 0.0);
    // Stable sort by decreasing value: equal values keep increasing index.
    auto ranked = [](const std::vector<double>& v) {
      std::vector<int32_t> idx(v.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int32_t a, int32_t b) { return v[sz(a)] > v[sz(b)]; });
      return idx;
    };
    if (c.topk_method != MoeTopkMethod::kGreedy) {
      const int64_t G = c.n_group, per = E / G;
      std::vector<double> gs(sz(G));
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs[sz(g)] = c.topk_method == MoeTopkMethod::kNoauxTc ? v[0] + (per > 1 ? v[1] : 0.0) : v[0];
      }
      const auto gr = ranked(gs);
      if (c.topk_group < G)
        o.min_margin =
            std::min(o.min_margin, gs[sz(gr[sz(c.topk_group - 1)])] - gs[sz(gr[sz(c.topk_group)])]);
      for (int64_t r = c.topk_group; r < G; ++r)
        for (int64_t i = 0; i < per; ++i) choice[sz(gr[sz(r)] * per + i)] = -kInf;
    }
    const auto er = ranked(choice);
    if (K < E && choice[sz(er[sz(K)])] > -kInf)
      o.min_margin = std::min(o.min_margin, choice[sz(er[sz(K - 1)])] - choice[sz(er[sz(K)])]);
    double sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += score[sz(er[sz(j)])];
    std::vector<double> dense_w(sz(E), 0.0);  // routing weight per expert, 0 = not chosen
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = er[sz(j)];
      double wt = score[sz(e)];
      if (c.norm_topk_prob) wt /= sum;
      wt *= c.routed_scaling_factor;
      o.ids[sz(t * K + j)] = e;
      o.weights[sz(t * K + j)] = wt;
      dense_w[sz(e)] = wt;
      ++o.counts[sz(e)];
    }
    double* ot = o.out.data() + t * H;
    double* bt = o.bf16_bound.data() + t * H;
    std::vector<double> mag;
    for (int64_t e = 0; e < E; ++e) {  // every expert, every token
      const auto y =
          mlp_f64(xt.data(), w.at(n.expert(int(e), 0)).data(), w.at(n.expert(int(e), 1)).data(),
                  w.at(n.expert(int(e), 2)).data(), H, I, &mag);
      for (int64_t d = 0; d < H; ++d) {
        ot[d] += dense_w[sz(e)] * y[sz(d)];
        if (bf16) bt[d] += std::fabs(dense_w[sz(e)]) * 0x1p-9 * mag[sz(d)];
      }
    }
    if (c.n_shared_experts > 0) {
      const auto y = mlp_f64(xt.data(), w.at(n.shared_gate).data(), w.at(n.shared_up).data(),
                             w.at(n.shared_down).data(), H, I * c.n_shared_experts, &mag);
      // sigmoid(x . w_sg) per token when the shared expert is gated.
      double sg = 1.0;
      if (c.shared_expert_gate) {
        double z = 0.0;
        for (int64_t d = 0; d < H; ++d) z += double(w.at(n.shared_expert_gate)[sz(d)]) * xt[sz(d)];
        sg = 1.0 / (1.0 + std::exp(-z));
      }
      for (int64_t d = 0; d < H; ++d) {
        ot[d] += sg * y[sz(d)];
        if (bf16) bt[d] += sg * 0x1p-9 * mag[sz(d)];
      }
    }
  }
  return o;
}

MoeLayer make_layer(const MoeConfig& c, const Weights& w, const std::string& prefix) {
  auto layer = MoeLayer::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  const auto st = layer->load_weights(w.views(), prefix);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return std::move(layer).value();
}

// Runs the layer on x [batch, seq, H] and checks output and routing against
// the oracle. Returns the worst output error relative to max |out|.
double check_against_oracle(const MoeConfig& c, const Weights& w, const std::string& prefix,
                            const std::vector<float>& x, int64_t batch, int64_t seq,
                            bool guard_margin = true, int num_threads = 0,
                            attnkit::Backend backend = attnkit::Backend::kAuto) {
  const int64_t T = batch * seq, H = c.hidden_size, K = c.num_experts_per_tok;
  const Oracle o = oracle(c, w, prefix, x, T);
  if (guard_margin) {
    EXPECT_GT(o.min_margin, 1e-5) << "a routing decision of this random data is a near tie; "
                                     "fp32 and the oracle could legitimately disagree";
  }
  const MoeLayer layer = make_layer(c, w, prefix);
  std::vector<float> out(sz(T * H), -7.0f);
  MoeRouting r;
  attnkit::RunOptions run;
  run.num_threads = num_threads;
  run.backend = backend;
  const auto st =
      layer.forward(attnkit::make_view(x.data(), DType::kF32, {batch, seq, H}),
                    attnkit::make_view(out.data(), DType::kF32, {batch, seq, H}), &r, run);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(r.num_tokens, T);
  EXPECT_EQ(r.top_k, K);
  EXPECT_EQ(r.expert_ids, o.ids);
  EXPECT_EQ(r.tokens_per_expert, o.counts);
  EXPECT_TRUE(attnkit_test::all_close("routing weights", r.weights, o.weights, {0.0, 1e-6}));
  double scale = 0;
  for (double v : o.out) scale = std::max(scale, std::fabs(v));
  double ratio = 0;
  EXPECT_TRUE(attnkit_test::all_close("out", out, o.out, {1e-5 * scale, 0.0}, &ratio));
  return ratio * 1e-5;
}

MoeConfig mixtral_config() {
  MoeConfig c;
  c.model_type = "mixtral";
  c.naming = MoeWeightNaming::kMixtral;
  c.hidden_size = 44;  // not a multiple of linear's 8 lanes
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 36;
  c.norm_topk_prob = true;
  return c;
}

MoeConfig deepseek_v3_config() {
  MoeConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 40;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 24;
  c.n_shared_experts = 1;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5;
  c.scoring_func = MoeScoringFunc::kSigmoid;
  c.topk_method = MoeTopkMethod::kNoauxTc;
  c.n_group = 4;
  c.topk_group = 2;
  return c;
}

// Qwen3-Next's block: softmax top-k renormalised, and one shared expert
// (twice a routed one's width here) scaled per token by sigmoid(x . w_sg).
MoeConfig qwen3_next_config() {
  MoeConfig c;
  c.model_type = "qwen3_next";
  c.hidden_size = 36;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 20;
  c.n_shared_experts = 2;
  c.shared_expert_gate = true;
  c.norm_topk_prob = true;
  return c;
}

TEST(MoeLayer, GatedSharedExpertMatchesDenseOracle) {
  MoeConfig c = qwen3_next_config();
  Rng rng(211);
  const Weights w = random_weights(c, "model.layers.1.", rng);
  const auto x = attnkit_test::normal_vector(3 * 9 * 36, rng);
  for (attnkit::Backend backend : {attnkit::Backend::kAuto, attnkit::Backend::kReference})
    EXPECT_LT(check_against_oracle(c, w, "model.layers.1.", x, 3, 9, true, 2, backend), 1e-5);
  // Qwen2-MoE's block is the same with norm_topk_prob off.
  c.model_type = "qwen2_moe";
  c.norm_topk_prob = false;
  EXPECT_LT(check_against_oracle(c, w, "model.layers.1.", x, 3, 9), 1e-5);

  // The names it reads; the ungated spelling, or a missing gate, is refused by name.
  const MoeLayer layer = make_layer(c, w, "model.layers.1.");
  const auto names = layer.weight_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "mlp.shared_expert_gate.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "mlp.shared_expert.down_proj.weight"),
            names.end());
  ASSERT_TRUE(layer.weight("mlp.shared_expert_gate.weight").ok());
  EXPECT_EQ(layer.weight("mlp.shared_expert_gate.weight")->shape[0], 1);
  Weights missing = w;
  missing.data.erase("model.layers.1.mlp.shared_expert_gate.weight");
  missing.shape.erase("model.layers.1.mlp.shared_expert_gate.weight");
  auto fresh = MoeLayer::create(c);
  ASSERT_TRUE(fresh.ok());
  auto st = fresh->load_weights(missing.views(), "model.layers.1.");
  EXPECT_NE(st.message().find("model.layers.1.mlp.shared_expert_gate.weight"), std::string::npos)
      << st.message();
  EXPECT_FALSE(fresh->loaded());
  Weights misshaped = w;
  misshaped.shape["model.layers.1.mlp.shared_expert_gate.weight"] = {36, 1};
  st = fresh->load_weights(misshaped.views(), "model.layers.1.");
  EXPECT_NE(st.message().find("model.layers.1.mlp.shared_expert_gate.weight"), std::string::npos)
      << st.message();

  // The gate needs a shared expert and DeepSeek-style names.
  MoeConfig bad = c;
  bad.n_shared_experts = 0;
  auto r = MoeLayer::create(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("shared_expert_gate = true"), std::string::npos)
      << r.status().message();
  bad = mixtral_config();
  bad.shared_expert_gate = true;
  EXPECT_FALSE(MoeLayer::create(bad).ok());
}

TEST(MoeLayer, MixtralMatchesDenseOracle) {
  const MoeConfig c = mixtral_config();
  Rng rng(101);
  const Weights w = random_weights(c, "model.layers.3.", rng);
  const auto x = attnkit_test::normal_vector(2 * 13 * 44, rng);
  // Both backends: the projections' oneDNN path and their loop twin.
  for (attnkit::Backend backend : {attnkit::Backend::kAuto, attnkit::Backend::kReference}) {
    const double err = check_against_oracle(c, w, "model.layers.3.", x, 2, 13, true, 0, backend);
    EXPECT_LT(err, 1e-5);
  }
}

TEST(MoeLayer, DeepseekV2GroupLimitedGreedyMatchesDenseOracle) {
  MoeConfig c;
  c.model_type = "deepseek_v2";
  c.hidden_size = 33;
  c.n_routed_experts = 12;
  c.num_experts_per_tok = 3;
  c.moe_intermediate_size = 20;
  c.n_shared_experts = 2;
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 16.0;
  c.topk_method = MoeTopkMethod::kGroupLimitedGreedy;
  c.n_group = 4;
  c.topk_group = 2;
  Rng rng(202);
  const Weights w = random_weights(c, "", rng);
  const auto x = attnkit_test::normal_vector(1 * 21 * 33, rng);
  check_against_oracle(c, w, "", x, 1, 21);
}

TEST(MoeLayer, DeepseekV3NoauxTcMatchesDenseOracle) {
  const MoeConfig c = deepseek_v3_config();
  Rng rng(303);
  const Weights w = random_weights(c, "model.layers.5", rng);
  const auto x = attnkit_test::normal_vector(3 * 9 * 40, rng);
  check_against_oracle(c, w, "model.layers.5", x, 3, 9);
}

// The group limit and the correction bias must each change some decision
// on this data, or the test above could not tell them from plain greedy.
TEST(MoeLayer, DeepseekV3GroupLimitAndBiasMatter) {
  const MoeConfig c = deepseek_v3_config();
  Rng rng(303);
  const Weights w = random_weights(c, "model.layers.5", rng);
  const auto x = attnkit_test::normal_vector(3 * 9 * 40, rng);
  const Oracle full = oracle(c, w, "model.layers.5", x, 27);

  MoeConfig ungrouped = c;
  ungrouped.topk_group = c.n_group;
  EXPECT_NE(oracle(ungrouped, w, "model.layers.5", x, 27).ids, full.ids);
  Weights unbiased = w;
  for (float& b : unbiased.at("model.layers.5.mlp.gate.e_score_correction_bias")) b = 0.0f;
  EXPECT_NE(oracle(c, unbiased, "model.layers.5", x, 27).ids, full.ids);

  // Chosen experts lie in at most topk_group groups per token, and the
  // weights are the unbiased scores renormalised to routed_scaling_factor.
  const MoeLayer layer = make_layer(c, w, "model.layers.5");
  std::vector<float> out(x.size());
  MoeRouting r;
  ASSERT_TRUE(layer
                  .forward(attnkit::make_view(x.data(), DType::kF32, {3, 9, 40}),
                           attnkit::make_view(out.data(), DType::kF32, {3, 9, 40}), &r)
                  .ok());
  for (int64_t t = 0; t < 27; ++t) {
    std::vector<int> groups;
    double sum = 0;
    for (int j = 0; j < 4; ++j) {
      groups.push_back(r.expert_ids[sz(t * 4 + j)] / 4);
      sum += r.weights[sz(t * 4 + j)];
    }
    std::sort(groups.begin(), groups.end());
    EXPECT_LE(std::unique(groups.begin(), groups.end()) - groups.begin(), 2) << "token " << t;
    EXPECT_NEAR(sum, 2.5, 2.5 * 1e-6) << "token " << t;
  }
}

TEST(MoeLayer, SigmoidGreedyWithoutRenormalisationMatchesDenseOracle) {
  MoeConfig c = deepseek_v3_config();
  c.topk_method = MoeTopkMethod::kGreedy;
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.5;
  c.n_shared_experts = 0;
  Rng rng(404);
  const Weights w = random_weights(c, "", rng);
  const auto x = attnkit_test::normal_vector(17 * 40, rng);
  check_against_oracle(c, w, "", x, 17, 1);
}

TEST(MoeLayer, RenormalisationOnAndOff) {
  MoeConfig c;
  c.hidden_size = 16;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 3;
  c.moe_intermediate_size = 8;
  c.routed_scaling_factor = 2.0;
  Rng rng(505);
  const Weights w = random_weights(c, "", rng);
  const auto x = attnkit_test::normal_vector(10 * 16, rng);
  for (bool norm : {true, false}) {
    c.norm_topk_prob = norm;
    const MoeLayer layer = make_layer(c, w, "");
    std::vector<float> out(x.size());
    MoeRouting r;
    ASSERT_TRUE(layer
                    .forward(attnkit::make_view(x.data(), DType::kF32, {1, 10, 16}),
                             attnkit::make_view(out.data(), DType::kF32, {1, 10, 16}), &r)
                    .ok());
    const Oracle o = oracle(c, w, "", x, 10);
    EXPECT_TRUE(attnkit_test::all_close("weights", r.weights, o.weights, {0.0, 1e-6}));
    for (int64_t t = 0; t < 10; ++t) {
      const double sum = r.weights[sz(t * 3)] + r.weights[sz(t * 3 + 1)] + r.weights[sz(t * 3 + 2)];
      if (norm) {
        EXPECT_NEAR(sum, 2.0, 1e-6) << "token " << t;
      } else {
        // Three of six softmax probabilities: their sum is < 1, times 2.
        EXPECT_LT(sum, 2.0 - 1e-3) << "token " << t;
      }
    }
  }
}

// Gate rows 1, 2 and 3 are identical, so their logits are bit-identical;
// the tie must go to the lower ids, and the test oracle's stable sort
// agrees.
TEST(MoeRouting, ExactTiesPickTheLowestExpertId) {
  MoeConfig c = mixtral_config();
  c.hidden_size = 8;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 4;
  Rng rng(606);
  Weights w = random_weights(c, "", rng);
  auto& g = w.at("block_sparse_moe.gate.weight");
  const std::vector<float> v = attnkit_test::uniform_vector(8, rng, 0.5f, 1.0f);
  for (int e = 0; e < 6; ++e)
    for (int d = 0; d < 8; ++d)
      g[sz(e * 8 + d)] = (e >= 1 && e <= 3) ? v[sz(d)] : (e == 0 ? -v[sz(d)] : 0.25f * v[sz(d)]);
  // Tokens with positive entries: logits of 1..3 equal and largest.
  const auto x = attnkit_test::uniform_vector(5 * 8, rng, 0.1f, 1.0f);
  const MoeLayer layer = make_layer(c, w, "");
  std::vector<float> out(x.size());
  MoeRouting r;
  ASSERT_TRUE(layer
                  .forward(attnkit::make_view(x.data(), DType::kF32, {1, 5, 8}),
                           attnkit::make_view(out.data(), DType::kF32, {1, 5, 8}), &r)
                  .ok());
  for (int t = 0; t < 5; ++t) {
    EXPECT_EQ(r.expert_ids[sz(2 * t)], 1) << "token " << t;
    EXPECT_EQ(r.expert_ids[sz(2 * t + 1)], 2) << "token " << t;
    EXPECT_EQ(r.weights[sz(2 * t)], 0.5f);
    EXPECT_EQ(r.weights[sz(2 * t + 1)], 0.5f);
  }
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{0, 5, 5, 0, 0, 0}));
  check_against_oracle(c, w, "", x, 1, 5, /*guard_margin=*/false);
}

// Groups 1 and 3 have bit-identical scores and beat the rest; with
// topk_group = 1 the lower group (1) must win.
TEST(MoeRouting, ExactGroupTiesPickTheLowestGroup) {
  MoeConfig c = deepseek_v3_config();
  c.hidden_size = 8;
  c.n_routed_experts = 8;  // 4 groups of 2
  c.num_experts_per_tok = 1;
  c.moe_intermediate_size = 4;
  c.n_group = 4;
  c.topk_group = 1;
  c.n_shared_experts = 0;
  Rng rng(707);
  Weights w = random_weights(c, "", rng);
  auto& g = w.at("mlp.gate.weight");
  const std::vector<float> v = attnkit_test::uniform_vector(8, rng, 0.5f, 1.0f);
  const float row_scale[8] = {-1.0f, -1.0f, 1.0f, 0.5f, -0.5f, -0.5f, 1.0f, 0.5f};
  for (int e = 0; e < 8; ++e)
    for (int d = 0; d < 8; ++d) g[sz(e * 8 + d)] = row_scale[e] * v[sz(d)];
  std::fill(w.at("mlp.gate.e_score_correction_bias").begin(),
            w.at("mlp.gate.e_score_correction_bias").end(), 0.0f);
  const auto x = attnkit_test::uniform_vector(4 * 8, rng, 0.1f, 1.0f);
  const MoeLayer layer = make_layer(c, w, "");
  std::vector<float> out(x.size());
  MoeRouting r;
  ASSERT_TRUE(layer
                  .forward(attnkit::make_view(x.data(), DType::kF32, {4, 1, 8}),
                           attnkit::make_view(out.data(), DType::kF32, {4, 1, 8}), &r)
                  .ok());
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{2, 2, 2, 2}));
  check_against_oracle(c, w, "", x, 4, 1, /*guard_margin=*/false);
}

// Token 5 alone goes to expert 3; experts 2, 4 and 5 get no token. Expert
// 5's weights are then poisoned with NaN: the output must not change by a
// bit, which holds only if unchosen experts are never computed.
TEST(MoeLayer, ExpertWithOneTokenAndExpertsWithNone) {
  MoeConfig c = mixtral_config();
  c.hidden_size = 12;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 1;
  c.moe_intermediate_size = 10;
  Rng rng(808);
  Weights w = random_weights(c, "m.", rng);
  auto& g = w.at("m.block_sparse_moe.gate.weight");
  std::fill(g.begin(), g.end(), 0.0f);
  for (int e = 0; e < 5; ++e) g[sz(e * 12 + e)] = 4.0f;    // expert e reads feature e
  for (int d = 0; d < 12; ++d) g[sz(5 * 12 + d)] = -4.0f;  // expert 5: never
  std::vector<float> x(8 * 12, 0.05f);
  for (int t = 0; t < 8; ++t) x[sz(t * 12 + (t == 5 ? 3 : t % 2))] = 1.0f;
  const double err = check_against_oracle(c, w, "m.", x, 2, 4);
  EXPECT_LT(err, 1e-5);

  MoeLayer layer = make_layer(c, w, "m.");
  std::vector<float> clean(x.size()), poisoned(x.size());
  MoeRouting r;
  const auto xv = attnkit::make_view(x.data(), DType::kF32, {2, 4, 12});
  ASSERT_TRUE(
      layer.forward(xv, attnkit::make_view(clean.data(), DType::kF32, {2, 4, 12}), &r).ok());
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{4, 3, 0, 1, 0, 0}));
  for (int which = 0; which < 3; ++which)
    for (float& v : w.at(names_for(c, "m.").expert(5, which))) v = std::nanf("");
  ASSERT_TRUE(layer.load_weights(w.views(), "m.").ok());
  ASSERT_TRUE(layer.forward(xv, attnkit::make_view(poisoned.data(), DType::kF32, {2, 4, 12})).ok());
  EXPECT_EQ(0, std::memcmp(clean.data(), poisoned.data(), clean.size() * sizeof(float)));
}

// Each token's sum runs in expert id order, so the thread count and the
// shard boundaries cannot change a bit; strided x and out give the same
// values as contiguous ones.
TEST(MoeLayer, ThreadsAndStridesDoNotChangeTheResult) {
  const MoeConfig c = deepseek_v3_config();
  Rng rng(909);
  const Weights w = random_weights(c, "", rng);
  const int64_t B = 3, L = 37, H = 40;
  const auto x = attnkit_test::normal_vector(sz(B * L * H), rng);
  const MoeLayer layer = make_layer(c, w, "");
  const auto xv = attnkit::make_view(x.data(), DType::kF32, {B, L, H});
  std::vector<float> ref(x.size());
  MoeRouting r1;
  attnkit::RunOptions one;
  one.num_threads = 1;
  ASSERT_TRUE(
      layer.forward(xv, attnkit::make_view(ref.data(), DType::kF32, {B, L, H}), &r1, one).ok());
  for (int threads : {2, 3, 7}) {
    attnkit::RunOptions run;
    run.num_threads = threads;
    std::vector<float> out(x.size());
    MoeRouting r;
    ASSERT_TRUE(
        layer.forward(xv, attnkit::make_view(out.data(), DType::kF32, {B, L, H}), &r, run).ok());
    EXPECT_EQ(0, std::memcmp(ref.data(), out.data(), ref.size() * sizeof(float))) << threads;
    EXPECT_EQ(r.expert_ids, r1.expert_ids);
  }
  // x as a [L, B, H] buffer viewed as [B, L, H] (batch stride H, seq stride
  // B*H); out with a padded hidden stride of 2.
  std::vector<float> xt(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t d = 0; d < H; ++d) xt[sz((l * B + b) * H + d)] = x[sz((b * L + l) * H + d)];
  TensorView xs = xv;
  xs.data = xt.data();
  xs.strides = {H, B * H, 1, 0};
  std::vector<float> padded(x.size() * 2, 0.0f);
  TensorView os = attnkit::make_view(padded.data(), DType::kF32, {B, L, H});
  os.strides = {L * H * 2, H * 2, 2, 0};
  ASSERT_TRUE(layer.forward(xs, os, nullptr, one).ok());
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(padded[i * 2], ref[i]) << i;
}

// bf16 weights are kept as bf16 and the layer computes the oracle with
// bf16-rounded projection inputs: routing exactly, outputs within fp32's
// 1e-5 plus what rounding the down projection's computed input may move
// them by (the oracle's bf16_bound). Skipping the rounding of x would
// change logits and outputs by up to 2^-9 relative, far beyond 1e-5.
TEST(MoeLayer, Bf16WeightsAreKeptAndMatchTheOracle) {
  for (const MoeConfig& c : {mixtral_config(), deepseek_v3_config()}) {
    SCOPED_TRACE(c.model_type);
    Rng rng(88);
    Weights w = random_weights(c, "model.layers.1", rng);
    WeightMap m = w.views();
    std::vector<std::vector<attnkit::bf16>> store;
    for (auto& [name, view] : m) {
      if (view.rank != 2) continue;  // the correction bias stays f32
      store.emplace_back();
      for (float& v : w.at(name)) {
        store.back().push_back(attnkit::float_to_bf16(v));
        v = attnkit::bf16_to_float(store.back().back());
      }
      view.data = store.back().data();
      view.dtype = DType::kBF16;
    }
    auto layer = MoeLayer::create(c).value();
    ASSERT_TRUE(layer.load_weights(m, "model.layers.1").ok());
    const std::string block = c.naming == MoeWeightNaming::kMixtral ? "block_sparse_moe" : "mlp";
    EXPECT_EQ(layer.weight(block + ".gate.weight")->dtype, DType::kBF16);
    const int64_t T = 24, H = c.hidden_size, K = c.num_experts_per_tok;
    const std::vector<float> x = attnkit_test::uniform_vector(sz(T * H), rng);
    const Oracle o = oracle(c, w, "model.layers.1", x, T, /*bf16=*/true);
    EXPECT_GT(o.min_margin, 1e-5);
    for (attnkit::Backend backend : {attnkit::Backend::kAuto, attnkit::Backend::kReference}) {
      std::vector<float> out(sz(T * H), -7.0f);
      MoeRouting r;
      attnkit::RunOptions run;
      run.backend = backend;
      ASSERT_TRUE(layer
                      .forward(attnkit::make_view(x.data(), DType::kF32, {1, T, H}),
                               attnkit::make_view(out.data(), DType::kF32, {1, T, H}), &r, run)
                      .ok());
      EXPECT_EQ(r.expert_ids, o.ids);
      EXPECT_EQ(int64_t(r.expert_ids.size()), T * K);
      double scale = 0;
      for (double v : o.out) scale = std::max(scale, std::fabs(v));
      double worst = 0;
      size_t at = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        const double ratio = std::fabs(out[i] - o.out[i]) / (1e-5 * scale + o.bf16_bound[i]);
        if (!(ratio <= worst)) {
          worst = ratio;
          at = i;
        }
      }
      EXPECT_LE(worst, 1.0) << "out[" << at << "] = " << out[at] << ", oracle " << o.out[at]
                            << ", bound " << 1e-5 * scale + o.bf16_bound[at];
    }
  }
}

TEST(MoeLayer, EmptyBatchIsFine) {
  const MoeConfig c = mixtral_config();
  Rng rng(1);
  const MoeLayer layer = make_layer(c, random_weights(c, "", rng), "");
  float dummy = 0.0f;
  MoeRouting r;
  const auto st = layer.forward(attnkit::make_view(&dummy, DType::kF32, {0, 5, 44}),
                                attnkit::make_view(&dummy, DType::kF32, {0, 5, 44}), &r);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(r.num_tokens, 0);
  EXPECT_EQ(r.tokens_per_expert, std::vector<int64_t>(8, 0));
}

TEST(MoeLayer, WeightNamesAreTheHuggingFaceNames) {
  const MoeConfig c = deepseek_v3_config();
  auto layer = MoeLayer::create(c);
  ASSERT_TRUE(layer.ok());
  const auto names = layer->weight_names();
  ASSERT_EQ(names.size(), 2u + 16 * 3 + 3);
  EXPECT_EQ(names[0], "mlp.gate.weight");
  EXPECT_EQ(names[1], "mlp.gate.e_score_correction_bias");
  EXPECT_EQ(names[2], "mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(names[3], "mlp.experts.0.up_proj.weight");
  EXPECT_EQ(names[4], "mlp.experts.0.down_proj.weight");
  EXPECT_EQ(names.back(), "mlp.shared_experts.down_proj.weight");
  auto mix = MoeLayer::create(mixtral_config());
  ASSERT_TRUE(mix.ok());
  const auto mn = mix->weight_names();
  ASSERT_EQ(mn.size(), 1u + 8 * 3);
  EXPECT_EQ(mn[0], "block_sparse_moe.gate.weight");
  EXPECT_EQ(mn[1], "block_sparse_moe.experts.0.w1.weight");
  EXPECT_EQ(mn[2], "block_sparse_moe.experts.0.w3.weight");
  EXPECT_EQ(mn[3], "block_sparse_moe.experts.0.w2.weight");
}

// ---------------------------------------------------------------- weights

TEST(MoeWeights, BadWeightsAreRejectedAndChangeNothing) {
  const MoeConfig c = deepseek_v3_config();
  Rng rng(11);
  const std::string p = "model.layers.2.";
  const Weights good = random_weights(c, p, rng);
  MoeLayer layer = make_layer(c, good, p);
  const auto x = attnkit_test::normal_vector(4 * 40, rng);
  const auto xv = attnkit::make_view(x.data(), DType::kF32, {1, 4, 40});
  std::vector<float> before(x.size()), after(x.size());
  ASSERT_TRUE(layer.forward(xv, attnkit::make_view(before.data(), DType::kF32, {1, 4, 40})).ok());

  const Weights other = random_weights(c, p, rng);  // a different, valid set
  auto expect_rejected = [&](const WeightMap& m, StatusCode code, const std::string& needle) {
    const auto st = layer.load_weights(m, p);
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    ASSERT_TRUE(layer.forward(xv, attnkit::make_view(after.data(), DType::kF32, {1, 4, 40})).ok());
    EXPECT_EQ(before, after) << "a failed load changed the layer";
  };
  {
    WeightMap m = other.views();
    m.erase(p + "mlp.experts.15.down_proj.weight");
    expect_rejected(m, StatusCode::kNotFound, "mlp.experts.15.down_proj.weight");
  }
  {
    WeightMap m = other.views();
    m.erase(p + "mlp.gate.e_score_correction_bias");
    expect_rejected(m, StatusCode::kNotFound, "e_score_correction_bias");
  }
  {
    WeightMap m = other.views();
    m[p + "mlp.experts.3.up_proj.weight"].shape[0] = 23;
    expect_rejected(m, StatusCode::kInvalidArgument, "mlp.experts.3.up_proj.weight");
  }
  {
    WeightMap m = other.views();
    m[p + "mlp.experts.16.up_proj.weight"] = m[p + "mlp.experts.3.up_proj.weight"];
    expect_rejected(m, StatusCode::kInvalidArgument, "mlp.experts.16.up_proj.weight");
  }
  {
    WeightMap m = other.views();
    const auto gate_view = m[p + "mlp.gate.weight"];
    m.erase(p + "mlp.gate.weight");
    m[p + "block_sparse_moe.gate.weight"] = gate_view;  // a Mixtral name for a DeepSeek block
    expect_rejected(m, StatusCode::kNotFound, "mlp.gate.weight");
  }
  // Weights outside the block (attention, norms) are none of its business.
  WeightMap m = other.views();
  std::vector<float> attn(16, 1.0f);
  m[p + "self_attn.q_proj.weight"] = attnkit::make_view(attn.data(), DType::kF32, {4, 4});
  m["model.layers.3.mlp.gate.weight"] = attnkit::make_view(attn.data(), DType::kF32, {4, 4});
  const auto st = layer.load_weights(m, p);
  EXPECT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(layer.forward(xv, attnkit::make_view(after.data(), DType::kF32, {1, 4, 40})).ok());
  EXPECT_NE(before, after) << "the valid load should have replaced the weights";
  auto gv = layer.weight("mlp.gate.weight");
  ASSERT_TRUE(gv.ok());
  EXPECT_EQ(gv->ptr<const float>()[7], other.at(p + "mlp.gate.weight")[7]);
  EXPECT_EQ(layer.weight("mlp.gate").status().code(), StatusCode::kNotFound);
}

// ------------------------------------------------------------- bad input

TEST(MoeLayer, BadInputsFailAndWriteNothing) {
  const MoeConfig c = mixtral_config();
  Rng rng(12);
  const Weights w = random_weights(c, "", rng);
  const MoeLayer layer = make_layer(c, w, "");
  std::vector<float> x = attnkit_test::normal_vector(2 * 3 * 44, rng);
  std::vector<float> out(x.size(), 42.0f);
  MoeRouting r;
  r.num_tokens = -3;
  auto expect_fail = [&](const TensorView& xv, const TensorView& ov, const std::string& needle) {
    const auto st = layer.forward(xv, ov, &r);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_EQ(st.message().rfind("MoeLayer::forward: ", 0), 0u) << st.message();
    for (float v : out) ASSERT_EQ(v, 42.0f) << "out was written";
    EXPECT_EQ(r.num_tokens, -3) << "routing was written";
  };
  const auto xv = attnkit::make_view(x.data(), DType::kF32, {2, 3, 44});
  const auto ov = attnkit::make_view(out.data(), DType::kF32, {2, 3, 44});
  expect_fail(attnkit::make_view(x.data(), DType::kF32, {6, 44}), ov, "x has rank 2");
  expect_fail(attnkit::make_view(x.data(), DType::kF32, {2, 4, 33}), ov, "hidden_size");
  expect_fail(attnkit::make_view(x.data(), DType::kBF16, {2, 3, 44}), ov, "x.dtype");
  expect_fail(xv, attnkit::make_view(out.data(), DType::kF32, {2, 2, 44}), "out.shape[1]");
  expect_fail(xv, attnkit::make_view(x.data() + 10, DType::kF32, {1, 1, 44}), "out.shape[0]");
  {
    // The overlap check needs an out of the right shape inside x's memory.
    std::vector<float> big(x.size() * 2, 42.0f);
    std::copy(x.begin(), x.end(), big.begin());
    const auto bx = attnkit::make_view(big.data(), DType::kF32, {2, 3, 44});
    const auto bo = attnkit::make_view(big.data() + 100, DType::kF32, {2, 3, 44});
    const auto st = layer.forward(bx, bo, &r);
    EXPECT_NE(st.message().find("overlaps x"), std::string::npos) << st.message();
  }
  x[1 * 44 + 5] = std::nanf("");
  expect_fail(xv, ov, "token 1 (batch 0, position 1)");
  x[1 * 44 + 5] = 0.0f;
  attnkit::RunOptions bad_threads;
  bad_threads.num_threads = -1;
  const auto st = layer.forward(xv, ov, &r, bad_threads);
  EXPECT_NE(st.message().find("num_threads = -1"), std::string::npos) << st.message();

  auto unloaded = MoeLayer::create(c);
  ASSERT_TRUE(unloaded.ok());
  const auto st2 = unloaded->forward(xv, ov, &r);
  EXPECT_NE(st2.message().find("not loaded"), std::string::npos) << st2.message();
  for (float v : out) ASSERT_EQ(v, 42.0f);
}

// ---------------------------------------------------------------- configs

TEST(MoeConfig, ParsesTheFamiliesConfigJson) {
  // Values from the models' config.json files.
  auto mixtral = attnkit::moe_config_from_json(R"({
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
    "router_aux_loss_coef": 0.02, "output_router_logits": false})");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status().to_string();
  EXPECT_EQ(mixtral->naming, MoeWeightNaming::kMixtral);
  EXPECT_EQ(mixtral->n_routed_experts, 8);
  EXPECT_EQ(mixtral->num_experts_per_tok, 2);
  EXPECT_EQ(mixtral->moe_intermediate_size, 14336);
  EXPECT_TRUE(mixtral->norm_topk_prob);
  EXPECT_EQ(mixtral->scoring_func, MoeScoringFunc::kSoftmax);
  EXPECT_EQ(mixtral->topk_method, MoeTopkMethod::kGreedy);
  EXPECT_EQ(mixtral->n_shared_experts, 0);
  EXPECT_EQ(mixtral->routed_scaling_factor, 1.0);

  auto v2 = attnkit::moe_config_from_json(R"({
    "model_type": "deepseek_v2", "hidden_size": 5120, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_routed_experts": 160, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "n_group": 8, "topk_group": 3,
    "topk_method": "group_limited_greedy", "scoring_func": "softmax",
    "norm_topk_prob": false, "routed_scaling_factor": 16.0, "hidden_act": "silu"})");
  ASSERT_TRUE(v2.ok()) << v2.status().to_string();
  EXPECT_EQ(v2->naming, MoeWeightNaming::kDeepseek);
  EXPECT_EQ(v2->moe_intermediate_size, 1536);
  EXPECT_EQ(v2->topk_method, MoeTopkMethod::kGroupLimitedGreedy);
  EXPECT_EQ(v2->routed_scaling_factor, 16.0);
  EXPECT_FALSE(v2->norm_topk_prob);
  EXPECT_EQ(v2->n_group, 8);
  EXPECT_EQ(v2->topk_group, 3);

  auto v3 = attnkit::moe_config_from_json(R"({
    "model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": true, "routed_scaling_factor": 2.5})");
  ASSERT_TRUE(v3.ok()) << v3.status().to_string();
  EXPECT_EQ(v3->scoring_func, MoeScoringFunc::kSigmoid);
  EXPECT_EQ(v3->topk_method, MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(v3->n_shared_experts, 1);
  EXPECT_EQ(v3->routed_scaling_factor, 2.5);

  // Kimi-K2: a DeepSeek-V3 block; without scoring_func / topk_method the
  // V3 defaults (sigmoid, noaux_tc) apply.
  auto kimi = attnkit::moe_config_from_json(R"({
    "model_type": "kimi_k2", "hidden_size": 7168, "moe_intermediate_size": 2048,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.827})");
  ASSERT_TRUE(kimi.ok()) << kimi.status().to_string();
  EXPECT_EQ(kimi->scoring_func, MoeScoringFunc::kSigmoid);
  EXPECT_EQ(kimi->topk_method, MoeTopkMethod::kNoauxTc);
  EXPECT_EQ(kimi->n_routed_experts, 384);

  // DeepSeek-V2-Lite: greedy, n_shared_experts null means none.
  auto lite = attnkit::moe_config_from_json(R"({
    "model_type": "deepseek_v2", "hidden_size": 2048, "moe_intermediate_size": 1408,
    "n_routed_experts": 64, "n_shared_experts": null, "num_experts_per_tok": 6,
    "n_group": 1, "topk_group": 1, "topk_method": "greedy"})");
  ASSERT_TRUE(lite.ok()) << lite.status().to_string();
  EXPECT_EQ(lite->n_shared_experts, 0);
  EXPECT_EQ(lite->topk_method, MoeTopkMethod::kGreedy);
  EXPECT_FALSE(lite->norm_topk_prob);
}

TEST(MoeConfig, BadConfigsNameTheField) {
  const std::string v3 = R"("model_type": "deepseek_v3", "hidden_size": 64,
    "moe_intermediate_size": 32, "n_routed_experts": 16, "n_shared_experts": 1)";
  struct Case {
    std::string json;
    std::string needle;
  };
  const Case cases[] = {
      {"{" + v3 + R"(, "num_experts_per_tok": 17})",
       "num_experts_per_tok = 17 must be in [1, n_routed_experts = 16]"},
      {"{" + v3 + R"(, "num_experts_per_tok": 0})", "num_experts_per_tok = 0"},
      {"{" + v3 + "}", "num_experts_per_tok is missing"},
      {"{" + v3 + R"(, "num_experts_per_tok": null})", "num_experts_per_tok is null"},
      {"{" + v3 + R"(, "num_experts_per_tok": "8"})",
       "num_experts_per_tok = \"8\" must be an integer"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "n_group": 3})",
       "n_group = 3 must divide n_routed_experts = 16"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 5})",
       "topk_group = 5 must be in [1, n_group = 4]"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 0})",
       "topk_group = 0"},
      {"{" + v3 + R"(, "num_experts_per_tok": 9, "n_group": 4, "topk_group": 2})",
       "fewer than num_experts_per_tok = 9"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "scoring_func": "relu"})",
       "scoring_func = \"relu\""},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "topk_method": "random"})",
       "topk_method = \"random\""},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "norm_topk_prob": 1})",
       "norm_topk_prob = 1 must be true or false"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "routed_scaling_factor": 0})",
       "routed_scaling_factor = 0"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "n_shared_experts": -1})",
       "n_shared_experts = -1"},
      {"{" + v3 + R"(, "num_experts_per_tok": 4, "hidden_act": "gelu"})", "hidden_act = \"gelu\""},
      {"{" + v3 + R"(, "num_experts_per_tok": 2, "n_group": 16, "topk_group": 4})",
       "two best experts"},
      {R"({"model_type": "deepseek_v3", "hidden_size": 64, "n_routed_experts": 16, "num_experts_per_tok": 2})",
       "moe_intermediate_size is missing"},
      {R"({"model_type": "deepseek_v3", "hidden_size": 0, "moe_intermediate_size": 8, "n_routed_experts": 16, "num_experts_per_tok": 2})",
       "hidden_size = 0 must be > 0"},
      {R"({"model_type": "llama", "hidden_size": 64})", "model_type = \"llama\""},
      {R"({"hidden_size": 64, "intermediate_size": 8, "num_experts_per_tok": 2})",
       "no expert count"},
      {R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": false})",
       "norm_topk_prob = false"},
      {R"({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2})",
       "num_local_experts is missing"},
      {"{not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
  };
  for (const Case& k : cases) {
    const auto r = attnkit::moe_config_from_json(k.json);
    ASSERT_FALSE(r.ok()) << k.json;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(k.needle), std::string::npos)
        << "message: " << r.status().message() << "\nwanted: " << k.needle;
    EXPECT_EQ(r.status().message().rfind("moe_config_from_json: ", 0), 0u) << r.status().message();
  }
  // create() applies the same rules to a hand-built config.
  MoeConfig c = deepseek_v3_config();
  c.topk_method = static_cast<MoeTopkMethod>(9);
  const auto bad = MoeLayer::create(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("topk_method = 9"), std::string::npos);
  c = mixtral_config();
  c.n_shared_experts = 1;
  EXPECT_FALSE(MoeLayer::create(c).ok());
}

// Llama 4 (Llama4TextMoe, modeling_llama4.py), in float64 here: router
// logits, top-k by logit, each chosen expert e fed sigmoid(logit_e) * x
// (the input scaled, not the output), x @ gate_up_proj[e] with the gate in
// the first I columns and the up in the last I, (up * silu(gate)) @
// down_proj[e], summed unweighted, plus the shared expert.
struct Llama4Weights {
  std::vector<float> router, gate_up, down, sg, su, sd;
};

std::vector<double> llama4_reference(const MoeConfig& c, const Llama4Weights& w,
                                     const std::vector<float>& x, int64_t T,
                                     std::vector<int32_t>* ids, std::vector<double>* scales) {
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size,
                K = c.num_experts_per_tok;
  std::vector<double> y(sz(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<double> logit(sz(E), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t h = 0; h < H; ++h) logit[sz(e)] += double(w.router[sz(e * H + h)]) * xt[h];
    std::vector<int32_t> order(sz(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logit[sz(a)] > logit[sz(b)]; });
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = order[sz(k)];
      const double s = 1.0 / (1.0 + std::exp(-logit[sz(e)]));
      ids->push_back(e);
      scales->push_back(s);
      std::vector<double> gu(sz(2 * I), 0.0);
      for (int64_t j = 0; j < 2 * I; ++j)
        for (int64_t h = 0; h < H; ++h)
          gu[sz(j)] += s * xt[h] * double(w.gate_up[sz((e * H + h) * 2 * I + j)]);
      for (int64_t i = 0; i < I; ++i) {
        const double g = gu[sz(i)], u = gu[sz(I + i)], a = u * g / (1.0 + std::exp(-g));
        for (int64_t h = 0; h < H; ++h)
          y[sz(t * H + h)] += a * double(w.down[sz((e * I + i) * H + h)]);
      }
    }
    std::vector<double> xd(xt, xt + H);
    const auto shared = mlp_f64(xd.data(), w.sg.data(), w.su.data(), w.sd.data(), H, I);
    for (int64_t h = 0; h < H; ++h) y[sz(t * H + h)] += shared[sz(h)];
  }
  return y;
}

TEST(MoeLayer, Llama4InputScaledExpertsMatchFloat64Loop) {
  MoeConfig c;
  c.model_type = "llama4_text";
  c.naming = MoeWeightNaming::kLlama4;
  c.hidden_size = 20;
  c.n_routed_experts = 5;
  c.moe_intermediate_size = 12;
  c.n_shared_experts = 1;
  c.scoring_func = MoeScoringFunc::kSigmoid;
  c.norm_topk_prob = false;
  const int64_t E = 5, H = 20, I = 12, T = 2 * 7;
  Rng rng(307);
  auto u = [&](int64_t n, float a) { return attnkit_test::uniform_vector(sz(n), rng, -a, a); };
  Llama4Weights w{u(E * H, 0.6f), u(E * H * 2 * I, 0.5f), u(E * I * H, 0.5f),
                  u(I * H, 0.3f), u(I * H, 0.3f),         u(H * I, 0.3f)};
  const std::string f = "model.layers.1.feed_forward.";
  WeightMap m;
  m[f + "router.weight"] = attnkit::make_view(w.router.data(), DType::kF32, {E, H});
  m[f + "experts.gate_up_proj"] = attnkit::make_view(w.gate_up.data(), DType::kF32, {E, H, 2 * I});
  m[f + "experts.down_proj"] = attnkit::make_view(w.down.data(), DType::kF32, {E, I, H});
  m[f + "shared_expert.gate_proj.weight"] = attnkit::make_view(w.sg.data(), DType::kF32, {I, H});
  m[f + "shared_expert.up_proj.weight"] = attnkit::make_view(w.su.data(), DType::kF32, {I, H});
  m[f + "shared_expert.down_proj.weight"] = attnkit::make_view(w.sd.data(), DType::kF32, {H, I});
  const auto x = attnkit_test::normal_vector(sz(T * H), rng);
  for (int64_t k : {1, 2}) {  // Llama 4 routes to one expert; top-2 checks the sum
    c.num_experts_per_tok = k;
    auto layer = MoeLayer::create(c);
    ASSERT_TRUE(layer.ok()) << layer.status().to_string();
    auto st = layer->load_weights(m, "model.layers.1.");
    ASSERT_TRUE(st.ok()) << st.to_string();
    std::vector<int32_t> ids;
    std::vector<double> scales;
    const auto want = llama4_reference(c, w, x, T, &ids, &scales);
    for (attnkit::Backend backend : {attnkit::Backend::kAuto, attnkit::Backend::kReference}) {
      std::vector<float> out(sz(T * H), -7.0f);
      MoeRouting r;
      attnkit::RunOptions run;
      run.backend = backend;
      st = layer->forward(attnkit::make_view(x.data(), DType::kF32, {2, 7, H}),
                          attnkit::make_view(out.data(), DType::kF32, {2, 7, H}), &r, run);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(r.expert_ids, ids);
      EXPECT_TRUE(attnkit_test::all_close("input scales", r.weights, scales, {0.0, 1e-6}));
      double scale = 0;
      for (double v : want) scale = std::max(scale, std::fabs(v));
      EXPECT_TRUE(attnkit_test::all_close("out", out, want, {1e-5 * scale, 0.0}));
    }
  }
  // The fused tensors are repacked; the router and shared expert stay by name.
  auto layer = MoeLayer::create(c);
  ASSERT_TRUE(layer.ok() && layer->load_weights(m, "model.layers.1.").ok());
  EXPECT_TRUE(layer->weight("feed_forward.router.weight").ok());
  EXPECT_TRUE(layer->weight("feed_forward.shared_expert.down_proj.weight").ok());
  EXPECT_EQ(layer->weight("feed_forward.experts.gate_up_proj").status().code(),
            StatusCode::kNotFound);
  // A transposed (nn.Linear-shaped) down_proj, or a missing shared expert, is named.
  WeightMap bad = m;
  bad[f + "experts.down_proj"] = attnkit::make_view(w.down.data(), DType::kF32, {E, H, I});
  auto fresh = MoeLayer::create(c);
  ASSERT_TRUE(fresh.ok());
  auto st = fresh->load_weights(bad, "model.layers.1.");
  EXPECT_NE(st.message().find(f + "experts.down_proj"), std::string::npos) << st.message();
  bad = m;
  bad.erase(f + "shared_expert.up_proj.weight");
  st = fresh->load_weights(bad, "model.layers.1.");
  EXPECT_NE(st.message().find(f + "shared_expert.up_proj.weight"), std::string::npos)
      << st.message();
  EXPECT_FALSE(fresh->loaded());
}

}  // namespace
