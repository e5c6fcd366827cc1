// AttentionLayer against an independent float64 implementation of the
// layer written here: projections with biases, per-head RMSNorm, half-split
// RoPE (its own cos/sin), the float64 attention oracle, o_proj.
//
// Tolerance: a first-order running error bound, carried per element through
// the reference itself, from f32 unit roundoff u = 2^-24 and the actual
// values (Higham's gamma_n = n u / (1 - n u) for an n-term dot product):
//   projection  e_y = sum_k e_x,k |w_k| + gamma_{n+2} (sum_k |x_k w_k| + |b|)
//   RMSNorm     e_n = |g| (e / r + |y| |dr| / r^2) + u |n|, |dr| <= ||e||_2 / sqrt(dim)
//   RoPE        the errors rotate with the pair (|cos|, |sin|), + u |y'|
//   attention   per key, ds_j from e_q and e_k plus the kernel's own fp32
//               error (tests/ops/kv_cache_test.cc derives it);
//               e_o = sum_j p_j (ds_j |v_j - o| + e_v,j) + the kernel's P.V terms
//   o_proj      as a projection of o with e_o
// and the test allows twice the result for second-order terms. A wrong
// pairing, position, head mapping, bias, norm or mask is off by O(0.1).
// With bf16 projection weights, each projection rounds its input to bf16
// first (kernels/linear.h): the reference then adds u_bf16 = 2^-9 of each
// input's magnitude (and of its carried error) to the input's error.
#include "attnkit/attention_layer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/attention_f64.h"
#include "common/batch_steps.h"
#include "common/random.h"
#include "common/views.h"
#include "kernels/linear.h"

namespace {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::DType;
using attnkit::KVCache;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit_test::Rng;

constexpr double kU = 0x1p-24;
constexpr double kUBf16 = 0x1p-9;  // bf16's unit roundoff
double gamma(int64_t n) { return double(n) * kU / (1.0 - double(n) * kU); }

// ---- configs, as a checkpoint's config.json would give them -------------

AttentionConfig base_config(const char* type, int64_t kv_heads) {
  AttentionConfig c;
  c.model_type = type;
  c.hidden_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = kv_heads;
  c.head_dim = 8;
  c.rope.head_dim = 8;
  c.rope.theta = 10000.0;
  return c;
}
AttentionConfig llama_like() { return base_config("llama", 2); }
AttentionConfig qwen2_like() {
  AttentionConfig c = base_config("qwen2", 2);
  c.qkv_bias = true;
  c.rope.theta = 1e6;
  return c;
}
AttentionConfig qwen3_like() {
  // head_dim * num_heads != hidden_size, as in Qwen3; MQA.
  AttentionConfig c = base_config("qwen3", 1);
  c.head_dim = c.rope.head_dim = 16;
  c.qk_norm = attnkit::QkNorm::kRms;
  c.rms_norm_eps = 1e-6;
  return c;
}
AttentionConfig mistral_like() {
  AttentionConfig c = base_config("mistral", 2);
  c.sliding_window = 4;
  return c;
}
AttentionConfig gemma2_like() {
  // Partial rotary, softcap, explicit scale, o_proj bias, MHA.
  AttentionConfig c = base_config("gemma2", 4);
  c.rope.rotary_dim = 4;
  c.softcap = 2.0f;
  c.softmax_scale = 0.25f;
  c.o_bias = true;
  c.qkv_bias = true;
  return c;
}

struct Named {
  const char* name;
  AttentionConfig config;
};
std::vector<Named> all_configs() {
  return {{"llama", llama_like()},
          {"qwen2", qwen2_like()},
          {"qwen3", qwen3_like()},
          {"mistral", mistral_like()},
          {"gemma2", gemma2_like()}};
}

// ---- weights --------------------------------------------------------------

struct Weights {
  std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo, qn, kn;
};

Weights random_weights(const AttentionConfig& c, Rng& rng) {
  const int64_t d = c.hidden_size, qo = c.num_heads * c.head_dim, kvo = c.num_kv_heads * c.head_dim;
  // nn.Linear's init range, so activations stay O(1).
  auto w = [&](int64_t out, int64_t in) {
    const float a = 1.0f / std::sqrt(float(in));
    return attnkit_test::uniform_vector(size_t(out * in), rng, -a, a);
  };
  Weights r;
  r.wq = w(qo, d);
  r.wk = w(kvo, d);
  r.wv = w(kvo, d);
  r.wo = w(d, qo);
  if (c.qkv_bias) {
    r.bq = attnkit_test::uniform_vector(size_t(qo), rng, -0.5f, 0.5f);
    r.bk = attnkit_test::uniform_vector(size_t(kvo), rng, -0.5f, 0.5f);
    r.bv = attnkit_test::uniform_vector(size_t(kvo), rng, -0.5f, 0.5f);
  }
  if (c.o_bias) r.bo = attnkit_test::uniform_vector(size_t(d), rng, -0.5f, 0.5f);
  if (c.qk_norm != attnkit::QkNorm::kNone) {
    r.qn = attnkit_test::uniform_vector(size_t(c.head_dim), rng, 0.5f, 1.5f);
    r.kn = attnkit_test::uniform_vector(size_t(c.head_dim), rng, 0.5f, 1.5f);
  }
  return r;
}

attnkit::WeightMap weight_map(Weights& w, const AttentionConfig& c, const std::string& prefix) {
  const int64_t d = c.hidden_size, qo = c.num_heads * c.head_dim, kvo = c.num_kv_heads * c.head_dim;
  attnkit::WeightMap m;
  auto put = [&](const char* n, std::vector<float>& v, std::initializer_list<int64_t> shape) {
    if (!v.empty()) m[prefix + n] = attnkit::make_view(v.data(), DType::kF32, shape);
  };
  put("q_proj.weight", w.wq, {qo, d});
  put("k_proj.weight", w.wk, {kvo, d});
  put("v_proj.weight", w.wv, {kvo, d});
  put("o_proj.weight", w.wo, {d, qo});
  put("q_proj.bias", w.bq, {qo});
  put("k_proj.bias", w.bk, {kvo});
  put("v_proj.bias", w.bv, {kvo});
  put("o_proj.bias", w.bo, {d});
  put("q_norm.weight", w.qn, {c.head_dim});
  put("k_norm.weight", w.kn, {c.head_dim});
  return m;
}

// ---- the float64 reference layer -----------------------------------------

// Values of one stage in float64 and, per element, a bound on how far the
// layer's f32 computation of that element may be from it (first order).
struct Stage {
  std::vector<double> y;
  std::vector<double> err;
};

// y = x w^T + b. x [rows, in] with per-element error x.err; w [n, in].
Stage linear_ref(const Stage& x, int64_t rows, int64_t in, const std::vector<float>& w,
                 const std::vector<float>& b, int64_t n) {
  Stage s{std::vector<double>(size_t(rows * n)), std::vector<double>(size_t(rows * n))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double acc = b.empty() ? 0.0 : b[size_t(j)], mag = std::fabs(acc), carried = 0.0;
      for (int64_t k = 0; k < in; ++k) {
        const double xv = x.y[size_t(r * in + k)], wv = w[size_t(j * in + k)];
        acc += xv * wv;
        mag += std::fabs(xv * wv);
        carried += x.err[size_t(r * in + k)] * std::fabs(wv);
      }
      s.y[size_t(r * n + j)] = acc;
      s.err[size_t(r * n + j)] = carried + gamma(in + 2) * mag;
    }
  return s;
}

Stage exact(const std::vector<float>& x) {
  return {attnkit_test::widen(x), std::vector<double>(x.size(), 0.0)};
}

// The input of a projection with bf16 weights: rounded to bf16, which
// moves it by at most u_bf16 times its computed magnitude.
Stage rounded_to_bf16(Stage s) {
  for (size_t i = 0; i < s.y.size(); ++i) s.err[i] += kUBf16 * (std::fabs(s.y[i]) + s.err[i]);
  return s;
}

// Per-head RMSNorm in place, rows of `dim`: n_i = y_i / r * g_i with
// r = sqrt(mean(y^2) + eps); |dr| <= ||dy||_2 / sqrt(dim), so
// |dn_i| <= |g_i| (e_i / r + |y_i| |dr| / r^2), plus one f32 rounding.
void rms_norm_ref(Stage& s, int64_t dim, const std::vector<float>& g, double eps) {
  const int64_t n = int64_t(s.y.size()) / dim;
  for (int64_t r = 0; r < n; ++r) {
    double* y = &s.y[size_t(r * dim)];
    double* e = &s.err[size_t(r * dim)];
    double ss = 0.0, ee = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      ss += y[d] * y[d];
      ee += e[d] * e[d];
    }
    const double rms = std::sqrt(ss / double(dim) + eps), dr = std::sqrt(ee / double(dim));
    for (int64_t d = 0; d < dim; ++d) {
      const double gd = g[size_t(d)];
      e[d] = std::fabs(gd) * (e[d] / rms + std::fabs(y[d]) * dr / (rms * rms));
      y[d] = y[d] / rms * gd;
      e[d] += kU * std::fabs(y[d]);
    }
  }
}

