// The attention layers of gpt-oss, Gemma 3, Llama 4 and Qwen3-Next against
// a float64 implementation written here from the authors' modeling code
// (Hugging Face transformers, models/{gpt_oss,gemma3,llama4,qwen3_next}):
//   projections with biases; q_proj's [query | gate] rows per head
//   (Qwen3-Next); RMSNorm with w (Qwen3) or 1 + w (Gemma 3, Qwen3-Next)
//   before RoPE; RoPE half-split (gpt-oss, Gemma, Qwen) or interleaved
//   (Llama 4), partial (Qwen3-Next), YaRN with truncate false and its
//   attention factor on cos and sin (gpt-oss); the weightless L2 norm
//   after RoPE (Llama 4's RoPE layers); temperature tuning by absolute
//   position (Llama 4's NoPE layers); attention with causal, sliding-window
//   and chunk masks and per-head sink logits in the denominator (gpt-oss);
//   sigmoid(gate) on the output (Qwen3-Next); o_proj.
// Each layer kind runs as one prefill, as prefill-then-decode through a
// KVCache, and as continuous-batching steps through a PagedKVCache.
//
// Tolerance: 1e-4 of the largest |output|. The layer computes in f32 with
// fp32 accumulation over at most 32 terms per dot product and 20 keys, so
// its relative error is of order 32 * 2^-24 ~ 2e-6 of the magnitudes it
// sums (O(1) here); a wrong pairing, gain, mask, sink or gate moves the
// output by O(0.01) or more of its magnitude (the mutation check below
// shows it does).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "attnkit/attention_layer.h"
#include "common/batch_steps.h"
#include "common/random.h"

