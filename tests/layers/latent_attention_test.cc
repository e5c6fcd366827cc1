// LatentAttention (MLA) against a float64 model written here from the
// equations of shared/reference/mla.md (sections 1-4), on seeded random
// weights and inputs. The shapes are small but every dimension differs from
// every other (hidden 40, heads 3, q_lora 24, kv_lora 28, nope 12, rope 8,
// v 10, so d_qk 20, latent row 36, H*d_qk 60, H*(d_n+d_v) 66, H*d_v 30), so
// a transposed or mis-split weight changes the result instead of passing.
//
// Tolerance: the issue's bound, max |actual - expected| <= 1e-5 * max
// |expected| per output tensor. fp32 evaluation of reductions of length
// <= 66 accumulates ~sqrt(66) * 6e-8 ~ 5e-7 relative per stage over four
// stages, so an exact implementation sits near 1e-6 and any wrong weight,
// split, scale or pairing lands at O(1e-1).
#include "attnkit/latent_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstring>
#include <numbers>
#include <string>
#include <vector>

#include "common/batch_steps.h"
#include "common/kv_quant_f64.h"
#include "common/random.h"
#include "kernels/linear.h"
#include "ops/kv_quant.h"

namespace attnkit {
namespace {

using attnkit_test::Rng;

constexpr double kRelTol = 1e-5;

MlaConfig small_config(bool q_lora, bool yarn) {
  MlaConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 40;
  c.num_attention_heads = 3;
  c.q_lora_rank = q_lora ? 24 : 0;
  c.kv_lora_rank = 28;
  c.qk_nope_head_dim = 12;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 10;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.max_position_embeddings = 256;
  if (yarn) {
    // orig 64, beta 8/1 over 4 pairs gives ramps 0, 0.5, 1, 1: one pair
    // kept, one blended, two interpolated, so the correction is exercised.
    c.rope_scaling.type = RopeScaling::Type::kYarn;
    c.rope_scaling.factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = 64;
    c.rope_scaling.beta_fast = 8.0;
    c.rope_scaling.beta_slow = 1.0;
    c.rope_scaling.mscale = 0.707;
    c.rope_scaling.mscale_all_dim = 0.707;
  }
  return c;
}

// ---- the float64 model -------------------------------------------------

struct RefWeights {
  std::vector<float> q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, o;
};

RefWeights random_weights(const MlaConfig& c, uint64_t seed) {
  Rng rng(seed);
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dqk = c.qk_nope_head_dim + c.qk_rope_head_dim,
                dv = c.v_head_dim, dr = c.qk_rope_head_dim, dn = c.qk_nope_head_dim;
  // Entries ~ U(-1, 1) / sqrt(fan_in) keep every activation O(1).
  const auto mat = [&](int64_t out, int64_t in) {
    const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(in)));
    return attnkit_test::uniform_vector(static_cast<size_t>(out * in), rng, -s, s);
  };
  RefWeights w;
  if (dq > 0) {
    w.q_a = mat(dq, d);
    w.q_a_norm = attnkit_test::uniform_vector(static_cast<size_t>(dq), rng, 0.5f, 1.5f);
    w.q_b = mat(H * dqk, dq);
  } else {
    w.q = mat(H * dqk, d);
  }
  w.kv_a = mat(dc + dr, d);
  w.kv_a_norm = attnkit_test::uniform_vector(static_cast<size_t>(dc), rng, 0.5f, 1.5f);
  w.kv_b = mat(H * (dn + dv), dc);
  w.o = mat(d, H * dv);
  return w;
}

WeightMap weight_map(const MlaConfig& c, const RefWeights& w, const std::string& prefix = "") {
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, dqk = dn + dr;
  WeightMap m;
  if (dq > 0) {
    m[prefix + "q_a_proj.weight"] = make_view(w.q_a.data(), DType::kF32, {dq, d});
    m[prefix + "q_a_layernorm.weight"] = make_view(w.q_a_norm.data(), DType::kF32, {dq});
    m[prefix + "q_b_proj.weight"] = make_view(w.q_b.data(), DType::kF32, {H * dqk, dq});
  } else {
    m[prefix + "q_proj.weight"] = make_view(w.q.data(), DType::kF32, {H * dqk, d});
  }
  m[prefix + "kv_a_proj_with_mqa.weight"] = make_view(w.kv_a.data(), DType::kF32, {dc + dr, d});
  m[prefix + "kv_a_layernorm.weight"] = make_view(w.kv_a_norm.data(), DType::kF32, {dc});
  m[prefix + "kv_b_proj.weight"] = make_view(w.kv_b.data(), DType::kF32, {H * (dn + dv), dc});
  m[prefix + "o_proj.weight"] = make_view(w.o.data(), DType::kF32, {d, H * dv});
  return m;
}

// y = W x for W [out, in] row-major (nn.Linear).
std::vector<double> matvec(const std::vector<float>& w, const std::vector<double>& x, int64_t out,
                           int64_t in) {
  std::vector<double> y(static_cast<size_t>(out), 0.0);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) y[size_t(i)] += double(w[size_t(i * in + j)]) * x[size_t(j)];
  return y;
}

std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<float>& g, double eps) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= double(x.size());
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] / std::sqrt(ms + eps) * double(g[i]);
  return y;
}