// Half-split RoPE in place on [batch, seq, heads, dim] at position
// pos[b * seq + t]: pairs (i, i + rot/2) for i < rot/2, angle
// pos * theta^(-2i / rot). Errors rotate with the values; one f32 rounding.
void rope_ref(Stage& s, int64_t batch, int64_t seq, int64_t heads, int64_t dim, int64_t rot,
              double theta, const std::vector<int64_t>& pos) {
  const int64_t half = rot / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const size_t row = size_t(((b * seq + t) * heads + h) * dim);
        double* y = &s.y[row];
        double* e = &s.err[row];
        for (int64_t i = 0; i < half; ++i) {
          const double angle =
              double(pos[size_t(b * seq + t)]) * std::pow(theta, -2.0 * double(i) / double(rot));
          const double c = std::cos(angle), sn = std::sin(angle);
          const double x1 = y[i], x2 = y[i + half], e1 = e[i], e2 = e[i + half];
          y[i] = x1 * c - x2 * sn;
          y[i + half] = x2 * c + x1 * sn;
          e[i] = e1 * std::fabs(c) + e2 * std::fabs(sn) + kU * std::fabs(y[i]);
          e[i + half] = e2 * std::fabs(c) + e1 * std::fabs(sn) + kU * std::fabs(y[i + half]);
        }
      }
}

struct Reference {
  std::vector<double> out;          // [batch, seq_q, hidden]
  std::vector<double> out_bound;    // per element, 2 x first order
  std::vector<double> probs;        // [batch, heads, seq_q, seq_k]
  std::vector<double> probs_bound;  // per element, 2 x first order
};