namespace {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::DType;
using attnkit::QkNorm;
using attnkit::RopePairing;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit_test::Rng;

// ---- the layer kinds, as each family's config.json makes them -------------

AttentionConfig base(const char* type) {
  AttentionConfig c;
  c.model_type = type;
  c.hidden_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = c.rope.head_dim = 8;
  c.rope.theta = 10000.0;
  return c;
}

// gpt-oss: biases everywhere, sinks, YaRN (truncate false); even layers
// slide (window 128 in the release; 4 here so the window bites).
AttentionConfig gpt_oss(bool sliding, bool sinks) {
  AttentionConfig c = base("gpt_oss");
  c.qkv_bias = c.o_bias = true;
  c.sinks = sinks;
  c.rope.theta = 150000.0;
  c.rope.scaling.type = attnkit::RopeScaling::Type::kYarn;
  c.rope.scaling.factor = 32.0;
  // So that the YaRN ramp runs from pair 1.34 to 2.50 of the 4 (truncate
  // would round it to 1..3).
  c.rope.scaling.original_max_position_embeddings = 10800;
  c.rope.scaling.beta_fast = 32.0;
  c.rope.scaling.beta_slow = 1.0;
  c.rope.scaling.truncate = false;
  if (sliding) c.sliding_window = 4;
  return c;
}

// Gemma 3: q/k norms with 1 + w, scale query_pre_attn_scalar^-0.5, local
// layers slide with their own RoPE base.
AttentionConfig gemma3(bool local) {
  AttentionConfig c = base("gemma3_text");
  c.head_dim = c.rope.head_dim = 16;
  c.qk_norm = QkNorm::kRmsOnePlus;
  c.softmax_scale = static_cast<float>(1.0 / std::sqrt(12.0));  // query_pre_attn_scalar 12
  c.rope.theta = local ? 10000.0 : 1e6;
  if (local) c.sliding_window = 5;
  return c;
}

// Llama 4 RoPE layer: interleaved RoPE, L2 norm after it, chunked
// attention (chunk_size: 0 leaves it out).
AttentionConfig llama4_rope(int64_t chunk_size) {
  AttentionConfig c = base("llama4_text");
  c.rope.pairing = RopePairing::kInterleaved;
  c.rope.theta = 500000.0;
  c.qk_norm = QkNorm::kL2;
  c.rms_norm_eps = 1e-5;
  c.chunk_size = chunk_size;
  return c;
}

// Llama 4 NoPE layer: global, no RoPE, no qk-norm, temperature tuning
// (floor_scale 3 here instead of 8192, so the scale changes within a test).
AttentionConfig llama4_nope() {
  AttentionConfig c = base("llama4_text");
  c.use_rope = false;
  c.temperature_tuning = true;
  c.floor_scale = 3.0;
  c.attn_scale = 0.1;
  return c;
}

// Qwen3-Next full-attention layer: gated output, zero-centred norms,
// partial RoPE (partial_rotary_factor 0.25).
AttentionConfig qwen3_next() {
  AttentionConfig c = base("qwen3_next");
  c.head_dim = c.rope.head_dim = 16;
  c.rope.rotary_dim = 4;
  c.qk_norm = QkNorm::kRmsOnePlus;
  c.output_gate = true;
  return c;
}

struct Kind {
  const char* name;
  AttentionConfig config;
};

// ---- weights ----------------------------------------------------------------

struct Weights {
  std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, sinks;
};

int64_t q_rows(const AttentionConfig& c) {
  return c.num_heads * c.head_dim * (c.output_gate ? 2 : 1);
}

Weights random_weights(const AttentionConfig& c, Rng& rng) {
  const int64_t d = c.hidden_size, kvo = c.num_kv_heads * c.head_dim;
  auto w = [&](int64_t out, int64_t in) {
    const float a = 1.0f / std::sqrt(float(in));
    return attnkit_test::uniform_vector(size_t(out * in), rng, -a, a);
  };
  auto u = [&](int64_t n, float lo, float hi) {
    return attnkit_test::uniform_vector(size_t(n), rng, lo, hi);
  };
  Weights r;
  // q a little larger than nn.Linear's init, so the softmax is not flat
  // and a wrong scale or position shows.
  r.wq = w(q_rows(c), d);
  for (float& x : r.wq) x *= 3.0f;
  r.wk = w(kvo, d);
  r.wv = w(kvo, d);
  r.wo = w(d, c.num_heads * c.head_dim);
  if (c.qkv_bias) {
    r.bq = u(q_rows(c), -0.5f, 0.5f);
    r.bk = u(kvo, -0.5f, 0.5f);
    r.bv = u(kvo, -0.5f, 0.5f);
  }
  if (c.o_bias) r.bo = u(d, -0.5f, 0.5f);
  if (c.qk_norm == QkNorm::kRms) {
    r.qn = u(c.head_dim, 0.5f, 1.5f);
    r.kn = u(c.head_dim, 0.5f, 1.5f);
  } else if (c.qk_norm == QkNorm::kRmsOnePlus) {
    // Stored as w; the gain is 1 + w (zero-centred, as Gemma stores it).
    r.qn = u(c.head_dim, -0.5f, 1.5f);
    r.kn = u(c.head_dim, -0.5f, 1.5f);
  }
  if (c.sinks) r.sinks = u(c.num_heads, -1.0f, 3.0f);
  return r;
}

attnkit::WeightMap weight_map(Weights& w, const AttentionConfig& c) {
  const int64_t d = c.hidden_size, kvo = c.num_kv_heads * c.head_dim;
  attnkit::WeightMap m;
  auto put = [&](const char* n, std::vector<float>& v, std::initializer_list<int64_t> shape) {
    if (!v.empty()) m[n] = attnkit::make_view(v.data(), DType::kF32, shape);
  };
  put("q_proj.weight", w.wq, {q_rows(c), d});
  put("k_proj.weight", w.wk, {kvo, d});
  put("v_proj.weight", w.wv, {kvo, d});
  put("o_proj.weight", w.wo, {d, c.num_heads * c.head_dim});
  put("q_proj.bias", w.bq, {q_rows(c)});
  put("k_proj.bias", w.bk, {kvo});
  put("v_proj.bias", w.bv, {kvo});
  put("o_proj.bias", w.bo, {d});
  put("q_norm.weight", w.qn, {c.head_dim});
  put("k_norm.weight", w.kn, {c.head_dim});
  put("sinks", w.sinks, {c.num_heads});
  return m;
}

// ---- the float64 reference layer -------------------------------------------

// y [rows, n] = x [rows, in] w^T + b.
std::vector<double> linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<float>& w, const std::vector<float>& b, int64_t n) {
  std::vector<double> y(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double acc = b.empty() ? 0.0 : b[size_t(j)];
      for (int64_t k = 0; k < in; ++k) acc += x[size_t(r * in + k)] * w[size_t(j * in + k)];
      y[size_t(r * n + j)] = acc;
    }
  return y;
}

