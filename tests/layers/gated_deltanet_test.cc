// GatedDeltaNet against an independent float64 model of Qwen3-Next's
// Gated DeltaNet written here from the recurrent form (token by token, no
// chunks), on seeded random weights and inputs: prefill longer than a
// chunk, prefill then token-by-token decode, 1-token prompts, batch > 1,
// both backends; and every bad input, which must change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/gated_deltanet.h"
#include "common/random.h"

namespace attnkit {
namespace {

using attnkit_test::Rng;

struct Weights {
  std::vector<float> qkvz, ba, conv, a_log, dt_bias, norm, out;
};

int64_t kd(const GatedDeltaNetConfig& c) { return c.num_k_heads * c.key_head_dim; }
int64_t vd(const GatedDeltaNetConfig& c) { return c.num_v_heads * c.value_head_dim; }
int64_t channels(const GatedDeltaNetConfig& c) { return 2 * kd(c) + vd(c); }

Weights random_weights(const GatedDeltaNetConfig& c, Rng& rng) {
  const int64_t H = c.hidden_size;
  const float sx = 1.0f / std::sqrt(static_cast<float>(H));
  Weights w;
  w.qkvz = attnkit_test::uniform_vector((2 * kd(c) + 2 * vd(c)) * H, rng, -2 * sx, 2 * sx);
  w.ba = attnkit_test::uniform_vector(2 * c.num_v_heads * H, rng, -2 * sx, 2 * sx);
  w.conv = attnkit_test::uniform_vector(channels(c) * c.conv_kernel, rng, -0.7f, 0.7f);
  // A = exp(A_log) in [0.3, 12] and dt_bias around softplus's knee: decays
  // per token from about 0.99 to about 1e-5, so both slow and fast forgetting occur.
  w.a_log = attnkit_test::uniform_vector(c.num_v_heads, rng, -1.2f, 2.5f);
  w.dt_bias = attnkit_test::uniform_vector(c.num_v_heads, rng, -4.0f, 1.0f);
  w.norm = attnkit_test::uniform_vector(c.value_head_dim, rng, 0.5f, 1.5f);
  const float so = 1.0f / std::sqrt(static_cast<float>(vd(c)));
  w.out = attnkit_test::uniform_vector(c.hidden_size * vd(c), rng, -so, so);
  return w;
}

WeightMap weight_map(const GatedDeltaNetConfig& c, const Weights& w, const std::string& p) {
  const int64_t H = c.hidden_size;
  WeightMap m;
  m[p + "in_proj_qkvz.weight"] = make_view(w.qkvz.data(), DType::kF32, {2 * kd(c) + 2 * vd(c), H});
  m[p + "in_proj_ba.weight"] = make_view(w.ba.data(), DType::kF32, {2 * c.num_v_heads, H});
  m[p + "conv1d.weight"] = make_view(w.conv.data(), DType::kF32, {channels(c), 1, c.conv_kernel});
  m[p + "A_log"] = make_view(w.a_log.data(), DType::kF32, {c.num_v_heads});
  m[p + "dt_bias"] = make_view(w.dt_bias.data(), DType::kF32, {c.num_v_heads});
  m[p + "norm.weight"] = make_view(w.norm.data(), DType::kF32, {c.value_head_dim});
  m[p + "out_proj.weight"] = make_view(w.out.data(), DType::kF32, {H, vd(c)});
  return m;
}

// The layer in float64, token by token. Its state: the conv's last K - 1
// inputs and S per (sequence, value head), continued across calls.
class Reference {
 public:
  Reference(const GatedDeltaNetConfig& c, const Weights& w, int64_t batch)
      : c_(c), w_(w), batch_(batch) {
    conv_.assign(batch * (c.conv_kernel - 1) * channels(c), 0.0);
    s_.assign(batch * c.num_v_heads * c.key_head_dim * c.value_head_dim, 0.0);
  }