// The layer on separate inputs: xq [B, Sq, hidden], xk/xv [B, Sk, hidden];
// positions [B * Sq] and [B * Sk]. `attn` carries the masks and options;
// sizes, and scale and softcap unless set, are filled here from the config.
Reference reference_layer(const AttentionConfig& c, const Weights& w, const std::vector<float>& xq,
                          const std::vector<float>& xk, const std::vector<float>& xv, int64_t B,
                          int64_t Sq, int64_t Sk, const std::vector<int64_t>& pos_q,
                          const std::vector<int64_t>& pos_k, attnkit_test::OracleOptions attn,
                          bool bf16_weights = false) {
  const int64_t d = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const auto input = [&](Stage s) { return bf16_weights ? rounded_to_bf16(std::move(s)) : s; };
  Stage q = linear_ref(input(exact(xq)), B * Sq, d, w.wq, w.bq, H * D);
  Stage k = linear_ref(input(exact(xk)), B * Sk, d, w.wk, w.bk, Hkv * D);
  Stage v = linear_ref(input(exact(xv)), B * Sk, d, w.wv, w.bv, Hkv * D);
  if (c.qk_norm != attnkit::QkNorm::kNone) {
    rms_norm_ref(q, D, w.qn, c.rms_norm_eps);
    rms_norm_ref(k, D, w.kn, c.rms_norm_eps);
  }
  if (c.use_rope) {
    const int64_t rot = c.rope.rotary_dim ? c.rope.rotary_dim : D;
    rope_ref(q, B, Sq, H, D, rot, c.rope.theta, pos_q);
    rope_ref(k, B, Sk, Hkv, D, rot, c.rope.theta, pos_k);
  }
  attn.batch = B;
  attn.seqlen_q = Sq;
  attn.seqlen_k = Sk;
  attn.num_heads = H;
  attn.num_kv_heads = Hkv;
  attn.head_dim = attn.head_dim_v = D;
  if (attn.softmax_scale == 0.0) attn.softmax_scale = c.softmax_scale;
  if (attn.softcap == 0.0) attn.softcap = c.softcap;
  const auto r = attnkit_test::attention_f64(attn, q.y, k.y, v.y);
  const double scale = attn.softmax_scale > 0.0 ? attn.softmax_scale : 1.0 / std::sqrt(double(D));

  // Attention, per (b, h, i). The score error of key j is what q and k
  // carry in, plus the kernel's own (fp32 allowed, as in
  // tests/ops/kv_cache_test.cc: f32 dot, scale, softcap, exp argument,
  // exp):
  //   ds_j <= scale sum_d (eq_d |k_jd| + |q_d| ek_jd + eq_d ek_jd)
  //           + (gamma_D + 8u) scale sum_d |q_d k_jd| + 4u
  //   do_d <= sum_j p_j (ds_j |v_jd - o_d| + ev_jd)       (dp_j = p_j (ds_j - sum p ds))
  //           + Vmax (max_j ds_j + 3 gamma_2N + u (3 + |lse|))
  //           (P.V and its sum in f32, the output, and the cache's merge
  //           of two f32 partial results by their f32 LSEs)
  //   dp_j <= p_j (ds_j + sum_k p_k ds_k) + (gamma_2N + 2u) p_j.
  Stage o{r.out, std::vector<double>(r.out.size(), 0.0)};
  std::vector<double> probs_bound(r.probs.size(), 0.0), ds(static_cast<size_t>(Sk));
  const double vmax = [&] {
    double m = 0.0;
    for (double e : v.y) m = std::max(m, std::fabs(e));
    return m;
  }();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      for (int64_t i = 0; i < Sq; ++i) {
        const size_t qrow = size_t(((b * Sq + i) * H + h) * D);
        const size_t prow = size_t(((b * H + h) * Sq + i) * Sk);
        double mean_ds = 0.0, max_ds = 0.0;
        for (int64_t j = 0; j < Sk; ++j) {
          const size_t krow = size_t(((b * Sk + j) * Hkv + g) * D);
          double e = 0.0, mag = 0.0;
          for (int64_t dd = 0; dd < D; ++dd) {
            const double eq = q.err[qrow + dd], ek = k.err[krow + dd];
            e += eq * std::fabs(k.y[krow + dd]) + std::fabs(q.y[qrow + dd]) * ek + eq * ek;
            mag += std::fabs(q.y[qrow + dd] * k.y[krow + dd]);
          }
          ds[size_t(j)] = scale * e + (gamma(D) + 8.0 * kU) * scale * mag + 4.0 * kU;
          mean_ds += r.probs[prow + j] * ds[size_t(j)];
          max_ds = std::max(max_ds, ds[size_t(j)]);
        }
        const double lse = r.lse[size_t((b * H + h) * Sq + i)];
        const double lse_term = std::isfinite(lse) ? std::fabs(lse) : 0.0;
        for (int64_t dd = 0; dd < D; ++dd) {
          const double od = o.y[qrow + dd];
          double e = vmax * (max_ds + 3.0 * gamma(2 * Sk) + kU * (3.0 + lse_term));
          for (int64_t j = 0; j < Sk; ++j) {
            const size_t vi = size_t(((b * Sk + j) * Hkv + g) * D + dd);
            const double p = r.probs[prow + j];
            e += p * (ds[size_t(j)] * std::fabs(v.y[vi] - od) + v.err[vi]);
          }
          o.err[qrow + dd] = e;
        }
        for (int64_t j = 0; j < Sk; ++j) {
          const double p = r.probs[prow + j];
          probs_bound[prow + j] =
              2.0 * (p * (ds[size_t(j)] + mean_ds) + (gamma(2 * Sk) + 2.0 * kU) * p);
        }
      }
    }
  Stage y = linear_ref(input(std::move(o)), B * Sq, H * D, w.wo, w.bo, d);
  for (double& e : y.err) e *= 2.0;
  return {y.y, y.err, r.probs, probs_bound};
}

// |actual - expected| <= bound elementwise; names the worst element
// (largest error / bound) and reports the ratio.
::testing::AssertionResult within(const char* what, const std::vector<float>& actual,
                                  const std::vector<double>& expected,
                                  const std::vector<double>& bound, double* worst_ratio = nullptr) {
  if (actual.size() != expected.size() || bound.size() != expected.size())
    return ::testing::AssertionFailure() << what << ": sizes differ";
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(double(actual[i]) - expected[i]);
    const double ratio =
        bound[i] > 0.0 ? err / bound[i] : (err > 0.0 || std::isnan(err) ? HUGE_VAL : 0.0);
    if (!(ratio <= worst)) {
      worst = ratio;
      at = i;
    }
  }
  if (worst_ratio) *worst_ratio = worst;
  auto msg = [&](::testing::AssertionResult r) {
    return r << what << " worst element [" << at << "]: actual " << actual[at] << ", expected "
             << expected[at] << ", |diff| " << std::fabs(double(actual[at]) - expected[at])
             << ", bound " << bound[at];
  };
  return worst <= 1.0 ? msg(::testing::AssertionSuccess()) : msg(::testing::AssertionFailure());
}

// forward(): self-attention with the config's mask.
Reference reference_forward(const AttentionConfig& c, const Weights& w, const std::vector<float>& x,
                            int64_t B, int64_t T, const std::vector<int64_t>& pos,
                            bool bf16_weights = false) {
  attnkit_test::OracleOptions o;
  o.causal = c.causal;
  o.window_left = c.sliding_window > 0 ? c.sliding_window - 1 : -1;
  return reference_layer(c, w, x, x, x, B, T, T, pos, pos, o, bf16_weights);
}

std::vector<int64_t> iota_positions(int64_t B, int64_t T, int64_t start = 0) {
  std::vector<int64_t> p(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) p[size_t(b * T + t)] = start + t;
  return p;
}

struct Built {
  AttentionLayer layer;
  Weights w;
};

Built build(const AttentionConfig& c, uint64_t seed) {
  auto layer = AttentionLayer::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  Rng rng(seed);
  Weights w = random_weights(c, rng);
  const auto st = layer->load_weights(weight_map(w, c, ""));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return {std::move(layer).value(), std::move(w)};
}

TensorView view3(std::vector<float>& v, int64_t a, int64_t b, int64_t c) {
  return attnkit::make_view(v.data(), DType::kF32, {a, b, c});
}