// Rows of `dim`: y = y / sqrt(mean(y^2) + eps) * gain, gain = w (kRms),
// 1 + w (kRmsOnePlus) or 1 (kL2, w empty).
void rms_norm(std::vector<double>& y, int64_t dim, const std::vector<float>& w, QkNorm kind,
              double eps) {
  for (size_t r = 0; r < y.size() / size_t(dim); ++r) {
    double* v = &y[r * size_t(dim)];
    double ss = 0.0;
    for (int64_t d = 0; d < dim; ++d) ss += v[d] * v[d];
    const double inv = 1.0 / std::sqrt(ss / double(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) {
      const double g = kind == QkNorm::kL2           ? 1.0
                       : kind == QkNorm::kRmsOnePlus ? 1.0 + double(w[size_t(d)])
                                                     : double(w[size_t(d)]);
      v[d] = v[d] * inv * g;
    }
  }
}

// The inverse frequencies and the cos/sin factor of transformers' rope
// utilities: default, or YaRN (_compute_yarn_parameters).
std::vector<double> inv_freq(const attnkit::RopeConfig& r, int64_t rot, double* attention) {
  const int64_t half = rot / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    f[size_t(i)] = std::pow(r.theta, -2.0 * double(i) / double(rot));
  *attention = 1.0;
  if (r.scaling.type != attnkit::RopeScaling::Type::kYarn) return f;
  const auto& s = r.scaling;
  const double orig = double(s.original_max_position_embeddings), dim = double(rot);
  const auto correction = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(r.theta));
  };
  double low = correction(s.beta_fast), high = correction(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    // ramp 0: extrapolation (the original frequency); 1: interpolation.
    f[size_t(i)] = f[size_t(i)] / s.factor * ramp + f[size_t(i)] * (1.0 - ramp);
  }
  *attention = 0.1 * std::log(s.factor) + 1.0;
  return f;
}

// RoPE on [tokens, heads, dim] rows at pos[token].
void rope(std::vector<double>& y, int64_t heads, int64_t dim, const attnkit::RopeConfig& r,
          const std::vector<int64_t>& pos) {
  const int64_t rot = r.rotary_dim ? r.rotary_dim : dim, half = rot / 2;
  double att = 1.0;
  const std::vector<double> f = inv_freq(r, rot, &att);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int64_t h = 0; h < heads; ++h) {
      double* v = &y[(t * size_t(heads) + size_t(h)) * size_t(dim)];
      for (int64_t i = 0; i < half; ++i) {
        const double a = double(pos[t]) * f[size_t(i)];
        const double c = std::cos(a) * att, s = std::sin(a) * att;
        // Half-split pairs (i, i + rot/2); interleaved pairs (2i, 2i + 1),
        // Llama 4's complex multiplication.
        const int64_t i0 = r.pairing == RopePairing::kHalfSplit ? i : 2 * i;
        const int64_t i1 = r.pairing == RopePairing::kHalfSplit ? i + half : 2 * i + 1;
        const double x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c - x1 * s;
        v[i1] = x1 * c + x0 * s;
      }
    }
}