// mla.md section 2: theta^(-2i/d_r), and YaRN's ramp between the beta_fast
// and beta_slow correction dims.
std::vector<double> ref_inv_freq(const MlaConfig& c) {
  const int64_t dr = c.qk_rope_head_dim;
  std::vector<double> f(size_t(dr / 2));
  for (int64_t i = 0; i < dr / 2; ++i) f[size_t(i)] = std::pow(c.rope_theta, -2.0 * i / dr);
  const RopeScaling& y = c.rope_scaling;
  if (y.type != RopeScaling::Type::kYarn) return f;
  const double orig = double(y.original_max_position_embeddings);
  const auto corr = [&](double rot) {
    return dr * std::log(orig / (2.0 * std::numbers::pi * rot)) / (2.0 * std::log(c.rope_theta));
  };
  const double low = std::max(std::floor(corr(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(y.beta_slow)), double(dr - 1));
  if (high == low) high += 0.001;
  for (int64_t i = 0; i < dr / 2; ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;
    f[size_t(i)] = f[size_t(i)] / y.factor * (1.0 - keep) + f[size_t(i)] * keep;
  }
  return f;
}

double ref_scale(const MlaConfig& c) {
  double s = 1.0 / std::sqrt(double(c.qk_nope_head_dim + c.qk_rope_head_dim));
  const RopeScaling& y = c.rope_scaling;
  if (y.type == RopeScaling::Type::kYarn && y.mscale_all_dim > 0 && y.factor > 1) {
    const double m = 0.1 * y.mscale_all_dim * std::log(y.factor) + 1.0;
    s *= m * m;
  }
  return s;
}

// RoPE: pair i is the complex number x[a] + i x[b] multiplied by
// e^(i pos f_i). Interleaved (DeepSeek's view_as_complex code): a = 2i,
// b = 2i+1. Half-split (rotate_half, rope_interleave = false): a = i,
// b = i + dr/2.
void ref_rope(double* x, int64_t dr, int64_t pos, const std::vector<double>& f, bool interleaved) {
  for (int64_t i = 0; i < dr / 2; ++i) {
    const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + dr / 2;
    const std::complex<double> z(x[a], x[b]);
    const std::complex<double> r = z * std::polar(1.0, double(pos) * f[size_t(i)]);
    x[a] = r.real();
    x[b] = r.imag();
  }
}

struct RefOut {
  std::vector<double> out;     // [B, S, d]
  std::vector<double> latent;  // [B, S, d_c + d_r]: normed c, roped k
};

// Full causal MLA over x [B, S, d] at positions pos[S] (shared by the batch).
RefOut reference(const MlaConfig& c, const RefWeights& w, const std::vector<float>& x, int64_t B,
                 int64_t S, const std::vector<int64_t>& pos) {
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, dqk = dn + dr;
  const std::vector<double> f = ref_inv_freq(c);
  const double sigma = ref_scale(c);
  RefOut r;
  r.out.assign(size_t(B * S * d), 0.0);
  r.latent.assign(size_t(B * S * (dc + dr)), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<std::vector<double>> q(static_cast<size_t>(S)), k(static_cast<size_t>(S)),
        v(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      std::vector<double> xs(x.begin() + (b * S + s) * d, x.begin() + (b * S + s + 1) * d);
      std::vector<double> qs =
          dq > 0 ? matvec(w.q_b, rmsnorm(matvec(w.q_a, xs, dq, d), w.q_a_norm, c.rms_norm_eps),
                          H * dqk, dq)
                 : matvec(w.q, xs, H * dqk, d);
      for (int64_t h = 0; h < H; ++h)
        ref_rope(&qs[size_t(h * dqk + dn)], dr, pos[size_t(s)], f, c.rope_interleave);
      const std::vector<double> kva = matvec(w.kv_a, xs, dc + dr, d);
      const std::vector<double> cl =
          rmsnorm(std::vector<double>(kva.begin(), kva.begin() + dc), w.kv_a_norm, c.rms_norm_eps);
      std::vector<double> kr(kva.begin() + dc, kva.end());
      ref_rope(kr.data(), dr, pos[size_t(s)], f, c.rope_interleave);
      std::copy(cl.begin(), cl.end(), r.latent.begin() + (b * S + s) * (dc + dr));
      std::copy(kr.begin(), kr.end(), r.latent.begin() + (b * S + s) * (dc + dr) + dc);
      // [k_nope_h ; v_h] = kv_b_proj[h] c, per-head blocks of d_n + d_v rows.
      const std::vector<double> kvb = matvec(w.kv_b, cl, H * (dn + dv), dc);
      std::vector<double> ks(size_t(H * dqk)), vs(size_t(H * dv));
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < dn; ++i) ks[size_t(h * dqk + i)] = kvb[size_t(h * (dn + dv) + i)];
        for (int64_t i = 0; i < dr; ++i) ks[size_t(h * dqk + dn + i)] = kr[size_t(i)];
        for (int64_t i = 0; i < dv; ++i)
          vs[size_t(h * dv + i)] = kvb[size_t(h * (dn + dv) + dn + i)];
      }
      q[size_t(s)] = std::move(qs);
      k[size_t(s)] = std::move(ks);
      v[size_t(s)] = std::move(vs);
    }
    for (int64_t t = 0; t < S; ++t) {
      std::vector<double> o(size_t(H * dv), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> sc(size_t(t + 1));
        double mx = -1e300;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int64_t i = 0; i < dqk; ++i)
            dot += q[size_t(t)][size_t(h * dqk + i)] * k[size_t(s)][size_t(h * dqk + i)];
          sc[size_t(s)] = sigma * dot;
          mx = std::max(mx, sc[size_t(s)]);
        }
        double den = 0.0;
        for (double& e : sc) den += (e = std::exp(e - mx));
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t i = 0; i < dv; ++i)
            o[size_t(h * dv + i)] += sc[size_t(s)] / den * v[size_t(s)][size_t(h * dv + i)];
      }
      const std::vector<double> u = matvec(w.o, o, d, H * dv);
      std::copy(u.begin(), u.end(), r.out.begin() + (b * S + t) * d);
    }
  }
  return r;
}

// max |a - e| / max |e| over the slice, reported with the worst element.
::testing::AssertionResult rel_close(const std::string& what, const float* a, const double* e,
                                     size_t n, double tol = kRelTol) {
  double scale = 0.0, worst = 0.0;
  size_t wi = 0;
  for (size_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(e[i]));
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(double(a[i]) - e[i]);
    if (!(err <= worst)) {
      worst = err;
      wi = i;
    }
  }
  const double rel = worst / scale;
  auto res = rel <= tol ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
  return res << what << ": max|diff|/max|ref| = " << rel << " (bound " << tol << "), worst [" << wi
             << "] actual " << a[wi] << " expected " << e[wi];
}

struct Fixture {
  MlaConfig cfg;
  RefWeights w;
  LatentAttention layer;
};

Fixture make_from(const MlaConfig& cfg, uint64_t seed) {
  Fixture fx{cfg, {}, {}};
  fx.w = random_weights(fx.cfg, seed);
  auto layer = LatentAttention::create(fx.cfg);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  fx.layer = std::move(layer).value();
  const Status st = fx.layer.load_weights(weight_map(fx.cfg, fx.w));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return fx;
}

Fixture make(bool q_lora, bool yarn, uint64_t seed, bool rope_interleave = true) {
  MlaConfig cfg = small_config(q_lora, yarn);
  cfg.rope_interleave = rope_interleave;
  return make_from(cfg, seed);
}