// ---- forward without a cache ---------------------------------------------

TEST(AttentionLayerForward, MatchesDoubleReference) {
  const int64_t B = 2, T = 9;
  uint64_t seed = 100;
  for (const auto& [name, c] : all_configs()) {
    SCOPED_TRACE(name);
    auto [layer, w] = build(c, seed++);
    Rng rng(seed++);
    std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * c.hidden_size), rng);
    std::vector<float> out(x.size());
    // Default positions (0..T-1), [T] shared from 5 on, and [B*T] per item.
    std::vector<int64_t> shared(static_cast<size_t>(T)), per_item(static_cast<size_t>(B * T));
    for (int64_t t = 0; t < T; ++t) shared[size_t(t)] = 5 + t;
    for (int64_t i = 0; i < B * T; ++i) per_item[size_t(i)] = (i * 7) % 23 + 100 * (i / T);
    std::vector<int64_t> shared_full;
    for (int64_t b = 0; b < B; ++b)
      shared_full.insert(shared_full.end(), shared.begin(), shared.end());
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> runs = {
        {{}, iota_positions(B, T)}, {shared, shared_full}, {per_item, per_item}};
    for (const auto& [given, full] : runs) {
      SCOPED_TRACE("positions given: " + std::to_string(given.size()));
      std::fill(out.begin(), out.end(), -9.0f);
      const auto st =
          layer.forward(view3(x, B, T, c.hidden_size), view3(out, B, T, c.hidden_size), given);
      ASSERT_TRUE(st.ok()) << st.to_string();
      const Reference ref = reference_forward(c, w, x, B, T, full);
      double ratio = 0.0;
      EXPECT_TRUE(within("out", out, ref.out, ref.out_bound, &ratio));
      ::testing::Test::RecordProperty(std::string(name) + "_error_over_bound",
                                      std::to_string(ratio));
    }
  }
}

TEST(AttentionLayerForward, StridedActivationsAndNonCausal) {
  // x and out as [B, T, hidden] views into wider buffers (batch and row
  // strides not contiguous), on a non-causal config without RoPE.
  AttentionConfig c = qwen2_like();
  c.causal = false;
  c.use_rope = false;
  auto [layer, w] = build(c, 7);
  const int64_t B = 2, T = 5, d = c.hidden_size, pad = 3;
  Rng rng(8);
  std::vector<float> xbuf = attnkit_test::uniform_vector(size_t(B * T * (d + pad) + 11), rng);
  std::vector<float> obuf(size_t(B * (T + 1) * d), -5.0f);
  TensorView xv = attnkit::make_view(xbuf.data(), DType::kF32, {B, T, d});
  xv.strides = {T * (d + pad), d + pad, 1};
  TensorView ov = attnkit::make_view(obuf.data(), DType::kF32, {B, T, d});
  ov.strides = {(T + 1) * d, d, 1};
  ASSERT_TRUE(layer.forward(xv, ov).ok());
  std::vector<float> x, out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < d; ++i) {
        x.push_back(xbuf[size_t(b * T * (d + pad) + t * (d + pad) + i)]);
        out.push_back(obuf[size_t(b * (T + 1) * d + t * d + i)]);
      }
  const Reference ref = reference_forward(c, w, x, B, T, iota_positions(B, T));
  EXPECT_TRUE(within("out", out, ref.out, ref.out_bound));
  // The padding row of each batch item is untouched.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < d; ++i) EXPECT_EQ(obuf[size_t(b * (T + 1) * d + T * d + i)], -5.0f);
}

// ---- forward with a cache ------------------------------------------------

TEST(AttentionLayerCache, ChunkedDecodeMatchesFullForward) {
  const int64_t B = 2;
  const std::vector<std::vector<int64_t>> schedules = {
      {6, 1, 1, 1, 1}, {2, 3, 1, 4}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};
  uint64_t seed = 200;
  for (const auto& [name, c] : all_configs())
    for (const auto& chunks : schedules) {
      SCOPED_TRACE(std::string(name) + " first chunk " + std::to_string(chunks[0]));
      auto [layer, w] = build(c, seed++);
      int64_t N = 0;
      for (int64_t t : chunks) N += t;
      Rng rng(seed++);
      std::vector<float> x = attnkit_test::uniform_vector(size_t(B * N * c.hidden_size), rng);
      std::vector<float> out(x.size(), -9.0f);
      auto cache = layer.new_cache(B, N + 1);
      ASSERT_TRUE(cache.ok()) << cache.status().to_string();
      int64_t t0 = 0;
      for (int64_t T : chunks) {
        TensorView xv = view3(x, B, T, c.hidden_size), ov = view3(out, B, T, c.hidden_size);
        xv.strides = ov.strides = {N * c.hidden_size, c.hidden_size, 1};
        xv.data = x.data() + t0 * c.hidden_size;
        ov.data = out.data() + t0 * c.hidden_size;
        const auto st = layer.forward(xv, ov, {}, &*cache);
        ASSERT_TRUE(st.ok()) << st.to_string();
        t0 += T;
        ASSERT_EQ(cache->length(), t0);
      }
      const Reference ref = reference_forward(c, w, x, B, N, iota_positions(B, N));
      EXPECT_TRUE(within("out", out, ref.out, ref.out_bound));
    }
}

// ---- forward_batch over a paged pool ---------------------------------------

// Steps of tokens per sequence (three sequences): prompts in chunks, decodes
// and multi-token steps mixed in one call, sequences idle at times.
const std::vector<std::vector<int64_t>> kBatchSteps = {{6, 3, 0}, {1, 2, 4}, {1, 1, 1}, {3, 0, 1},
                                                       {1, 1, 5}, {1, 1, 1}, {2, 1, 1}};