// One sequence x [T, hidden] at positions 0..T-1 -> out [T, hidden].
std::vector<double> reference(const AttentionConfig& c, const Weights& w,
                              const std::vector<float>& x, int64_t T) {
  const int64_t d = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const std::vector<double> xd(x.begin(), x.end());
  const std::vector<double> qfull = linear(xd, T, d, w.wq, w.bq, q_rows(c));
  std::vector<double> q(static_cast<size_t>(T * H * D)), gate(static_cast<size_t>(T * H * D));
  if (c.output_gate) {
    // view(T, H, 2D) then chunk along the last dim: [query | gate] per head.
    for (int64_t r = 0; r < T * H; ++r)
      for (int64_t e = 0; e < D; ++e) {
        q[size_t(r * D + e)] = qfull[size_t(r * 2 * D + e)];
        gate[size_t(r * D + e)] = qfull[size_t(r * 2 * D + D + e)];
      }
  } else {
    q = qfull;
  }
  std::vector<double> k = linear(xd, T, d, w.wk, w.bk, Hkv * D);
  const std::vector<double> v = linear(xd, T, d, w.wv, w.bv, Hkv * D);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = t;
  if (c.qk_norm == QkNorm::kRms || c.qk_norm == QkNorm::kRmsOnePlus) {
    rms_norm(q, D, w.qn, c.qk_norm, c.rms_norm_eps);
    rms_norm(k, D, w.kn, c.qk_norm, c.rms_norm_eps);
  }
  if (c.use_rope) {
    rope(q, H, D, c.rope, pos);
    rope(k, Hkv, D, c.rope, pos);
  }
  if (c.qk_norm == QkNorm::kL2) {
    rms_norm(q, D, {}, QkNorm::kL2, c.rms_norm_eps);
    rms_norm(k, D, {}, QkNorm::kL2, c.rms_norm_eps);
  }
  if (c.temperature_tuning && !c.use_rope)
    for (int64_t t = 0; t < T; ++t) {
      const double s =
          std::log(std::floor((double(t) + 1.0) / c.floor_scale) + 1.0) * c.attn_scale + 1.0;
      for (int64_t e = 0; e < H * D; ++e) q[size_t(t * H * D + e)] *= s;
    }
  const double scale = c.softmax_scale > 0.0f ? c.softmax_scale : 1.0 / std::sqrt(double(D));
  std::vector<double> o(static_cast<size_t>(T * H * D), 0.0), p(static_cast<size_t>(T));
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / (H / Hkv);
    for (int64_t i = 0; i < T; ++i) {
      double m = c.sinks ? double(w.sinks[size_t(h)]) : -HUGE_VAL;
      for (int64_t j = 0; j <= i; ++j) {
        p[size_t(j)] = -HUGE_VAL;
        if (c.sliding_window > 0 && j <= i - c.sliding_window) continue;
        if (c.chunk_size > 0 && j / c.chunk_size != i / c.chunk_size) continue;
        double s = 0.0;
        for (int64_t e = 0; e < D; ++e)
          s += q[size_t((i * H + h) * D + e)] * k[size_t((j * Hkv + g) * D + e)];
        p[size_t(j)] = s * scale;
        m = std::max(m, p[size_t(j)]);
      }
      // The sink joins the denominator only (gpt-oss drops its probability).
      double sum = c.sinks ? std::exp(double(w.sinks[size_t(h)]) - m) : 0.0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[size_t(j)] - m);
      for (int64_t j = 0; j <= i; ++j) {
        const double pj = std::exp(p[size_t(j)] - m) / sum;
        for (int64_t e = 0; e < D; ++e)
          o[size_t((i * H + h) * D + e)] += pj * v[size_t((j * Hkv + g) * D + e)];
      }
    }
  }
  if (c.output_gate)
    for (size_t i = 0; i < o.size(); ++i) o[i] /= 1.0 + std::exp(-gate[i]);
  return linear(o, T, H * D, w.wo, w.bo, d);
}

// |actual - expected| <= 1e-4 max|expected|, naming the worst element.
::testing::AssertionResult close(const std::vector<float>& actual,
                                 const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return ::testing::AssertionFailure() << "sizes differ";
  double mag = 0.0, worst = 0.0;
  size_t at = 0;
  for (double e : expected) mag = std::max(mag, std::fabs(e));
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(double(actual[i]) - expected[i]);
    if (!(err <= worst)) {
      worst = err;
      at = i;
    }
  }
  const double bound = 1e-4 * mag;
  auto r = worst <= bound ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
  return r << "worst element [" << at << "]: actual " << actual[at] << ", expected " << expected[at]
           << ", |diff| " << worst << ", bound " << bound;
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
  const auto st = layer->load_weights(weight_map(w, c));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return {std::move(layer).value(), std::move(w)};
}

TensorView view3(float* p, int64_t a, int64_t b, int64_t c) {
  return attnkit::make_view(p, DType::kF32, {a, b, c});
}

// One prefill of `batch` sequences; each batch item checked alone.
void check_prefill(const Kind& kind, uint64_t seed) {
  SCOPED_TRACE(kind.name);
  const AttentionConfig& c = kind.config;
  auto [layer, w] = build(c, seed);
  const int64_t B = 2, T = 13, d = c.hidden_size;
  Rng rng(seed + 1);
  std::vector<float> x = attnkit_test::uniform_vector(size_t(B * T * d), rng);
  std::vector<float> out(x.size(), -9.0f);
  const auto st = layer.forward(view3(x.data(), B, T, d), view3(out.data(), B, T, d));
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> xb(x.begin() + b * T * d, x.begin() + (b + 1) * T * d);
    const std::vector<float> ob(out.begin() + b * T * d, out.begin() + (b + 1) * T * d);
    EXPECT_TRUE(close(ob, reference(c, w, xb, T))) << "batch item " << b;
  }
}