// Latent rows of 96 + 16 channels: one whole block of 64 scales and a
// partial one (8-bit caches, kLatentScaleBlock).
Fixture make_wide_latent(uint64_t seed) {
  MlaConfig cfg = small_config(true, false);
  cfg.kv_lora_rank = 96;
  cfg.qk_rope_head_dim = 16;
  return make_from(cfg, seed);
}

// How far the layer's output may move, relative to its largest value, when
// its latents are stored as `dtype` rather than exactly: bf16 rounds each
// value by 2^-9 relative, int8 by half a step of 1/127 of its block's
// largest value, fp8 by 2^-4 relative; through softmax and two linear
// maps a few times that.
double latent_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 1e-2;
    case DType::kI8:
      return 3e-2;
    case DType::kFp8E4M3:
      return 1.5e-1;
    default:
      return kRelTol;
  }
}

std::vector<int64_t> iota(int64_t n, int64_t start = 0) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[size_t(i)] = start + i;
  return p;
}

// ---- correctness against the float64 model ----------------------------

struct Variant {
  bool q_lora, yarn;
  bool rope_interleave = true;
};

class LatentAttentionExact : public ::testing::TestWithParam<Variant> {};

TEST_P(LatentAttentionExact, BothFormsMatchFloat64Reference) {
  const Variant v = GetParam();
  Fixture fx = make(v.q_lora, v.yarn, 11 + 2 * v.q_lora + v.yarn, v.rope_interleave);
  const int64_t B = 2, S = 9, d = fx.cfg.hidden_size;
  Rng rng(99);
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * S * d), rng);
  // Positions far from 0 (past YaRN's original context) shared by the batch.
  const std::vector<int64_t> pos = iota(S, 70);
  const RefOut ref = reference(fx.cfg, fx.w, x, B, S, pos);
  for (Backend backend : {Backend::kReference, Backend::kAuto})
    for (MlaForm form : {MlaForm::kNaive, MlaForm::kAbsorbed, MlaForm::kAuto}) {
      std::vector<float> out(x.size(), 0.0f);
      RunOptions run;
      run.backend = backend;
      const Status st =
          fx.layer.forward(make_view(x.data(), DType::kF32, {B, S, d}),
                           make_view(out.data(), DType::kF32, {B, S, d}), pos, nullptr, run, form);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(rel_close(std::string("form ") + mla_form_name(form) +
                                (backend == Backend::kReference ? ", reference" : ", auto"),
                            out.data(), ref.out.data(), out.size()));
    }
}

INSTANTIATE_TEST_SUITE_P(QLoraYarn, LatentAttentionExact,
                         ::testing::Values(Variant{true, true}, Variant{true, false},
                                           Variant{false, true}, Variant{false, false},
                                           Variant{true, true, false},
                                           Variant{false, false, false}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.q_lora ? "QLora" : "QProj") +
                                  (param_info.param.yarn ? "Yarn" : "NoScaling") +
                                  (param_info.param.rope_interleave ? "" : "HalfSplitRope");
                         });

TEST(LatentAttention, NaiveEqualsAbsorbedAtRandomShapesAndBatch) {
  Fixture fx = make(true, true, 5);
  Rng rng(3);
  for (int trial = 0; trial < 3; ++trial) {
    const int64_t B = 1 + trial, T = 1 + 4 * trial, d = fx.cfg.hidden_size;
    const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * d), rng);
    // Per-batch positions ([batch*seq] form).
    std::vector<int64_t> pos(size_t(B * T));
    for (auto& p : pos) p = rng.integer(0, 500);
    std::vector<float> naive(x.size()), absorbed(x.size());
    const auto xv = make_view(x.data(), DType::kF32, {B, T, d});
    ASSERT_TRUE(fx.layer
                    .forward(xv, make_view(naive.data(), DType::kF32, {B, T, d}), pos, nullptr, {},
                             MlaForm::kNaive)
                    .ok());
    ASSERT_TRUE(fx.layer
                    .forward(xv, make_view(absorbed.data(), DType::kF32, {B, T, d}), pos, nullptr,
                             {}, MlaForm::kAbsorbed)
                    .ok());
    std::vector<double> wide(naive.begin(), naive.end());
    EXPECT_TRUE(rel_close("absorbed vs naive, trial " + std::to_string(trial), absorbed.data(),
                          wide.data(), wide.size()));
  }
}

// Prefill in chunks starting at a nonzero cache length, then decoding token
// by token, must reproduce full causal attention over the whole sequence;
// the cache must hold exactly the normed latent and the rotated shared key.
TEST(LatentAttention, ChunkedPrefillThenDecodeEqualsFullCausal) {
  const std::pair<bool, Backend> cases[] = {{true, Backend::kReference},
                                            {true, Backend::kAuto},
                                            {false, Backend::kReference},
                                            {false, Backend::kAuto}};
  for (const auto& [q_lora, backend] : cases) {
    Fixture fx = make(q_lora, true, 21 + q_lora);
    const int64_t B = 2, S = 12, d = fx.cfg.hidden_size, dkv = 36, max_len = 16;
    Rng rng(7);
    const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * S * d), rng);
    const RefOut ref = reference(fx.cfg, fx.w, x, B, S, iota(S));
    // Chunks [0,3) [3,8) then single tokens; forms alternate so that each
    // form reads latents the other one wrote.
    const int64_t bounds[] = {0, 3, 8, 9, 10, 11, 12};
    const MlaForm forms[] = {MlaForm::kNaive, MlaForm::kAbsorbed, MlaForm::kAuto,
                             MlaForm::kNaive, MlaForm::kAbsorbed, MlaForm::kAuto};
    auto cache = fx.layer.new_cache(B, max_len);
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    EXPECT_EQ(cache->values_per_token(), 28 + 8);
    EXPECT_EQ(cache->nbytes(), size_t(B * max_len * (28 + 8) * 4));
    std::vector<float> out(size_t(B * S * d), 0.0f);
    for (int c = 0; c < 6; ++c) {
      const int64_t t0 = bounds[c], T = bounds[c + 1] - t0;
      std::vector<float> xc(size_t(B * T * d)), oc(size_t(B * T * d));
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(x.begin() + (b * S + t0) * d, T * d, xc.begin() + b * T * d);
      RunOptions run;
      run.backend = backend;
      const Status st = fx.layer.forward(make_view(xc.data(), DType::kF32, {B, T, d}),
                                         make_view(oc.data(), DType::kF32, {B, T, d}), {},
                                         &cache.value(), run, forms[c]);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(cache->length(), t0 + T);
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(oc.begin() + b * T * d, T * d, out.begin() + (b * S + t0) * d);
    }
    EXPECT_TRUE(rel_close(q_lora ? "chunked, q_lora" : "chunked, q_proj", out.data(),
                          ref.out.data(), out.size()));
    // Cache contents: [RMSNorm(c) ; RoPE(k_rope)] per token, nothing else.
    const float* st = cache->storage().ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      EXPECT_TRUE(rel_close("cache rows, batch " + std::to_string(b), st + b * max_len * dkv,
                            ref.latent.data() + b * S * dkv, size_t(S * dkv)));
  }
}