TEST(AttentionLayerPaged, ForwardBatchMatchesEachSequenceAlone) {
  uint64_t seed = 900;
  for (const auto& [name, c] : all_configs())
    for (int64_t page_size : {1, 4}) {
      SCOPED_TRACE(std::string(name) + " page_size " + std::to_string(page_size));
      auto [layer, w] = build(c, seed++);
      Rng rng(seed++);
      std::vector<std::vector<float>> x(3);
      std::vector<int64_t> lengths(3, 0);
      for (const auto& step : kBatchSteps)
        for (size_t s = 0; s < 3; ++s) lengths[s] += step[s];
      for (size_t s = 0; s < 3; ++s)
        x[s] = attnkit_test::uniform_vector(size_t(lengths[s] * c.hidden_size), rng);
      auto pool = layer.new_paged_cache(40, page_size, 2);
      ASSERT_TRUE(pool.ok()) << pool.status().to_string();
      EXPECT_EQ(pool->spec().sliding_window, c.sliding_window);
      std::vector<std::vector<float>> out;
      // Layer index 1 of the pool: the first layer's slots stay unwritten.
      attnkit_test::run_batch_steps(
          *pool, c.hidden_size, x, kBatchSteps, &out,
          [&, &l = layer](const TensorView& xv, std::span<const int32_t> cu,
                          std::span<const int64_t> ids, const TensorView& ov) {
            return l.forward_batch(xv, cu, ids, *pool, 1, ov);
          });
      for (size_t s = 0; s < 3; ++s) {
        const Reference ref =
            reference_forward(c, w, x[s], 1, lengths[s], iota_positions(1, lengths[s]));
        EXPECT_TRUE(within("out", out[s], ref.out, ref.out_bound)) << "sequence " << s;
      }
    }
}

// Where a projection's row does not depend on the rows beside it, a
// sequence's outputs are the same bits batched or alone.
TEST(AttentionLayerPaged, BatchingChangesNoBits) {
  if (!attnkit::kernels::linear_rows_independent(attnkit::Backend::kAuto))
    GTEST_SKIP() << "this GEMM's rows depend on their neighbours (docs/GEMM.md)";
  auto [layer, w] = build(qwen3_like(), 77);
  Rng rng(78);
  std::vector<std::vector<float>> x(3);
  for (auto& xs : x) xs = attnkit_test::uniform_vector(size_t(20 * 32), rng);
  std::vector<int64_t> lengths(3, 0);
  for (const auto& step : kBatchSteps)
    for (size_t s = 0; s < 3; ++s) lengths[s] += step[s];
  const int64_t d = layer.config().hidden_size;
  for (size_t s = 0; s < 3; ++s) x[s].resize(size_t(lengths[s] * d));
  auto batched = layer.new_paged_cache(40, 4).value();
  std::vector<std::vector<float>> out, alone_out;
  // Named through l: clang 14 cannot capture a structured binding.
  auto forward = [&, &l = layer](attnkit::PagedKVCache& pool) {
    return [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
               const TensorView& ov) { return l.forward_batch(xv, cu, ids, pool, 0, ov); };
  };
  attnkit_test::run_batch_steps(batched, d, x, kBatchSteps, &out, forward(batched));
  for (size_t s = 0; s < 3; ++s) {
    auto alone = layer.new_paged_cache(40, 4).value();
    std::vector<std::vector<int64_t>> steps;
    for (const auto& step : kBatchSteps)
      if (step[s] > 0) steps.push_back({step[s]});
    attnkit_test::run_batch_steps(alone, d, {x[s]}, steps, &alone_out, forward(alone));
    EXPECT_EQ(0, std::memcmp(out[s].data(), alone_out[0].data(), out[s].size() * sizeof(float)))
        << "sequence " << s;
  }
}

TEST(AttentionLayerPaged, MismatchedPoolsAndStepsAreRejected) {
  auto [layer, w] = build(mistral_like(), 3);
  const int64_t d = layer.config().hidden_size;
  std::vector<float> x(size_t(4 * d), 0.1f), out(size_t(4 * d), -2.0f);
  const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {4, d});
  const TensorView ov = attnkit::make_view(out.data(), DType::kF32, {4, d});
  AttentionConfig wider = mistral_like();
  wider.sliding_window = 7;  // a pool that releases pages this layer still sees
  auto other = build(wider, 4).layer.new_paged_cache(8, 4).value();
  const int64_t a = other.add_sequence();
  ASSERT_TRUE(other.append(std::vector<int64_t>{a}, std::vector<int64_t>{4}).ok());
  const std::vector<int32_t> cu{0, 4};
  const std::vector<int64_t> ids{a};
  attnkit::Status st = layer.forward_batch(xv, cu, ids, other, 0, ov);
  EXPECT_NE(st.message().find("AttentionLayer::forward_batch: cache spec."), std::string::npos)
      << st.message();
  auto pool = layer.new_paged_cache(8, 4).value();
  const int64_t b = pool.add_sequence();
  ASSERT_TRUE(pool.append(std::vector<int64_t>{b}, std::vector<int64_t>{3}).ok());
  st = layer.forward_batch(xv, cu, std::vector<int64_t>{b}, pool, 0, ov);
  EXPECT_NE(st.message().find("gives sequence 0 4 new tokens, but it has 3 reserved tokens"),
            std::string::npos)
      << st.message();
  st = layer.forward_batch(xv, cu, std::vector<int64_t>{7}, pool, 0, ov);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  st = layer.forward_batch(xv, std::vector<int32_t>{0, 3}, std::vector<int64_t>{b}, pool, 0, ov);
  EXPECT_NE(st.message().find("cu_seqlens_q[1] = 3 must equal x.shape[0] = 4"), std::string::npos)
      << st.message();
  for (float o : out) ASSERT_EQ(o, -2.0f);
  EXPECT_EQ(pool.written(b, 0).value(), 0);
}

// ---- bf16 weights ----------------------------------------------------------

// The four projections as bf16 (w's matrices rounded to bf16 in place, so
// the reference uses the values the layer holds); biases and norms f32.
attnkit::WeightMap bf16_weight_map(Weights& w, const AttentionConfig& c,
                                   std::vector<std::vector<attnkit::bf16>>* store) {
  attnkit::WeightMap m = weight_map(w, c, "");
  const std::pair<const char*, std::vector<float>*> matrices[] = {{"q_proj.weight", &w.wq},
                                                                  {"k_proj.weight", &w.wk},
                                                                  {"v_proj.weight", &w.wv},
                                                                  {"o_proj.weight", &w.wo}};
  for (const auto& [name, values] : matrices) {
    store->emplace_back();
    for (float& v : *values) {
      store->back().push_back(attnkit::float_to_bf16(v));
      v = attnkit::bf16_to_float(store->back().back());
    }
    TensorView view = m.at(name);
    view.data = store->back().data();
    view.dtype = DType::kBF16;
    m[name] = view;
  }
  return m;
}