// Prefill then decode through the layer's own KVCache.
void check_cache(const Kind& kind, uint64_t seed) {
  SCOPED_TRACE(kind.name);
  const AttentionConfig& c = kind.config;
  auto [layer, w] = build(c, seed);
  const int64_t B = 2, d = c.hidden_size;
  const std::vector<int64_t> steps = {6, 1, 1, 3, 1, 1, 1, 2, 1, 1, 1};
  int64_t N = 0;
  for (int64_t t : steps) N += t;
  Rng rng(seed + 1);
  std::vector<float> x = attnkit_test::uniform_vector(size_t(B * N * d), rng);
  std::vector<float> out(x.size(), -9.0f);
  auto cache = layer.new_cache(B, N);
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  EXPECT_EQ(cache->spec().chunk_size, c.chunk_size);
  EXPECT_EQ(cache->spec().sliding_window, c.sliding_window);
  int64_t t0 = 0;
  for (int64_t T : steps) {
    TensorView xv = view3(x.data() + t0 * d, B, T, d), ov = view3(out.data() + t0 * d, B, T, d);
    xv.strides = ov.strides = {N * d, d, 1};
    const auto st = layer.forward(xv, ov, {}, &*cache);
    ASSERT_TRUE(st.ok()) << st.to_string();
    t0 += T;
  }
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float> xb(x.begin() + b * N * d, x.begin() + (b + 1) * N * d);
    const std::vector<float> ob(out.begin() + b * N * d, out.begin() + (b + 1) * N * d);
    EXPECT_TRUE(close(ob, reference(c, w, xb, N))) << "batch item " << b;
  }
}