// forward_batch over a latent pool: three sequences whose prompts, chunks
// and decodes share steps, each against the float64 model run on it alone;
// where the projections' rows are independent, the same bits as alone.
TEST(LatentAttention, ForwardBatchOverPagesMatchesEachSequenceAlone) {
  const std::vector<std::vector<int64_t>> steps = {{5, 2, 0}, {1, 3, 4}, {1, 1, 1},
                                                   {2, 0, 1}, {1, 1, 3}, {1, 1, 1}};
  for (bool q_lora : {true, false})
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
      SCOPED_TRACE(std::string(q_lora ? "q_lora " : "q_proj ") + dtype_name(dtype));
      Fixture fx = make(q_lora, true, 40 + q_lora);
      const int64_t d = fx.cfg.hidden_size;
      std::vector<int64_t> lengths(3, 0);
      for (const auto& step : steps)
        for (size_t s = 0; s < 3; ++s) lengths[s] += step[s];
      Rng rng(9);
      std::vector<std::vector<float>> x(3);
      for (size_t s = 0; s < 3; ++s)
        x[s] = attnkit_test::uniform_vector(size_t(lengths[s] * d), rng);
      auto forward = [&](PagedKVCache& pool) {
        return
            [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
                const TensorView& ov) { return fx.layer.forward_batch(xv, cu, ids, pool, 0, ov); };
      };
      auto pool = fx.layer.new_paged_cache(30, 3, 1, dtype);
      ASSERT_TRUE(pool.ok()) << pool.status().to_string();
      EXPECT_EQ(pool->spec().head_dim, fx.cfg.kv_lora_rank + fx.cfg.qk_rope_head_dim);
      std::vector<std::vector<float>> out, alone;
      attnkit_test::run_batch_steps(*pool, d, x, steps, &out, forward(*pool));
      for (size_t s = 0; s < 3; ++s) {
        const RefOut ref = reference(fx.cfg, fx.w, x[s], 1, lengths[s], iota(lengths[s]));
        // Against exact latents: bf16 rounds 2^-9 relative per stored value,
        // int8 and fp8 quantize (latent_tolerance).
        EXPECT_TRUE(rel_close("sequence " + std::to_string(s), out[s].data(), ref.out.data(),
                              out[s].size(), latent_tolerance(dtype)));
        if (!kernels::linear_rows_independent(Backend::kAuto)) continue;
        auto own = fx.layer.new_paged_cache(30, 3, 1, dtype).value();
        std::vector<std::vector<int64_t>> own_steps;
        for (const auto& step : steps)
          if (step[s] > 0) own_steps.push_back({step[s]});
        attnkit_test::run_batch_steps(own, d, {x[s]}, own_steps, &alone, forward(own));
        EXPECT_EQ(0, std::memcmp(out[s].data(), alone[0].data(), out[s].size() * sizeof(float)))
            << "sequence " << s << " batched vs alone";
      }
    }
}

// bf16 projection weights are kept as bf16 (no f32 copy) and both forms,
// both backends and forward_batch track the float64 model run with the
// same bf16 values. Each projection rounds its input to bf16 (2^-9
// relative, kernels/linear.h); a token's path crosses at most five of them
// (q_a, q_b, kv_a, kv_b's W_UK or W_UV, o), so its output moves by a few
// times 5 x 2^-9 ~ 1e-2 of the output scale at most: 2e-2. A wrong weight,
// split or dtype is off by O(0.1) or more.
TEST(LatentAttention, Bf16WeightsAreKeptAndTrackReference) {
  for (bool q_lora : {true, false}) {
    SCOPED_TRACE(q_lora ? "q_lora" : "q_proj");
    MlaConfig cfg = small_config(q_lora, true);
    RefWeights w = random_weights(cfg, 60 + q_lora);
    WeightMap m = weight_map(cfg, w);
    std::vector<std::vector<bf16>> store;
    for (auto& [name, view] : m) {
      if (view.rank != 2) continue;  // the norms stay f32
      std::vector<float>* values = name == "q_a_proj.weight"             ? &w.q_a
                                   : name == "q_b_proj.weight"           ? &w.q_b
                                   : name == "q_proj.weight"             ? &w.q
                                   : name == "kv_a_proj_with_mqa.weight" ? &w.kv_a
                                   : name == "kv_b_proj.weight"          ? &w.kv_b
                                                                         : &w.o;
      store.emplace_back();
      for (float& v : *values) {
        store.back().push_back(float_to_bf16(v));
        v = bf16_to_float(store.back().back());  // the reference uses the kept values
      }
      view.data = store.back().data();
      view.dtype = DType::kBF16;
    }
    auto layer = LatentAttention::create(cfg).value();
    ASSERT_TRUE(layer.load_weights(m).ok());
    EXPECT_EQ(layer.weight("kv_b_proj.weight")->dtype, DType::kBF16);
    EXPECT_EQ(layer.weight("o_proj.weight")->dtype, DType::kBF16);
    EXPECT_EQ(layer.weight("kv_a_layernorm.weight")->dtype, DType::kF32);

    const int64_t B = 2, S = 8, d = cfg.hidden_size;
    Rng rng(61);
    const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * S * d), rng);
    const RefOut ref = reference(cfg, w, x, B, S, iota(S));
    for (Backend backend : {Backend::kReference, Backend::kAuto})
      for (MlaForm form : {MlaForm::kNaive, MlaForm::kAbsorbed}) {
        std::vector<float> out(x.size(), 0.0f);
        RunOptions run;
        run.backend = backend;
        auto cache = layer.new_cache(B, S).value();
        ASSERT_TRUE(layer
                        .forward(make_view(x.data(), DType::kF32, {B, S, d}),
                                 make_view(out.data(), DType::kF32, {B, S, d}), {}, &cache, run,
                                 form)
                        .ok());
        EXPECT_TRUE(rel_close(std::string("bf16 weights, ") + mla_form_name(form) +
                                  (backend == Backend::kReference ? ", reference" : ", auto"),
                              out.data(), ref.out.data(), out.size(), 2e-2));
      }
    auto pool = layer.new_paged_cache(10, 4).value();
    std::vector<std::vector<float>> xs = {std::vector<float>(x.begin(), x.begin() + S * d)}, outs;
    attnkit_test::run_batch_steps(
        pool, d, xs, {{3}, {1}, {4}}, &outs,
        [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
            const TensorView& ov) { return layer.forward_batch(xv, cu, ids, pool, 0, ov); });
    EXPECT_TRUE(rel_close("bf16 weights, forward_batch", outs[0].data(), ref.out.data(),
                          outs[0].size(), 2e-2));
  }
}