TEST(AttentionLayerBf16, KeepsBf16WeightsAndMatchesTheReference) {
  const int64_t B = 2, T = 9;
  uint64_t seed = 1300;
  for (const auto& [name, c] : all_configs()) {
    SCOPED_TRACE(name);
    auto layer = AttentionLayer::create(c).value();
    Rng rng(seed++);
    Weights w = random_weights(c, rng);
    std::vector<std::vector<attnkit::bf16>> store;
    ASSERT_TRUE(layer.load_weights(bf16_weight_map(w, c, &store)).ok());
    // Kept as loaded: bf16 matrices (half an f32 copy's bytes), f32 vectors.
    const char* matrices[] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"};
    for (size_t i = 0; i < 4; ++i) {
      const TensorView v = layer.weight(matrices[i]).value();
      EXPECT_EQ(v.dtype, DType::kBF16) << matrices[i];
      EXPECT_EQ(0, std::memcmp(v.data, store[i].data(), store[i].size() * sizeof(attnkit::bf16)))
          << matrices[i];
    }
    if (c.qkv_bias) {
      EXPECT_EQ(layer.weight("q_proj.bias")->dtype, DType::kF32);
    }

    std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * c.hidden_size), rng);
    std::vector<float> out(x.size(), -9.0f);
    ASSERT_TRUE(layer.forward(view3(x, B, T, c.hidden_size), view3(out, B, T, c.hidden_size)).ok());
    const Reference ref =
        reference_forward(c, w, x, B, T, iota_positions(B, T), /*bf16_weights=*/true);
    EXPECT_TRUE(within("forward", out, ref.out, ref.out_bound));

    // forward_batch over a pool: each sequence against its own reference.
    std::vector<std::vector<float>> xs(3), outs;
    std::vector<int64_t> lengths(3, 0);
    for (const auto& step : kBatchSteps)
      for (size_t s = 0; s < 3; ++s) lengths[s] += step[s];
    for (size_t s = 0; s < 3; ++s)
      xs[s] = attnkit_test::uniform_vector(size_t(lengths[s] * c.hidden_size), rng);
    auto pool = layer.new_paged_cache(40, 4).value();
    attnkit_test::run_batch_steps(
        pool, c.hidden_size, xs, kBatchSteps, &outs,
        [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
            const TensorView& ov) { return layer.forward_batch(xv, cu, ids, pool, 0, ov); });
    for (size_t s = 0; s < 3; ++s) {
      const Reference r = reference_forward(c, w, xs[s], 1, lengths[s],
                                            iota_positions(1, lengths[s]), /*bf16_weights=*/true);
      EXPECT_TRUE(within("forward_batch", outs[s], r.out, r.out_bound)) << "sequence " << s;
    }
  }
}

TEST(AttentionLayerCache, NewCacheMatchesLayer) {
  auto [layer, w] = build(mistral_like(), 1);
  auto cache = layer.new_cache(3, 50, DType::kBF16);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->spec().num_kv_heads, 2);
  EXPECT_EQ(cache->spec().head_dim, 8);
  EXPECT_EQ(cache->spec().head_dim_v, 8);
  EXPECT_EQ(cache->spec().sliding_window, 4);
  EXPECT_EQ(cache->spec().batch_size, 3);
  EXPECT_EQ(cache->spec().dtype, DType::kBF16);
  EXPECT_EQ(cache->slots(), 3);
  const auto bad = layer.new_cache(0, 50);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("AttentionLayer::new_cache: "), std::string::npos);
}

// ---- the seeds' variants and forward_qkv ---------------------------------

TEST(AttentionLayerVariants, SeedsConstructorCrossAttention) {
  const struct {
    const char* variant;
    int64_t kv_heads;
  } variants[] = {{"mha", 4}, {"mqa", 1}, {"gqa-2", 2}};
  const int64_t B = 2, Sq = 5, Sk = 7, d = 32;
  uint64_t seed = 300;
  for (const auto& v : variants) {
    SCOPED_TRACE(v.variant);
    auto c = attnkit::attention_config_from_variant(v.variant, d, 4);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->num_heads, 4);
    EXPECT_EQ(c->num_kv_heads, v.kv_heads);
    EXPECT_EQ(c->head_dim, 8);
    auto [layer, w] = build(*c, seed++);
    EXPECT_EQ(layer.weight_names().size(), 8u);  // four projections, four biases
    Rng rng(seed++);
    std::vector<float> xq = attnkit_test::uniform_vector(size_t(B * Sq * d), rng);
    std::vector<float> xk = attnkit_test::uniform_vector(size_t(B * Sk * d), rng);
    std::vector<float> xv = attnkit_test::uniform_vector(size_t(B * Sk * d), rng);
    std::vector<float> out(size_t(B * Sq * d)), probs(size_t(B * 4 * Sq * Sk));
    // Unmasked, then key padding plus bottom-right causal.
    for (bool masked : {false, true}) {
      SCOPED_TRACE(masked ? "masked" : "unmasked");
      attnkit::AttentionOptions opt;
      attnkit_test::OracleOptions o;
      std::vector<int32_t> lens = {Sk, 4};
      if (masked) {
        opt.seqlens_k = lens;
        opt.causal = o.causal = true;
        o.seqlens_k = lens;
      }
      const auto st = layer.forward_qkv(
          view3(xq, B, Sq, d), view3(xk, B, Sk, d), view3(xv, B, Sk, d), view3(out, B, Sq, d), opt,
          attnkit::make_view(probs.data(), DType::kF32, {B, 4, Sq, Sk}));
      ASSERT_TRUE(st.ok()) << st.to_string();
      const Reference ref = reference_layer(*c, w, xq, xk, xv, B, Sq, Sk, iota_positions(B, Sq),
                                            iota_positions(B, Sk), o);
      EXPECT_TRUE(within("out", out, ref.out, ref.out_bound));
      EXPECT_TRUE(within("probs", probs, ref.probs, ref.probs_bound));
    }
  }
}