  // x [batch, seq, hidden] -> [batch, seq, hidden]
  std::vector<double> run(const std::vector<float>& x, int64_t seq) {
    const int64_t H = c_.hidden_size, Hk = c_.num_k_heads, Hv = c_.num_v_heads;
    const int64_t dk = c_.key_head_dim, dv = c_.value_head_dim, K = c_.conv_kernel;
    const int64_t r = Hv / Hk, C = channels(c_), P = 2 * kd(c_) + 2 * vd(c_);
    std::vector<double> out(batch_ * seq * H, 0.0);
    for (int64_t b = 0; b < batch_; ++b) {
      for (int64_t t = 0; t < seq; ++t) {
        const float* xt = x.data() + (b * seq + t) * H;
        std::vector<double> proj(P, 0.0), pba(2 * Hv, 0.0);
        for (int64_t o = 0; o < P; ++o)
          for (int64_t i = 0; i < H; ++i) proj[o] += double{w_.qkvz[o * H + i]} * xt[i];
        for (int64_t o = 0; o < 2 * Hv; ++o)
          for (int64_t i = 0; i < H; ++i) pba[o] += double{w_.ba[o * H + i]} * xt[i];
        // Un-group: key head g's block is [q | k | v (r heads) | z (r heads)].
        const int64_t gw = 2 * dk + 2 * r * dv;
        std::vector<double> in(C), z(Hv * dv), a(Hv), bb(Hv);
        for (int64_t g = 0; g < Hk; ++g) {
          for (int64_t d = 0; d < dk; ++d) {
            in[g * dk + d] = proj[g * gw + d];
            in[kd(c_) + g * dk + d] = proj[g * gw + dk + d];
          }
          for (int64_t e = 0; e < r * dv; ++e) {
            in[2 * kd(c_) + g * r * dv + e] = proj[g * gw + 2 * dk + e];
            z[g * r * dv + e] = proj[g * gw + 2 * dk + r * dv + e];
          }
          for (int64_t i = 0; i < r; ++i) {
            bb[g * r + i] = pba[g * 2 * r + i];
            a[g * r + i] = pba[g * 2 * r + r + i];
          }
        }
        // Conv over [state rows (oldest first), this input], then SiLU.
        double* cs = conv_.data() + b * (K - 1) * C;
        std::vector<double> mixed(C);
        for (int64_t ch = 0; ch < C; ++ch) {
          double acc = w_.conv[ch * K + K - 1] * in[ch];
          for (int64_t j = 0; j < K - 1; ++j) acc += w_.conv[ch * K + j] * cs[j * C + ch];
          mixed[ch] = acc / (1.0 + std::exp(-acc));
        }
        for (int64_t j = 0; j + 1 < K - 1; ++j)
          for (int64_t ch = 0; ch < C; ++ch) cs[j * C + ch] = cs[(j + 1) * C + ch];
        if (K > 1)
          for (int64_t ch = 0; ch < C; ++ch) cs[(K - 2) * C + ch] = in[ch];
        // L2 norms; q scaled.
        for (int64_t hh = 0; hh < 2 * Hk; ++hh) {
          double ss = 0.0;
          for (int64_t d = 0; d < dk; ++d) ss += mixed[hh * dk + d] * mixed[hh * dk + d];
          double f = 1.0 / std::sqrt(ss + 1e-6);
          if (hh < Hk) f /= std::sqrt(static_cast<double>(dk));
          for (int64_t d = 0; d < dk; ++d) mixed[hh * dk + d] *= f;
        }
        std::vector<double> o(Hv * dv);
        for (int64_t h = 0; h < Hv; ++h) {
          const int64_t kh = h / r;
          const double* q = mixed.data() + kh * dk;
          const double* k = mixed.data() + kd(c_) + kh * dk;
          const double* v = mixed.data() + 2 * kd(c_) + h * dv;
          const double sp = a[h] + w_.dt_bias[h];
          const double g = -std::exp(double{w_.a_log[h]}) * std::log1p(std::exp(sp));
          const double beta = 1.0 / (1.0 + std::exp(-bb[h]));
          double* S = s_.data() + (b * Hv + h) * dk * dv;
          for (int64_t i = 0; i < dk * dv; ++i) S[i] *= std::exp(g);
          for (int64_t j = 0; j < dv; ++j) {
            double kv = 0.0;
            for (int64_t i = 0; i < dk; ++i) kv += S[i * dv + j] * k[i];
            const double delta = beta * (v[j] - kv);
            for (int64_t i = 0; i < dk; ++i) S[i * dv + j] += k[i] * delta;
            double oj = 0.0;
            for (int64_t i = 0; i < dk; ++i) oj += S[i * dv + j] * q[i];
            o[h * dv + j] = oj;
          }
          double ss = 0.0;
          for (int64_t j = 0; j < dv; ++j) ss += o[h * dv + j] * o[h * dv + j];
          const double inv = 1.0 / std::sqrt(ss / dv + c_.rms_norm_eps);
          for (int64_t j = 0; j < dv; ++j) {
            const double zz = z[h * dv + j];
            o[h * dv + j] *= inv * w_.norm[j] * zz / (1.0 + std::exp(-zz));
          }
        }
        double* ot = out.data() + (b * seq + t) * H;
        for (int64_t n = 0; n < H; ++n)
          for (int64_t i = 0; i < Hv * dv; ++i) ot[n] += double{w_.out[n * vd(c_) + i]} * o[i];
      }
    }
    return out;
  }