// A cache rebuilt from saved rows continues exactly like the original.
TEST(LatentAttention, AppendedRowsRestoreACache) {
  Fixture fx = make(true, true, 61);
  const int64_t B = 2, d = fx.cfg.hidden_size, dkv = 36;
  Rng rng(12);
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * 6 * d), rng);
  auto a = fx.layer.new_cache(B, 8);
  auto b = fx.layer.new_cache(B, 8);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<float> out(x.size());
  ASSERT_TRUE(fx.layer
                  .forward(make_view(x.data(), DType::kF32, {B, 5, d}),
                           make_view(out.data(), DType::kF32, {B, 5, d}), {}, &a.value())
                  .ok());
  // Rows [0, 5) of each batch entry, a strided view into a's storage copy.
  const std::vector<float> saved(a->storage().ptr<float>(),
                                 a->storage().ptr<float>() + B * 8 * dkv);
  TensorView rows = make_view(saved.data(), DType::kF32, {B, 5, dkv});
  rows.strides = {8 * dkv, dkv, 1};
  ASSERT_TRUE(b->append(rows).ok());
  EXPECT_EQ(b->length(), 5);
  // One more token per sequence (any input; the same for both caches).
  const std::vector<float> xa(x.begin(), x.begin() + B * d);
  std::vector<float> next_a(static_cast<size_t>(B * d)), next_b(static_cast<size_t>(B * d));
  ASSERT_TRUE(fx.layer
                  .forward(make_view(xa.data(), DType::kF32, {B, 1, d}),
                           make_view(next_a.data(), DType::kF32, {B, 1, d}), {}, &a.value())
                  .ok());
  ASSERT_TRUE(fx.layer
                  .forward(make_view(xa.data(), DType::kF32, {B, 1, d}),
                           make_view(next_b.data(), DType::kF32, {B, 1, d}), {}, &b.value())
                  .ok());
  EXPECT_EQ(next_a, next_b);
  // Overflow and a wrong row width change nothing.
  const Status over = b->append(rows);
  EXPECT_EQ(over.code(), StatusCode::kOutOfRange) << over.to_string();
  TensorView narrow = make_view(saved.data(), DType::kF32, {B, 1, dkv - 1});
  const Status width = b->append(narrow);
  EXPECT_NE(width.message().find("values_per_token"), std::string::npos) << width.to_string();
  EXPECT_EQ(b->length(), 6);
}

const MlaForm kForms[2] = {MlaForm::kNaive, MlaForm::kAbsorbed};

// outs[form][backend]: x (B x S x hidden) through the layer in both forms
// (naive, absorbed) on both backends (reference, auto), each from a fresh
// cache of `dtype` with S + 2 positions, which inspect(form, backend,
// cache) checks after the call.
template <class Inspect>
void forward_forms(Fixture& fx, const std::vector<float>& x, int64_t B, int64_t S, DType dtype,
                   std::vector<float> (&outs)[2][2], Inspect inspect) {
  const int64_t d = fx.cfg.hidden_size;
  const Backend backends[2] = {Backend::kReference, Backend::kAuto};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      auto cache = fx.layer.new_cache(B, S + 2, dtype);
      ASSERT_TRUE(cache.ok()) << cache.status().to_string();
      outs[i][j].assign(x.size(), 0.0f);
      RunOptions run;
      run.backend = backends[j];
      ASSERT_TRUE(fx.layer
                      .forward(make_view(x.data(), DType::kF32, {B, S, d}),
                               make_view(outs[i][j].data(), DType::kF32, {B, S, d}), {},
                               &cache.value(), run, kForms[i])
                      .ok());
      inspect(i, j, cache.value());
    }
}