TEST(AttentionLayerVariants, ForwardQkvWithRopeNormAndLayerDefaults) {
  // Cross-attention (seqlen_q != seqlen_k) on RoPE configs: positions
  // 0..seqlen-1 on each side, qk-norm on both, and the layer's softcap and
  // scale where the options leave them 0.
  const int64_t B = 2, Sq = 4, Sk = 6, d = 32;
  uint64_t seed = 400;
  for (const auto& [name, c] : {Named{"gemma2", gemma2_like()}, Named{"qwen3", qwen3_like()}}) {
    SCOPED_TRACE(name);
    auto [layer, w] = build(c, seed++);
    Rng rng(seed++);
    std::vector<float> xq = attnkit_test::uniform_vector(size_t(B * Sq * d), rng);
    std::vector<float> xk = attnkit_test::uniform_vector(size_t(B * Sk * d), rng);
    std::vector<float> xv = attnkit_test::uniform_vector(size_t(B * Sk * d), rng);
    std::vector<float> out(xq.size());
    attnkit::AttentionOptions opt;
    opt.window_size = {2, 1};
    ASSERT_TRUE(layer
                    .forward_qkv(view3(xq, B, Sq, d), view3(xk, B, Sk, d), view3(xv, B, Sk, d),
                                 view3(out, B, Sq, d), opt)
                    .ok());
    attnkit_test::OracleOptions o;
    o.window_left = 2;
    o.window_right = 1;
    const Reference ref = reference_layer(c, w, xq, xk, xv, B, Sq, Sk, iota_positions(B, Sq),
                                          iota_positions(B, Sk), o);
    EXPECT_TRUE(within("out", out, ref.out, ref.out_bound));
  }
}

// ---- weights -------------------------------------------------------------

TEST(AttentionLayerWeights, NamesFollowTheConfig) {
  auto names = [](const AttentionConfig& c) {
    auto l = AttentionLayer::create(c);
    EXPECT_TRUE(l.ok()) << l.status().to_string();
    auto n = l->weight_names();
    std::sort(n.begin(), n.end());
    return n;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(llama_like()),
            (V{"k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"}));
  EXPECT_EQ(names(qwen2_like()), (V{"k_proj.bias", "k_proj.weight", "o_proj.weight", "q_proj.bias",
                                    "q_proj.weight", "v_proj.bias", "v_proj.weight"}));
  EXPECT_EQ(names(qwen3_like()), (V{"k_norm.weight", "k_proj.weight", "o_proj.weight",
                                    "q_norm.weight", "q_proj.weight", "v_proj.weight"}));
}

TEST(AttentionLayerWeights, PrefixAndConversionFromBf16) {
  AttentionConfig c = qwen3_like();
  auto layer = AttentionLayer::create(c);
  ASSERT_TRUE(layer.ok());
  Rng rng(12);
  Weights w = random_weights(c, rng);
  attnkit::WeightMap m = weight_map(w, c, "model.layers.3.self_attn.");
  // Another layer's weights under a different prefix are not this layer's.
  std::vector<float> other(4, 1.0f);
  m["model.layers.4.self_attn.q_proj.weight"] =
      attnkit::make_view(other.data(), DType::kF32, {2, 2});
  // q_norm as bf16: converted exactly (these values are bf16-representable).
  std::vector<attnkit::bf16> qn16(w.qn.size());
  for (size_t i = 0; i < w.qn.size(); ++i) {
    w.qn[i] = attnkit_test::round_bf16(w.qn[i]);
    qn16[i] = attnkit::float_to_bf16(w.qn[i]);
  }
  m["model.layers.3.self_attn.q_norm.weight"] =
      attnkit::make_view(qn16.data(), DType::kBF16, {c.head_dim});
  ASSERT_TRUE(layer->load_weights(m, "model.layers.3.self_attn").ok());
  auto qn = layer->weight("q_norm.weight");
  ASSERT_TRUE(qn.ok());
  for (int64_t i = 0; i < c.head_dim; ++i) EXPECT_EQ(qn->ptr<float>()[i], w.qn[size_t(i)]);
  auto wk = layer->weight("k_proj.weight");
  ASSERT_TRUE(wk.ok());
  EXPECT_EQ(std::memcmp(wk->data, w.wk.data(), w.wk.size() * sizeof(float)), 0);
  EXPECT_EQ(layer->weight("q_proj.bias").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(layer->weight("nonsense").status().code(), StatusCode::kNotFound);
}

TEST(AttentionLayerWeights, FailedLoadChangesNothing) {
  AttentionConfig c = qwen2_like();
  auto [layer, w] = build(c, 13);
  const int64_t B = 1, T = 4, d = c.hidden_size;
  Rng rng(14);
  std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * d), rng);
  std::vector<float> before(x.size()), after(x.size());
  ASSERT_TRUE(layer.forward(view3(x, B, T, d), view3(before, B, T, d)).ok());

  Rng rng2(15);
  Weights fresh = random_weights(c, rng2);
  std::vector<float> wrong(size_t(3 * d));
  struct Case {
    const char* what;
    StatusCode code;
    const char* needle;
  };
  const Case cases[] = {
      {"missing", StatusCode::kNotFound, "'v_proj.bias' is missing"},
      {"wrong shape", StatusCode::kInvalidArgument, "'k_proj.weight' has shape [3, 32]"},
      {"unexpected", StatusCode::kInvalidArgument, "o_proj.bias"}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.what);
    attnkit::WeightMap m = weight_map(fresh, c, "");
    if (std::string(cs.what) == "missing") m.erase("v_proj.bias");
    if (std::string(cs.what) == "wrong shape")
      m["k_proj.weight"] = attnkit::make_view(wrong.data(), DType::kF32, {3, d});
    if (std::string(cs.what) == "unexpected")  // qwen2 has no o_proj bias
      m["o_proj.bias"] = attnkit::make_view(wrong.data(), DType::kF32, {d});
    const auto st = layer.load_weights(m);
    EXPECT_EQ(st.code(), cs.code) << st.to_string();
    EXPECT_NE(st.message().find(cs.needle), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("AttentionLayer::load_weights"), std::string::npos) << st.message();
    // Every weight is still the old one: same bytes, same forward output.
    auto wq = layer.weight("q_proj.weight");
    ASSERT_TRUE(wq.ok());
    EXPECT_EQ(std::memcmp(wq->data, w.wq.data(), w.wq.size() * sizeof(float)), 0);
    auto bq = layer.weight("q_proj.bias");
    ASSERT_TRUE(bq.ok());
    EXPECT_EQ(std::memcmp(bq->data, w.bq.data(), w.bq.size() * sizeof(float)), 0);
    ASSERT_TRUE(layer.forward(view3(x, B, T, d), view3(after, B, T, d)).ok());
    EXPECT_EQ(before, after);
  }
}

// ---- bad inputs ------------------------------------------------------------