  const std::vector<double>& state() const { return s_; }

 private:
  GatedDeltaNetConfig c_;
  const Weights& w_;
  int64_t batch_;
  std::vector<double> conv_, s_;
};

// max |got - want| <= rel * max |want|: the bound, 1e-4 of the
// output's magnitude. fp32 rounding through projections of a few hundred
// terms and a recurrence that forgets geometrically stays near 1e-6 of it.
template <class Got>
void expect_close(const Got& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0.0, worst = 0.0;
  size_t at = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  EXPECT_GT(scale, 0.0) << what;
  EXPECT_LE(worst, rel * scale) << what << ": worst element " << at << " got " << got[at]
                                << " want " << want[at] << ", bound " << rel * scale;
}

constexpr double kRel = 1e-4;

GatedDeltaNetConfig small_config(int64_t dk, int64_t dv) {
  GatedDeltaNetConfig c;
  c.hidden_size = 48;
  c.num_k_heads = 2;
  c.num_v_heads = 4;
  c.key_head_dim = dk;
  c.value_head_dim = dv;
  c.conv_kernel = 4;
  c.rms_norm_eps = 1e-6;
  return c;
}

struct Fixture {
  GatedDeltaNetConfig c;
  Weights w;
  GatedDeltaNet layer;
};

Fixture make(const GatedDeltaNetConfig& c, uint64_t seed) {
  Rng rng(seed);
  Weights w = random_weights(c, rng);
  auto layer = GatedDeltaNet::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().message();
  const WeightMap m = weight_map(c, w, "model.layers.0.linear_attn.");
  const Status st = layer->load_weights(m, "model.layers.0.linear_attn");
  EXPECT_TRUE(st.ok()) << st.message();
  return {c, std::move(w), std::move(layer).value()};
}

class GatedDeltaNetBackends : public ::testing::TestWithParam<Backend> {};

TEST_P(GatedDeltaNetBackends, PrefillLongerThanChunksMatchesReference) {
  // dv = 24: one full 16-column block and a tail; dv = 8: a tail only.
  for (auto [dk, dv] : {std::pair<int64_t, int64_t>{16, 24}, {32, 8}}) {
    Fixture f = make(small_config(dk, dv), 7 + dk);
    const int64_t batch = 2, seq = 200;
    Rng rng(11);
    const std::vector<float> x = attnkit_test::uniform_vector(batch * seq * 48, rng);
    std::vector<float> out(x.size(), 0.0f);
    RunOptions run{GetParam(), 0};
    ASSERT_TRUE(f.layer
                    .forward(make_view(x.data(), DType::kF32, {batch, seq, 48}),
                             make_view(out.data(), DType::kF32, {batch, seq, 48}), nullptr, run)
                    .ok());
    Reference ref(f.c, f.w, batch);
    expect_close(out, ref.run(x, seq), kRel, "prefill");
  }
}

TEST_P(GatedDeltaNetBackends, PrefillThenDecodeContinuesExactly) {
  Fixture f = make(small_config(16, 24), 3);
  const int64_t batch = 3, prompt = 130, decode = 20, H = 48;
  Rng rng(5);
  const std::vector<float> x = attnkit_test::uniform_vector(batch * (prompt + decode) * H, rng);
  auto state = f.layer.new_state(batch);
  ASSERT_TRUE(state.ok());
  RunOptions run{GetParam(), 0};
  Reference ref(f.c, f.w, batch);

  // The prompt, [batch, prompt, H] as a strided view of x's first rows.
  TensorView xp = make_view(x.data(), DType::kF32, {batch, prompt, H});
  xp.strides[0] = (prompt + decode) * H;
  std::vector<float> out(batch * prompt * H);
  ASSERT_TRUE(
      f.layer.forward(xp, make_view(out.data(), DType::kF32, {batch, prompt, H}), &*state, run)
          .ok());
  std::vector<float> xs(batch * prompt * H);
  for (int64_t b = 0; b < batch; ++b)
    std::copy_n(x.data() + b * (prompt + decode) * H, prompt * H, xs.data() + b * prompt * H);
  expect_close(out, ref.run(xs, prompt), kRel, "prompt");

  for (int64_t t = 0; t < decode; ++t) {
    TensorView xt = make_view(x.data() + (prompt + t) * H, DType::kF32, {batch, 1, H});
    xt.strides[0] = (prompt + decode) * H;
    std::vector<float> o(batch * H), x1(batch * H);
    ASSERT_TRUE(
        f.layer.forward(xt, make_view(o.data(), DType::kF32, {batch, 1, H}), &*state, run).ok());
    for (int64_t b = 0; b < batch; ++b)
      std::copy_n(x.data() + (b * (prompt + decode) + prompt + t) * H, H, x1.data() + b * H);
    expect_close(o, ref.run(x1, 1), kRel, ("decode step " + std::to_string(t)).c_str());
  }
  const TensorView& s = state->recurrent_state();
  const std::vector<float> got(s.ptr<const float>(), s.ptr<const float>() + s.numel());
  expect_close(got, ref.state(), kRel, "recurrent state");
}

TEST_P(GatedDeltaNetBackends, OneTokenPromptsThenDecode) {
  Fixture f = make(small_config(32, 8), 9);
  const int64_t batch = 2, H = 48;
  auto state = f.layer.new_state(batch);
  ASSERT_TRUE(state.ok());
  Reference ref(f.c, f.w, batch);
  Rng rng(13);
  // 1 token, then 1, then 70 (the chunked form, from a non-zero state), then 1.
  for (int64_t seq : {1, 1, 70, 1}) {
    const std::vector<float> x = attnkit_test::uniform_vector(batch * seq * H, rng);
    std::vector<float> out(x.size());
    ASSERT_TRUE(f.layer
                    .forward(make_view(x.data(), DType::kF32, {batch, seq, H}),
                             make_view(out.data(), DType::kF32, {batch, seq, H}), &*state,
                             {GetParam(), 0})
                    .ok());
    expect_close(out, ref.run(x, seq), kRel, ("call of " + std::to_string(seq)).c_str());
  }
}

TEST_P(GatedDeltaNetBackends, CallsLongerThanABlockRunInPiecesExactly) {
  // The layer runs at most 256 rows at a time (its scratch does not grow
  // with the call): 600 tokens of 2 sequences are pieces of 256, 256 and
  // 88 rows each, the conv inputs and state carried between them; then 3
  // sequences of 100 tokens (two share a block, the third starts the next)
  // and a decode step, all from the state the previous call left.
  Fixture f = make(small_config(16, 24), 31);
  const int64_t H = 48;
  Rng rng(17);
  for (int64_t batch : {2, 3}) {
    auto state = f.layer.new_state(batch);
    ASSERT_TRUE(state.ok());
    Reference ref(f.c, f.w, batch);
    for (int64_t seq : {batch == 2 ? int64_t{600} : int64_t{100}, int64_t{1}}) {
      const std::vector<float> x = attnkit_test::uniform_vector(batch * seq * H, rng);
      std::vector<float> out(x.size());
      ASSERT_TRUE(f.layer
                      .forward(make_view(x.data(), DType::kF32, {batch, seq, H}),
                               make_view(out.data(), DType::kF32, {batch, seq, H}), &*state,
                               {GetParam(), 0})
                      .ok());
      expect_close(out, ref.run(x, seq), kRel,
                   ("batch " + std::to_string(batch) + ", call of " + std::to_string(seq)).c_str());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, GatedDeltaNetBackends,
                         ::testing::Values(Backend::kReference, Backend::kFast), [](const auto& p) {
                           return p.param == Backend::kReference ? std::string("Reference")
                                                                 : std::string("Fast");
                         });

TEST(GatedDeltaNet, SplitCallsEqualOneCall) {
  // A prompt in pieces of 50 and 77 tokens computes what one call of 127 does.
  Fixture f = make(small_config(16, 24), 21);
  const int64_t H = 48;
  Rng rng(2);
  const std::vector<float> x = attnkit_test::uniform_vector(127 * H, rng);
  std::vector<float> whole(x.size()), parts(x.size());
  ASSERT_TRUE(f.layer
                  .forward(make_view(x.data(), DType::kF32, {1, 127, H}),
                           make_view(whole.data(), DType::kF32, {1, 127, H}))
                  .ok());
  auto state = f.layer.new_state(1);
  ASSERT_TRUE(state.ok());
  ASSERT_TRUE(f.layer
                  .forward(make_view(x.data(), DType::kF32, {1, 50, H}),
                           make_view(parts.data(), DType::kF32, {1, 50, H}), &*state)
                  .ok());
  ASSERT_TRUE(f.layer
                  .forward(make_view(x.data() + 50 * H, DType::kF32, {1, 77, H}),
                           make_view(parts.data() + 50 * H, DType::kF32, {1, 77, H}), &*state)
                  .ok());
  std::vector<double> want(whole.begin(), whole.end());
  expect_close(parts, want, kRel, "split vs whole");
}

TEST(GatedDeltaNet, WeightNamesAndShapes) {
  auto layer = GatedDeltaNet::create(small_config(16, 24));
  ASSERT_TRUE(layer.ok());
  const std::vector<std::string> want = {
      "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
      "norm.weight",         "out_proj.weight"};
  EXPECT_EQ(layer->weight_names(), want);
}

TEST(GatedDeltaNet, RejectsBadConfigs) {
  GatedDeltaNetConfig c = small_config(16, 24);
  c.num_v_heads = 3;
  auto r = GatedDeltaNet::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("num_v_heads = 3"), std::string::npos)
      << r.status().message();
  c = small_config(16, 24);
  c.conv_kernel = 0;
  r = GatedDeltaNet::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("conv_kernel = 0"), std::string::npos);
}

TEST(GatedDeltaNet, RejectsBadWeightsAndLeavesTheLayerUnchanged) {
  Fixture f = make(small_config(16, 24), 4);
  const std::string p = "model.layers.0.linear_attn.";
  const int64_t H = 48;
  Rng rng(8);
  const std::vector<float> x = attnkit_test::uniform_vector(10 * H, rng);
  std::vector<float> before(x.size()), after(x.size());
  auto xv = make_view(x.data(), DType::kF32, {1, 10, H});
  ASSERT_TRUE(f.layer.forward(xv, make_view(before.data(), DType::kF32, {1, 10, H})).ok());

  Rng rng2(99);
  Weights other = random_weights(f.c, rng2);
  auto expect_error = [&](WeightMap m, const std::string& needle) {
    const Status st = f.layer.load_weights(m, p);
    ASSERT_FALSE(st.ok()) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  WeightMap m = weight_map(f.c, other, p);
  m.erase(p + "dt_bias");
  expect_error(m, "dt_bias");
  m = weight_map(f.c, other, p);
  m[p + "conv1d.weight"] =
      make_view(other.conv.data(), DType::kF32, {channels(f.c), f.c.conv_kernel});
  expect_error(m, "conv1d.weight");
  m = weight_map(f.c, other, p);
  m[p + "in_proj_ba.weight"] = make_view(other.ba.data(), DType::kF32, {f.c.num_v_heads, H});
  expect_error(m, "in_proj_ba.weight");
  m = weight_map(f.c, other, p);
  m[p + "extra.weight"] = make_view(other.norm.data(), DType::kF32, {f.c.value_head_dim});
  expect_error(m, "extra.weight");
  for (const char* name : {"A_log", "dt_bias"}) {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      Weights w = other;
      (std::string(name) == "A_log" ? w.a_log : w.dt_bias)[2] = bad;
      expect_error(weight_map(f.c, w, p), std::string(name) + "[2]");
    }
  }
  ASSERT_TRUE(f.layer.forward(xv, make_view(after.data(), DType::kF32, {1, 10, H})).ok());
  EXPECT_EQ(before, after);
}

TEST(GatedDeltaNet, RejectsBadCallsAndChangesNothing) {
  Fixture f = make(small_config(16, 24), 6);
  const int64_t H = 48;
  Rng rng(1);
  const std::vector<float> x = attnkit_test::uniform_vector(2 * 5 * H, rng);
  std::vector<float> out(x.size(), 7.0f);
  const auto xv = make_view(x.data(), DType::kF32, {2, 5, H});
  const auto ov = make_view(out.data(), DType::kF32, {2, 5, H});
  auto state = f.layer.new_state(2);
  ASSERT_TRUE(state.ok());
  // Give the state something to lose.
  ASSERT_TRUE(f.layer.forward(xv, ov, &*state).ok());
  std::fill(out.begin(), out.end(), 7.0f);
  const TensorView& sr = state->recurrent_state();
  const TensorView& sc = state->conv_state();
  const std::vector<float> rec0(sr.ptr<float>(), sr.ptr<float>() + sr.numel());
  const std::vector<float> conv0(sc.ptr<float>(), sc.ptr<float>() + sc.numel());

  auto expect_error = [&](const Status& st, const std::string& needle) {
    ASSERT_FALSE(st.ok()) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }));
    EXPECT_TRUE(std::equal(rec0.begin(), rec0.end(), sr.ptr<float>()));
    EXPECT_TRUE(std::equal(conv0.begin(), conv0.end(), sc.ptr<float>()));
  };
  auto other_batch = f.layer.new_state(3);
  ASSERT_TRUE(other_batch.ok());
  expect_error(f.layer.forward(xv, ov, &*other_batch), "state holds 3 sequences");
  Fixture g = make(small_config(32, 8), 6);
  auto other_layer = g.layer.new_state(2);
  ASSERT_TRUE(other_layer.ok());
  expect_error(f.layer.forward(xv, ov, &*other_layer), "another layer's");
  expect_error(f.layer.forward(make_view(x.data(), DType::kF32, {2, 5, 40}), ov, &*state),
               "hidden_size");
  expect_error(f.layer.forward(xv, make_view(out.data(), DType::kF32, {2, 4, H}), &*state),
               "x.shape[1]");
  expect_error(f.layer.forward(xv, xv, &*state), "overlaps");
  expect_error(f.layer.forward(xv, ov, &*state, {Backend::kAuto, -1}), "num_threads");
  auto unloaded = GatedDeltaNet::create(f.c);
  ASSERT_TRUE(unloaded.ok());
  expect_error(unloaded->forward(xv, ov, &*state), "not loaded");
  auto bad = f.layer.new_state(0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("batch_size = 0"), std::string::npos);
}

}  // namespace
}  // namespace attnkit