// 8-bit latent caches: what the rows hold (each block of 64 channels as
// tests/common/kv_quant_f64.h quantizes it), both forms on both backends
// reading the same dequantized latents, and the output's distance from
// exact latents.
TEST(LatentAttention, EightBitCachesHoldQuantizedRowsAndFormsAgree) {
  for (DType dtype : {DType::kI8, DType::kFp8E4M3}) {
    SCOPED_TRACE(dtype_name(dtype));
    // kv_lora_rank 32 + rope 4: one partial block of 64 channels per row;
    // the DeepSeek-shaped fixture below gives whole and partial blocks.
    for (bool wide : {false, true}) {
      Fixture fx = wide ? make_wide_latent(71) : make(true, true, 71);
      const int64_t B = 2, S = 7, d = fx.cfg.hidden_size;
      const int64_t dkv = fx.cfg.kv_lora_rank + fx.cfg.qk_rope_head_dim;
      Rng rng(8);
      const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * S * d), rng);
      const RefOut ref = reference(fx.cfg, fx.w, x, B, S, iota(S));
      const int64_t blocks = (dkv + 63) / 64;
      std::vector<float> outs[2][2];
      forward_forms(fx, x, B, S, dtype, outs, [&](int i, int j, const LatentCache& cache) {
        EXPECT_EQ(cache.scales().shape[2], blocks);
        EXPECT_EQ(cache.nbytes(), size_t(B * (S + 2) * (dkv + 4 * blocks)));
        if (i + j > 0) return;
        // The rows: the reference model's latents, quantized by the rule
        // (the fp32 projections differ from the float64 ones in the last
        // bits, which can move a code by one step: compare within one).
        const TensorView &st = cache.storage(), &sc = cache.scales();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < S; ++t) {
            std::vector<float> row(static_cast<size_t>(dkv));
            for (int64_t c = 0; c < dkv; ++c)
              row[size_t(c)] = float(ref.latent[(b * S + t) * dkv + c]);
            const std::vector<double> want =
                attnkit_test::kv_dequantized(row.data(), dkv, dtype, 64);
            for (int64_t c = 0; c < dkv; ++c) {
              const float scale =
                  sc.ptr<const float>()[b * sc.strides[0] + t * sc.strides[1] + c / 64];
              const uint8_t code =
                  st.ptr<const uint8_t>()[b * st.strides[0] + t * st.strides[1] + c];
              const double got = double(attnkit::kv_code_value(dtype, code)) * scale;
              // One step: scale (int8), or 2^-3 of the value's binade (fp8).
              const double step = dtype == DType::kI8
                                      ? 1.01 * scale
                                      : std::fabs(want[size_t(c)]) / 7 + 0x1p-9 * scale;
              EXPECT_LE(std::fabs(got - want[size_t(c)]), step) << b << " " << t << " " << c;
            }
          }
      });
      // The reference kernel reads the dequantized latents exactly: both
      // forms agree to fp32 rounding.
      const std::vector<double> naive(outs[0][0].begin(), outs[0][0].end());
      EXPECT_TRUE(rel_close("absorbed vs naive (reference)", outs[1][0].data(), naive.data(),
                            naive.size()));
      // The fast absorbed form may copy tiles as bf16 for vdpbf16ps
      // (kernels/cpu/tile_policy.h; 2^-9 relative per value, weight and
      // query).
      for (int i = 0; i < 2; ++i)

        EXPECT_TRUE(rel_close(std::string("fast kernel, ") + mla_form_name(kForms[i]),
                              outs[i][1].data(), naive.data(), naive.size(), 0x1p-6));
      EXPECT_TRUE(rel_close("vs float64", outs[0][0].data(), ref.out.data(), naive.size(),
                            latent_tolerance(dtype)));
      EXPECT_FALSE(
          rel_close("differs from exact", outs[0][0].data(), ref.out.data(), naive.size(), 1e-4));
    }
  }
}

TEST(LatentAttention, Bf16CacheFormsAgreeAndTrackReference) {
  Fixture fx = make(true, true, 31);
  const int64_t B = 2, S = 7, d = fx.cfg.hidden_size;
  Rng rng(8);
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * S * d), rng);
  const RefOut ref = reference(fx.cfg, fx.w, x, B, S, iota(S));
  std::vector<float> outs[2][2];
  forward_forms(fx, x, B, S, DType::kBF16, outs, [&](int, int, const LatentCache& cache) {
    EXPECT_EQ(cache.nbytes(), size_t(B * (S + 2) * 36 * 2));
  });
  // The reference kernel widens bf16 K/V exactly, so both forms read the
  // same rounded latents and agree to fp32 rounding.
  const std::vector<double> naive(outs[0][0].begin(), outs[0][0].end());
  EXPECT_TRUE(rel_close("bf16 cache, absorbed vs naive (reference)", outs[1][0].data(),
                        naive.data(), naive.size()));
  // Fast kernels may also round the scaled queries and the softmax weights
  // to bf16 (2^-9 relative each); through softmax and o_proj that stays
  // within 2^-6 of the output scale.
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(rel_close(std::string("bf16 cache, fast kernel, ") + mla_form_name(kForms[i]),
                          outs[i][1].data(), naive.data(), naive.size(), 0x1p-6));
  // Against exact latents: bf16 keeps 8 significant bits (relative rounding
  // <= 2^-9 ~ 2e-3 per latent value); through two linear maps and a softmax
  // the output error stays within a few times that.
  EXPECT_TRUE(
      rel_close("bf16 cache vs float64", outs[0][0].data(), ref.out.data(), naive.size(), 1e-2));
  // And that bound is not vacuous: bf16 rounding is visible at fp32 scale.
  EXPECT_FALSE(
      rel_close("bf16 differs from exact", outs[0][0].data(), ref.out.data(), naive.size(), 1e-5));
}

// ---- configuration -----------------------------------------------------

const char* kV3Json = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
  "rms_norm_eps": 1e-06, "max_position_embeddings": 163840, "attention_bias": false,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"}})";

const char* kV2LiteJson = R"({
  "model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
  "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
  "max_position_embeddings": 163840,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                   "type": "yarn"}})";

const char* kKimiJson = R"({
  "model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
  "max_position_embeddings": 131072,
  "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"}})";