// Continuous batching over the layer's paged pool: prompts in pieces,
// decodes and idle sequences mixed in one call.
void check_paged(const Kind& kind, uint64_t seed) {
  SCOPED_TRACE(kind.name);
  const AttentionConfig& c = kind.config;
  // Named members, not a structured binding: the lambda below captures the
  // layer, which clang 14 refuses for bindings.
  Built built = build(c, seed);
  AttentionLayer& layer = built.layer;
  const Weights& w = built.w;
  const std::vector<std::vector<int64_t>> steps = {{6, 3, 0}, {1, 2, 4}, {1, 1, 1}, {3, 0, 1},
                                                   {1, 1, 5}, {1, 1, 1}, {2, 1, 1}};
  std::vector<int64_t> lengths(3, 0);
  for (const auto& s : steps)
    for (size_t i = 0; i < 3; ++i) lengths[i] += s[i];
  Rng rng(seed + 1);
  std::vector<std::vector<float>> x(3), out;
  for (size_t i = 0; i < 3; ++i)
    x[i] = attnkit_test::uniform_vector(size_t(lengths[i] * c.hidden_size), rng);
  auto pool = layer.new_paged_cache(40, 4, 2);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  EXPECT_EQ(pool->spec().chunk_size, c.chunk_size);
  attnkit_test::run_batch_steps(
      *pool, c.hidden_size, x, steps, &out,
      [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
          const TensorView& ov) { return layer.forward_batch(xv, cu, ids, *pool, 1, ov); });
  for (size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(close(out[i], reference(c, w, x[i], lengths[i]))) << "sequence " << i;
}

// Every layer kind of the four families.
std::vector<Kind> kinds() {
  return {{"gpt_oss sliding", gpt_oss(true, true)}, {"gpt_oss full", gpt_oss(false, true)},
          {"gemma3 local", gemma3(true)},           {"gemma3 global", gemma3(false)},
          {"llama4 rope, chunk 4", llama4_rope(4)}, {"llama4 rope, chunk 5", llama4_rope(5)},
          {"llama4 nope", llama4_nope()},           {"qwen3_next full attention", qwen3_next()}};
}

TEST(AttentionFamilies, PrefillMatchesFloat64Reference) {
  uint64_t seed = 10;
  for (const Kind& k : kinds()) check_prefill(k, seed += 10);
}

TEST(AttentionFamilies, PrefillThenDecodeThroughKVCache) {
  uint64_t seed = 200;
  for (const Kind& k : kinds()) check_cache(k, seed += 10);
}

TEST(AttentionFamilies, ContinuousBatchingThroughPagedKVCache) {
  uint64_t seed = 400;
  for (const Kind& k : kinds()) check_paged(k, seed += 10);
}

// forward_qkv(x, x, x) with causal set computes forward(x): the same
// norms, RoPE, temperature, gate, and the layer's chunk and sinks by
// default (its window is the caller's to pass, so the sliding kinds pass
// it too).
TEST(AttentionFamilies, ForwardQkvTakesTheLayersFeatures) {
  uint64_t seed = 700;
  for (const Kind& k : kinds()) {
    SCOPED_TRACE(k.name);
    const AttentionConfig& c = k.config;
    auto [layer, w] = build(c, seed += 10);
    const int64_t T = 13, d = c.hidden_size;
    Rng rng(seed + 1);
    std::vector<float> x = attnkit_test::uniform_vector(size_t(T * d), rng);
    std::vector<float> out(x.size(), -9.0f);
    attnkit::AttentionOptions opt;
    opt.causal = true;
    if (c.sliding_window > 0) opt.window_size.left = c.sliding_window - 1;
    const TensorView xv = view3(x.data(), 1, T, d);
    const auto st = layer.forward_qkv(xv, xv, xv, view3(out.data(), 1, T, d), opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(close(out, reference(c, w, x, T)));
  }
}

// One pool shared by layers of different kinds (its window and chunk 0):
// a gpt-oss sliding layer on pool layer 0, a Llama 4 chunked layer on pool
// layer 1 and a gpt-oss full layer on pool layer 2, each passing its own
// window or chunk, each matching its float64 port.
TEST(AttentionFamilies, OnePoolSharedByLayersOfDifferentKinds) {
  const AttentionConfig configs[] = {gpt_oss(true, true), llama4_rope(4), gpt_oss(false, true)};
  std::vector<Built> layers;
  for (size_t l = 0; l < 3; ++l) layers.push_back(build(configs[l], 600 + l));
  auto pool = layers[2].layer.new_paged_cache(60, 4, 3);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  ASSERT_EQ(pool->spec().sliding_window, 0);
  ASSERT_EQ(pool->spec().chunk_size, 0);
  const std::vector<std::vector<int64_t>> steps = {{6, 3}, {1, 2}, {1, 1}, {3, 0}, {1, 5}, {1, 1}};
  std::vector<int64_t> lengths(2, 0);
  for (const auto& st : steps)
    for (size_t i = 0; i < 2; ++i) lengths[i] += st[i];
  const int64_t d = configs[0].hidden_size;
  Rng rng(9);
  std::vector<std::vector<float>> x(2), out_last;
  for (size_t i = 0; i < 2; ++i) x[i] = attnkit_test::uniform_vector(size_t(lengths[i] * d), rng);
  // Layers 0 and 1 write their outputs here, per sequence, as they run.
  std::vector<std::vector<std::vector<float>>> outs(2, std::vector<std::vector<float>>(2));
  attnkit_test::run_batch_steps(
      *pool, d, x, steps, &out_last,
      [&](const TensorView& xv, std::span<const int32_t> cu, std::span<const int64_t> ids,
          const TensorView& ov) {
        std::vector<float> tmp(size_t(xv.shape[0] * d) + 1);
        const TensorView tv = attnkit::make_view(tmp.data(), DType::kF32, {xv.shape[0], d});
        for (int64_t l = 0; l < 2; ++l) {
          ATTNKIT_RETURN_IF_ERROR(layers[size_t(l)].layer.forward_batch(xv, cu, ids, *pool, l, tv));
          for (size_t i = 0; i < 2; ++i)
            outs[size_t(l)][i].insert(outs[size_t(l)][i].end(), tmp.begin() + cu[i] * d,
                                      tmp.begin() + cu[i + 1] * d);
        }
        return layers[2].layer.forward_batch(xv, cu, ids, *pool, 2, ov);
      });
  for (size_t i = 0; i < 2; ++i) {
    for (size_t l = 0; l < 2; ++l)
      EXPECT_TRUE(close(outs[l][i], reference(configs[l], layers[l].w, x[i], lengths[i])))
          << "pool layer " << l << ", sequence " << i;
    EXPECT_TRUE(close(out_last[i], reference(configs[2], layers[2].w, x[i], lengths[i])))
        << "pool layer 2, sequence " << i;
  }
  // A pool that releases by another window is refused, naming the field.
  auto windowed = layers[0].layer.new_paged_cache(8, 4).value();
  std::vector<float> xs(size_t(d), 0.1f), os(size_t(d), -4.0f);
  const int64_t id = windowed.add_sequence();
  ASSERT_TRUE(windowed.append(std::vector<int64_t>{id}, std::vector<int64_t>{1}).ok());
  const attnkit::Status st = layers[2].layer.forward_batch(
      attnkit::make_view(xs.data(), DType::kF32, {1, d}), std::vector<int32_t>{0, 1},
      std::vector<int64_t>{id}, windowed, 0, attnkit::make_view(os.data(), DType::kF32, {1, d}));
  EXPECT_NE(
      st.message().find("cache spec.sliding_window = 4 must equal config().sliding_window = 0"),
      std::string::npos)
      << st.message();
  for (float o : os) EXPECT_EQ(o, -4.0f);
}

// The reference is sensitive to each feature: dropping any one of them, or
// splitting q_proj's rows the other way round, moves the output beyond the
// tolerance (so the checks above can fail).
TEST(AttentionFamilies, ReferenceSeesEveryFeature) {
  struct Mutation {
    const char* name;
    AttentionConfig config;
    void (*change)(AttentionConfig&, Weights&);
  };
  const Mutation mutations[] = {
      {"1 + w -> w", gemma3(true), [](AttentionConfig& c, Weights&) { c.qk_norm = QkNorm::kRms; }},
      {"window", gemma3(true), [](AttentionConfig& c, Weights&) { c.sliding_window = 0; }},
      {"yarn truncate", gpt_oss(false, false),
       [](AttentionConfig& c, Weights&) { c.rope.scaling.truncate = true; }},
      {"sinks", gpt_oss(true, true), [](AttentionConfig& c, Weights&) { c.sinks = false; }},
      {"chunk", llama4_rope(4), [](AttentionConfig& c, Weights&) { c.chunk_size = 0; }},
      {"L2 norm", llama4_rope(0), [](AttentionConfig& c, Weights&) { c.qk_norm = QkNorm::kNone; }},
      {"pairing", llama4_rope(0),
       [](AttentionConfig& c, Weights&) { c.rope.pairing = RopePairing::kHalfSplit; }},
      {"temperature", llama4_nope(),
       [](AttentionConfig& c, Weights&) { c.temperature_tuning = false; }},
      {"gate | query", qwen3_next(),
       [](AttentionConfig& c, Weights& w) {
         const size_t D = size_t(c.head_dim), row = size_t(c.hidden_size);
         for (size_t h = 0; h < size_t(c.num_heads); ++h)
           std::swap_ranges(w.wq.begin() + (2 * h * D) * row, w.wq.begin() + (2 * h + 1) * D * row,
                            w.wq.begin() + (2 * h + 1) * D * row);
       }},
      {"partial rotary", qwen3_next(), [](AttentionConfig& c, Weights&) { c.rope.rotary_dim = 0; }},
  };
  for (const Mutation& m : mutations) {
    SCOPED_TRACE(m.name);
    auto [layer, w] = build(m.config, 7);
    const int64_t T = 13, d = m.config.hidden_size;
    Rng rng(8);
    std::vector<float> x = attnkit_test::uniform_vector(size_t(T * d), rng);
    std::vector<float> out(x.size());
    ASSERT_TRUE(layer.forward(view3(x.data(), 1, T, d), view3(out.data(), 1, T, d)).ok());
    EXPECT_TRUE(close(out, reference(m.config, w, x, T)));
    AttentionConfig changed = m.config;
    Weights w2 = w;
    m.change(changed, w2);
    EXPECT_FALSE(close(out, reference(changed, w2, x, T)));
  }
}

// ---- bad input ----------------------------------------------------------

// A failed load names the weight and its rule, and leaves the loaded
// weights as they were.
void expect_load_fails(AttentionLayer& layer, attnkit::WeightMap m, const char* needle) {
  const std::vector<float> before = [&] {
    const TensorView v = layer.weight("q_proj.weight").value();
    return std::vector<float>(v.ptr<const float>(), v.ptr<const float>() + v.numel());
  }();
  const attnkit::Status st = layer.load_weights(m);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  const TensorView v = layer.weight("q_proj.weight").value();
  EXPECT_TRUE(std::equal(before.begin(), before.end(), v.ptr<const float>()));
}

TEST(AttentionFamiliesErrors, GateProjectionMustCarryTheGateRows) {
  const AttentionConfig c = qwen3_next();
  auto [layer, w] = build(c, 3);
  // A q_proj without the gate rows: [num_heads*head_dim, hidden].
  Weights bad = w;
  bad.wq.assign(size_t(c.num_heads * c.head_dim * c.hidden_size), 0.5f);
  attnkit::WeightMap m = weight_map(bad, c);
  m["q_proj.weight"] =
      attnkit::make_view(bad.wq.data(), DType::kF32, {c.num_heads * c.head_dim, c.hidden_size});
  expect_load_fails(layer, m, "q_proj.weight");
  expect_load_fails(layer, m, "output_gate");
}

TEST(AttentionFamiliesErrors, SinksMustBeFiniteAndOnePerHead) {
  const AttentionConfig c = gpt_oss(false, true);
  auto [layer, w] = build(c, 4);
  EXPECT_EQ(layer.weight("sinks").value().numel(), c.num_heads);
  Weights bad = w;
  bad.sinks.push_back(0.0f);
  attnkit::WeightMap m = weight_map(bad, c);
  m["sinks"] = attnkit::make_view(bad.sinks.data(), DType::kF32, {c.num_heads + 1});
  expect_load_fails(layer, m, "sinks");
  for (float v : {std::nanf(""), HUGE_VALF, -HUGE_VALF}) {
    Weights nonfinite = w;
    nonfinite.sinks[2] = v;
    for (float& x : nonfinite.wq) x = 0.25f;  // would change q_proj if the load went through
    expect_load_fails(layer, weight_map(nonfinite, c), "sinks[2]");
  }
  const std::vector<float> sinks(layer.weight("sinks").value().ptr<const float>(),
                                 layer.weight("sinks").value().ptr<const float>() + c.num_heads);
  EXPECT_EQ(sinks, w.sinks);
  // Without sinks configured, a sinks weight is an unexpected name.
  auto plain = AttentionLayer::create(gpt_oss(false, false)).value();
  const attnkit::Status st = plain.load_weights(weight_map(w, c));
  EXPECT_NE(st.message().find("sinks"), std::string::npos) << st.message();
}

TEST(AttentionFamiliesErrors, BadPerLayerFieldsAreRejectedAtCreate) {
  AttentionConfig c = llama4_rope(-1);
  auto r = AttentionLayer::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("chunk_size = -1"), std::string::npos)
      << r.status().message();
  c = llama4_rope(8);
  c.sliding_window = 4;
  r = AttentionLayer::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("chunk_size = 8 and sliding_window = 4"), std::string::npos)
      << r.status().message();
  c = llama4_nope();
  c.floor_scale = 0.0;
  r = AttentionLayer::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("floor_scale"), std::string::npos) << r.status().message();
  c = llama4_nope();
  c.qk_norm = static_cast<QkNorm>(9);
  r = AttentionLayer::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("qk_norm = 9"), std::string::npos) << r.status().message();
}

TEST(AttentionFamiliesErrors, CacheFromALayerOfAnotherKindIsRejected) {
  auto [layer, w] = build(gemma3(false), 5);
  auto local = build(gemma3(true), 6).layer.new_cache(1, 8).value();
  std::vector<float> x(size_t(2 * 32), 0.1f), out(x.size(), -3.0f);
  const attnkit::Status st =
      layer.forward(view3(x.data(), 1, 2, 32), view3(out.data(), 1, 2, 32), {}, &local);
  EXPECT_NE(st.message().find("cache spec.sliding_window = 5"), std::string::npos) << st.message();
  for (float o : out) EXPECT_EQ(o, -3.0f);
  EXPECT_EQ(local.length(), 0);
}

}  // namespace