// Byte snapshot of a cache's observable state.
struct Snapshot {
  int64_t length;
  std::vector<unsigned char> keys, values;
  explicit Snapshot(const KVCache& c)
      : length(c.length()),
        keys(attnkit_test::span_bytes(c.keys())),
        values(attnkit_test::span_bytes(c.values())) {}
  bool operator==(const Snapshot&) const = default;
};

TEST(AttentionLayerErrors, BadInputsLeaveOutAndCacheUnchanged) {
  const AttentionConfig c = mistral_like();
  auto [layer, w] = build(c, 16);
  const int64_t B = 2, T = 3, d = c.hidden_size;
  Rng rng(17);
  std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * d), rng);
  std::vector<float> out(x.size(), -1.0f), x4(size_t(B * T * (d + 1)));
  auto cache = layer.new_cache(B, 8);
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(layer.forward(view3(x, B, T, d), view3(out, B, T, d), {}, &*cache).ok());  // 3 held
  std::fill(out.begin(), out.end(), -1.0f);
  const Snapshot before(*cache);

  // Caches of other layers: kv heads, head_dim, window, batch.
  AttentionConfig gqa1 = c, hd16 = c, nowin = c;
  gqa1.num_kv_heads = 1;
  hd16.head_dim = hd16.rope.head_dim = 16;
  nowin.sliding_window = 0;
  auto other = [](const AttentionConfig& oc, int64_t batch) {
    auto l = AttentionLayer::create(oc);
    EXPECT_TRUE(l.ok());
    auto k = l->new_cache(batch, 8);
    EXPECT_TRUE(k.ok());
    return std::move(k).value();
  };
  KVCache c_kv = other(gqa1, B), c_hd = other(hd16, B), c_win = other(nowin, B),
          c_batch = other(c, 3);

  int64_t neg[1] = {-1};
  std::vector<int64_t> five(5, 0);
  struct Case {
    const char* what;
    TensorView x, out;
    std::span<const int64_t> pos;
    KVCache* cache;
    StatusCode code;
    const char* needle;
  };
  const TensorView X = view3(x, B, T, d), O = view3(out, B, T, d);
  std::vector<Case> cases = {
      {"x hidden",
       view3(x4, B, T, d + 1),
       O,
       {},
       &*cache,
       StatusCode::kInvalidArgument,
       "x.shape[2] (hidden_size) = 33 must equal config().hidden_size = 32"},
      {"x rank 4",
       attnkit::make_view(x.data(), DType::kF32, {B, T, 1, d}),
       O,
       {},
       &*cache,
       StatusCode::kInvalidArgument,
       "x has rank 4"},
      {"out seq",
       X,
       view3(out, B, T - 1, d),
       {},
       &*cache,
       StatusCode::kInvalidArgument,
       "out.shape[1] (seq) = 2 must equal x.shape[1] = 3"},
      {"out aliases x", X, X, {}, &*cache, StatusCode::kInvalidArgument, "out overlaps x"},
      {"positions size", X, O, five, &*cache, StatusCode::kInvalidArgument,
       "positions has 5 entries"},
      {"negative position", view3(x, B, 1, d), view3(out, B, 1, d), neg, &*cache,
       StatusCode::kInvalidArgument, "positions[0] = -1"},
      {"cache kv heads",
       X,
       O,
       {},
       &c_kv,
       StatusCode::kInvalidArgument,
       "cache spec.num_kv_heads = 1 must equal config().num_kv_heads = 2"},
      {"cache head_dim", X, O, {}, &c_hd, StatusCode::kInvalidArgument, "cache spec.head_dim = 16"},
      {"cache window",
       X,
       O,
       {},
       &c_win,
       StatusCode::kInvalidArgument,
       "cache spec.sliding_window = 0 must equal config().sliding_window = 4"},
      {"cache batch",
       X,
       O,
       {},
       &c_batch,
       StatusCode::kInvalidArgument,
       "cache spec.batch_size = 3 must equal x.shape[0] (batch) = 2"},
      {"cache overflow", view3(x, B, T, d), O, {}, &*cache, StatusCode::kOutOfRange, ""},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.what);
    const Snapshot other_before(*cs.cache);
    attnkit::Status st;
    if (std::string(cs.what) == "cache overflow") {
      // 3 held + 3 fits in 8; 3 + 6 does not.
      std::vector<float> x6(size_t(B * 6 * d)), o6(x6.size(), -1.0f);
      st = layer.forward(view3(x6, B, 6, d), view3(o6, B, 6, d), {}, cs.cache);
      EXPECT_NE(st.message().find("cache length 3 + 6 new tokens exceeds max_seq_len = 8"),
                std::string::npos)
          << st.message();
      EXPECT_TRUE(std::all_of(o6.begin(), o6.end(), [](float e) { return e == -1.0f; }));
    } else {
      st = layer.forward(cs.x, cs.out, cs.pos, cs.cache);
      EXPECT_NE(st.message().find(cs.needle), std::string::npos) << st.message();
    }
    EXPECT_EQ(st.code(), cs.code) << st.to_string();
    EXPECT_EQ(st.message().rfind("AttentionLayer::forward: ", 0), 0u) << st.message();
    EXPECT_TRUE(Snapshot(*cs.cache) == other_before);
    EXPECT_TRUE(Snapshot(*cache) == before);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float e) { return e == -1.0f; }));
  }

  // A cache needs a causal layer.
  AttentionConfig enc = c;
  enc.causal = false;
  auto [enc_layer, enc_w] = build(enc, 18);
  const auto st = enc_layer.forward(X, O, {}, &*cache);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("causal"), std::string::npos) << st.message();
  EXPECT_TRUE(Snapshot(*cache) == before);
}

TEST(AttentionLayerErrors, NotLoadedAndBadConfig) {
  auto layer = AttentionLayer::create(llama_like());
  ASSERT_TRUE(layer.ok());
  std::vector<float> x(32), out(32);
  const auto st = layer->forward(view3(x, 1, 1, 32), view3(out, 1, 1, 32));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("no weights loaded"), std::string::npos) << st.message();
  EXPECT_EQ(layer->weight("q_proj.weight").status().code(), StatusCode::kNotFound);

  AttentionConfig bad = llama_like();
  bad.num_kv_heads = 3;  // does not divide 4
  const auto r = AttentionLayer::create(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("AttentionLayer::create: ", 0), 0u) << r.status().message();
}

}  // namespace