TEST(MlaConfig, ParsesReleasedConfigsAndScales) {
  auto v3 = mla_config_from_json(kV3Json);
  ASSERT_TRUE(v3.ok()) << v3.status().to_string();
  EXPECT_EQ(v3->hidden_size, 7168);
  EXPECT_EQ(v3->q_lora_rank, 1536);
  EXPECT_EQ(v3->cache_values_per_token(), 576);
  EXPECT_EQ(v3->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(v3->rope_scaling.original_max_position_embeddings, 4096);
  // mla.md section 2 values.
  EXPECT_NEAR(mla_softmax_scale(*v3), 0.135234, 5e-7);
  auto lite = mla_config_from_json(kV2LiteJson);
  ASSERT_TRUE(lite.ok()) << lite.status().to_string();
  EXPECT_EQ(lite->q_lora_rank, 0);
  EXPECT_EQ(lite->rms_norm_eps, 1e-6);
  EXPECT_NEAR(mla_softmax_scale(*lite), 0.114721, 5e-7);
  auto kimi = mla_config_from_json(kKimiJson);
  ASSERT_TRUE(kimi.ok()) << kimi.status().to_string();
  EXPECT_EQ(kimi->rope_theta, 50000.0);
  EXPECT_NEAR(mla_softmax_scale(*kimi), 0.130861, 5e-7);
  // The layer's RoPE carries no amplitude (mscale == mscale_all_dim) and the
  // YaRN frequencies of mla.md: factor 40 keeps pair 0, divides the last.
  auto layer = LatentAttention::create(*v3);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  EXPECT_EQ(layer->rope().attention_factor(), 1.0);
  const auto f = layer->rope().inv_freq();
  ASSERT_EQ(f.size(), 32u);
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_NEAR(f[31], std::pow(10000.0, -62.0 / 64.0) / 40.0, 1e-15);
  // Without YaRN: plain 1/sqrt(192).
  MlaConfig plain = *v3;
  plain.rope_scaling = {};
  EXPECT_DOUBLE_EQ(mla_softmax_scale(plain), 1.0 / std::sqrt(192.0));
  // rope_interleave: absent or null = true; false is kept.
  EXPECT_TRUE(v3->rope_interleave);
  const std::string v3_text = kV3Json;
  const std::string half = v3_text.substr(0, v3_text.size() - 1) + ", \"rope_interleave\": false}";
  auto v3_half = mla_config_from_json(half);
  ASSERT_TRUE(v3_half.ok()) << v3_half.status().to_string();
  EXPECT_FALSE(v3_half->rope_interleave);
  auto v3_null =
      mla_config_from_json(v3_text.substr(0, v3_text.size() - 1) + ", \"rope_interleave\": null}");
  ASSERT_TRUE(v3_null.ok()) << v3_null.status().to_string();
  EXPECT_TRUE(v3_null->rope_interleave);
}

std::string without(const std::string& json, const std::string& field) {
  // Removes `"field": value,` from the flat JSON texts above.
  const size_t at = json.find("\"" + field + "\"");
  EXPECT_NE(at, std::string::npos) << field;
  const size_t end = json.find(',', at);
  return json.substr(0, at) + json.substr(end + 1);
}

std::string replaced(const std::string& json, const std::string& field, const std::string& value) {
  const size_t at = json.find("\"" + field + "\"");
  EXPECT_NE(at, std::string::npos) << field;
  const size_t colon = json.find(':', at), end = json.find_first_of(",}", colon);
  return json.substr(0, colon + 1) + " " + value + json.substr(end);
}

void expect_error(const Result<MlaConfig>& r, const std::string& needle) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << needle;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(MlaConfig, RejectsBadConfigsNamingTheField) {
  const std::string v3 = kV3Json;
  for (const char* field : {"hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
    expect_error(mla_config_from_json(without(v3, field)), field);
  expect_error(mla_config_from_json(replaced(v3, "qk_rope_head_dim", "63")),
               "qk_rope_head_dim = 63 must be even");
  expect_error(mla_config_from_json(replaced(v3, "kv_lora_rank", "0")), "kv_lora_rank = 0");
  expect_error(mla_config_from_json(replaced(v3, "kv_lora_rank", "null")), "kv_lora_rank");
  expect_error(mla_config_from_json(replaced(v3, "q_lora_rank", "-1")), "q_lora_rank = -1");
  expect_error(mla_config_from_json(replaced(v3, "v_head_dim", "0")), "v_head_dim = 0");
  expect_error(mla_config_from_json(replaced(v3, "hidden_size", "\"7168\"")), "hidden_size");
  expect_error(mla_config_from_json(replaced(v3, "attention_bias", "true")), "attention_bias");
  expect_error(mla_config_from_json(replaced(v3, "type", "\"linear\"")), "rope_scaling.type");
  expect_error(mla_config_from_json(replaced(v3, "factor", "0.5")), "rope_scaling.factor");
  expect_error(mla_config_from_json(replaced(v3, "rope_theta", "1")), "rope_theta");
  expect_error(mla_config_from_json(v3.substr(0, v3.size() - 1) + ", \"rope_interleave\": 0}"),
               "rope_interleave = 0 must be true or false");
  expect_error(mla_config_from_json("{\"model_type\": \"llama\", \"hidden_size\": 4096, "
                                    "\"num_attention_heads\": 32}"),
               "q_lora_rank");
  expect_error(mla_config_from_json("not json"), "JSON");
  MlaConfig c = small_config(true, false);
  c.qk_rope_head_dim = 7;
  auto layer = LatentAttention::create(c);
  ASSERT_FALSE(layer.ok());
  EXPECT_NE(layer.status().message().find("qk_rope_head_dim = 7"), std::string::npos)
      << layer.status().message();
}

// ---- bad input changes nothing -----------------------------------------

TEST(LatentAttention, WeightErrorsNameTheWeightAndKeepTheOldWeights) {
  Fixture fx = make(true, false, 41);
  const int64_t B = 1, T = 4, d = fx.cfg.hidden_size;
  Rng rng(2);
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * d), rng);
  const auto xv = make_view(x.data(), DType::kF32, {B, T, d});
  std::vector<float> before(x.size()), after(x.size());
  ASSERT_TRUE(fx.layer.forward(xv, make_view(before.data(), DType::kF32, {B, T, d})).ok());

  const RefWeights other = random_weights(fx.cfg, 42);
  // kv_b_proj transposed: [kv_lora_rank, H*(d_n+d_v)] instead of [66, 28].
  WeightMap bad = weight_map(fx.cfg, other);
  bad["kv_b_proj.weight"] = make_view(other.kv_b.data(), DType::kF32, {28, 66});
  Status st = fx.layer.load_weights(bad);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("kv_b_proj.weight"), std::string::npos) << st.message();
  // Missing weight.
  bad = weight_map(fx.cfg, other);
  bad.erase("q_a_layernorm.weight");
  st = fx.layer.load_weights(bad);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("q_a_layernorm.weight"), std::string::npos) << st.message();
  // q_proj next to a q_lora config: unexpected.
  bad = weight_map(fx.cfg, other);
  bad["q_proj.weight"] = make_view(other.q_b.data(), DType::kF32, {60, 24});
  st = fx.layer.load_weights(bad);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("q_proj.weight"), std::string::npos) << st.message();
  // o_proj with the wrong input width.
  bad = weight_map(fx.cfg, other);
  bad["o_proj.weight"] = make_view(other.o.data(), DType::kF32, {30, 40});
  st = fx.layer.load_weights(bad);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("o_proj.weight"), std::string::npos) << st.message();

  ASSERT_TRUE(fx.layer.forward(xv, make_view(after.data(), DType::kF32, {B, T, d})).ok());
  EXPECT_EQ(before, after);
  // Prefixed names load too (HF checkpoint layout).
  const WeightMap prefixed = weight_map(fx.cfg, other, "model.layers.3.self_attn.");
  EXPECT_TRUE(fx.layer.load_weights(prefixed, "model.layers.3.self_attn").ok());
  ASSERT_TRUE(fx.layer.forward(xv, make_view(after.data(), DType::kF32, {B, T, d})).ok());
  EXPECT_NE(before, after);
}

TEST(LatentAttention, BadCallsWriteNothing) {
  Fixture fx = make(false, true, 51);
  const int64_t d = fx.cfg.hidden_size;
  Rng rng(4);
  const std::vector<float> x = attnkit_test::uniform_vector(size_t(2 * 5 * d), rng);
  auto cache = fx.layer.new_cache(2, 6);
  ASSERT_TRUE(cache.ok());
  std::vector<float> out(x.size(), 0.0f);
  ASSERT_TRUE(fx.layer
                  .forward(make_view(x.data(), DType::kF32, {2, 4, d}),
                           make_view(out.data(), DType::kF32, {2, 4, d}), {}, &cache.value())
                  .ok());
  ASSERT_EQ(cache->length(), 4);
  const std::vector<float> snapshot(cache->storage().ptr<float>(),
                                    cache->storage().ptr<float>() + 2 * 6 * 36);
  std::vector<float> sentinel(x.size(), 7.0f);
  const auto expect_untouched = [&](const Status& s, StatusCode code, const std::string& needle) {
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_EQ(cache->length(), 4);
    EXPECT_TRUE(std::equal(snapshot.begin(), snapshot.end(), cache->storage().ptr<float>()));
    EXPECT_TRUE(std::all_of(sentinel.begin(), sentinel.end(), [](float e) { return e == 7.0f; }));
  };
  // Overflow: 4 cached + 3 new > 6.
  expect_untouched(
      fx.layer.forward(make_view(x.data(), DType::kF32, {2, 3, d}),
                       make_view(sentinel.data(), DType::kF32, {2, 3, d}), {}, &cache.value()),
      StatusCode::kOutOfRange, "max_seq_len = 6");
  // Batch mismatch with the cache.
  expect_untouched(
      fx.layer.forward(make_view(x.data(), DType::kF32, {1, 2, d}),
                       make_view(sentinel.data(), DType::kF32, {1, 2, d}), {}, &cache.value()),
      StatusCode::kInvalidArgument, "batch_size");
  // Wrong hidden size.
  expect_untouched(
      fx.layer.forward(make_view(x.data(), DType::kF32, {2, 1, d - 1}),
                       make_view(sentinel.data(), DType::kF32, {2, 1, d - 1}), {}, &cache.value()),
      StatusCode::kInvalidArgument, "hidden_size");
  // Negative position, wrong positions count.
  const std::vector<int64_t> neg = {-1};
  expect_untouched(
      fx.layer.forward(make_view(x.data(), DType::kF32, {2, 1, d}),
                       make_view(sentinel.data(), DType::kF32, {2, 1, d}), neg, &cache.value()),
      StatusCode::kInvalidArgument, "positions[0] = -1");
  const std::vector<int64_t> three = {4, 5, 6};
  expect_untouched(
      fx.layer.forward(make_view(x.data(), DType::kF32, {2, 2, d}),
                       make_view(sentinel.data(), DType::kF32, {2, 2, d}), three, &cache.value()),
      StatusCode::kInvalidArgument, "positions has 3 entries");
  // A cache of another layer shape.
  MlaConfig other = fx.cfg;
  other.kv_lora_rank = 16;
  auto other_layer = LatentAttention::create(other);
  ASSERT_TRUE(other_layer.ok());
  auto foreign = other_layer->new_cache(2, 6);
  ASSERT_TRUE(foreign.ok());
  Status st =
      fx.layer.forward(make_view(x.data(), DType::kF32, {2, 1, d}),
                       make_view(sentinel.data(), DType::kF32, {2, 1, d}), {}, &foreign.value());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("kv_lora_rank"), std::string::npos) << st.message();
  EXPECT_EQ(foreign->length(), 0);
  // out aliasing x.
  std::vector<float> xs = x;
  st = fx.layer.forward(make_view(xs.data(), DType::kF32, {2, 1, d}),
                        make_view(xs.data(), DType::kF32, {2, 1, d}));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(xs, x);
  // Forward before weights; bad cache requests.
  auto fresh = LatentAttention::create(fx.cfg);
  ASSERT_TRUE(fresh.ok());
  st = fresh->forward(make_view(x.data(), DType::kF32, {2, 1, d}),
                      make_view(sentinel.data(), DType::kF32, {2, 1, d}));
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("load_weights"), std::string::npos) << st.message();
  EXPECT_FALSE(fx.layer.new_cache(0, 4).ok());
  EXPECT_FALSE(fx.layer.new_cache(1, 0).ok());
  const auto f16 = fx.layer.new_cache(1, 4, DType::kF16);
  EXPECT_NE(f16.status().message().find("dtype = f16 must be f32, bf16, int8 or fp8_e4m3"),
            std::string::npos)
      << f16.status().to_string();
  // The good call after all of that still continues the sequence.
  ASSERT_TRUE(fx.layer
                  .forward(make_view(x.data(), DType::kF32, {2, 2, d}),
                           make_view(out.data(), DType::kF32, {2, 2, d}), {}, &cache.value())
                  .ok());
  EXPECT_EQ(cache->length(), 6);
}

TEST(LatentAttention, AutoPicksNaiveForPrefillAndAbsorbedForDecode) {
  auto cfg = mla_config_from_json(kV3Json);
  ASSERT_TRUE(cfg.ok());
  auto layer = LatentAttention::create(*cfg);
  ASSERT_TRUE(layer.ok());
  EXPECT_EQ(layer->choose_form(2048, 0), MlaForm::kNaive);
  EXPECT_EQ(layer->choose_form(16, 0), MlaForm::kNaive);
  EXPECT_EQ(layer->choose_form(1, 512), MlaForm::kAbsorbed);
  EXPECT_EQ(layer->choose_form(1, 100000), MlaForm::kAbsorbed);
  EXPECT_EQ(layer->choose_form(4, 4096), MlaForm::kAbsorbed);
  // Chunked prefill: short chunks over a long cache stay absorbed (measured
  // 2.9x faster at 64 over 4096), long chunks go naive.
  EXPECT_EQ(layer->choose_form(64, 4096), MlaForm::kAbsorbed);
  EXPECT_EQ(layer->choose_form(2048, 512), MlaForm::kNaive);
  EXPECT_EQ(layer->weight_names().size(), 7u);
  auto lite = LatentAttention::create(*mla_config_from_json(kV2LiteJson));
  ASSERT_TRUE(lite.ok());
  EXPECT_EQ(
      lite->weight_names(),
      (std::vector<std::string>{"q_proj.weight", "kv_a_proj_with_mqa.weight",
                                "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}));
}

}  // namespace
}  // namespace attnkit
