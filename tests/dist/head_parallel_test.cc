// Head-parallel layers against float64 references of the whole layer
// (written here from the layer equations, with the float64 attention
// oracle) and against the single-process layer: MHA, MQA, GQA with kv
// heads split or replicated, uneven head shares, biases, qk-norm, RoPE,
// sliding windows, softcap; MLA with and without q_lora, both forms; and
// decode after prefill through each rank's cache. Then collective errors:
// a bad argument on one rank fails every rank, and no cache or weight moves.
#include <gtest/gtest.h>
#include <mpi.h>

#include <map>
#include <string>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/dist.h"
#include "attnkit/latent_attention.h"
#include "common/views.h"
#include "dist/dist_testing.h"

namespace {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::DType;
using attnkit::KVCache;
using attnkit::LatentAttention;
using attnkit::LatentCache;
using attnkit::MlaConfig;
using attnkit::MlaForm;
using attnkit::Status;
using attnkit::TensorView;
using attnkit::WeightMap;
using attnkit::dist::HeadParallelAttention;
using attnkit::dist::HeadParallelLatentAttention;
using namespace attnkit_dist_test;

constexpr const char* kPrefix = "model.layers.3.self_attn";

// Owned weights and the WeightMap (full names) viewing them.
struct Weights {
  std::map<std::string, std::vector<float>> data;
  std::map<std::string, std::vector<int64_t>> shape;
  WeightMap map;

  void add(const std::string& name, std::vector<int64_t> s, uint64_t seed, bool gain = false) {
    int64_t n = 1;
    for (int64_t e : s) n *= e;
    // Matrices ~ uniform with variance 1/in, so activations stay O(1);
    // norm gains around 1; biases around 0.
    const float scale = s.size() == 2 ? std::sqrt(3.0f / float(s[1])) : 0.5f;
    std::vector<float> v = uniform(size_t(n), seed, gain ? 0.3f : scale);
    if (gain)
      for (float& e : v) e += 1.0f;
    data[name] = std::move(v);
    shape[name] = s;
  }
  const std::vector<float>& operator[](const std::string& name) const { return data.at(name); }
  bool has(const std::string& name) const { return data.count(name) > 0; }
  WeightMap build(const std::string& prefix) {
    map.clear();
    for (auto& [name, v] : data) {
      const std::vector<int64_t>& s = shape[name];
      attnkit::TensorView view = s.size() == 2
                                     ? attnkit::make_view(v.data(), DType::kF32, {s[0], s[1]})
                                     : attnkit::make_view(v.data(), DType::kF32, {s[0]});
      map[prefix + "." + name] = view;
    }
    return map;
  }
};

// ---- MHA / MQA / GQA ---------------------------------------------------

struct GqaCase {
  const char* name;
  int64_t hidden, heads, kv_heads, head_dim;
  bool qkv_bias, o_bias, qk_norm;
  int64_t window;
  float softcap;
};

// gqa: 2 kv heads, split on 2 ranks and replicated on 3 and 4.
// mha: 6 heads, uneven on 4 ranks (1, 2, 1, 2) and on 4 split 2/1 etc.
// mqa: one kv head everywhere, a sliding window shorter than the sequence.
constexpr GqaCase kGqaCases[] = {
    {"gqa_bias", 32, 8, 2, 8, true, true, false, 0, 0.0f},
    {"mha_qknorm", 24, 6, 6, 4, false, false, true, 0, 0.0f},
    {"mqa_window_softcap", 16, 4, 1, 8, false, true, false, 4, 3.0f},
    {"gqa_uneven", 36, 12, 3, 6, true, false, false, 0, 0.0f},
};

AttentionConfig gqa_config(const GqaCase& g) {
  AttentionConfig c;
  c.model_type = "llama";
  c.hidden_size = g.hidden;
  c.num_heads = g.heads;
  c.num_kv_heads = g.kv_heads;
  c.head_dim = g.head_dim;
  c.qkv_bias = g.qkv_bias;
  c.o_bias = g.o_bias;
  c.qk_norm = g.qk_norm ? attnkit::QkNorm::kRms : attnkit::QkNorm::kNone;
  c.sliding_window = g.window;
  c.softcap = g.softcap;
  c.rope.head_dim = g.head_dim;
  c.rope.theta = 10000.0;
  return c;
}

Weights gqa_weights(const AttentionConfig& c, uint64_t seed) {
  Weights w;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim, d = c.hidden_size;
  w.add("q_proj.weight", {q, d}, seed + 1);
  w.add("k_proj.weight", {kv, d}, seed + 2);
  w.add("v_proj.weight", {kv, d}, seed + 3);
  w.add("o_proj.weight", {d, q}, seed + 4);
  if (c.qkv_bias) {
    w.add("q_proj.bias", {q}, seed + 5);
    w.add("k_proj.bias", {kv}, seed + 6);
    w.add("v_proj.bias", {kv}, seed + 7);
  }
  if (c.o_bias) w.add("o_proj.bias", {d}, seed + 8);
  if (c.qk_norm != attnkit::QkNorm::kNone) {
    w.add("q_norm.weight", {c.head_dim}, seed + 9, true);
    w.add("k_norm.weight", {c.head_dim}, seed + 10, true);
  }
  return w;
}

// The whole causal layer over x [B, T, hidden], positions 0..T-1, in float64.
std::vector<double> gqa_reference(const AttentionConfig& c, const Weights& w,
                                  const std::vector<float>& x, int64_t B, int64_t T) {
  const int64_t H = c.num_heads, K = c.num_kv_heads, D = c.head_dim, d = c.hidden_size;
  const std::vector<double> xd(x.begin(), x.end());
  const auto bias = [&](const char* n) {
    return w.has(n) ? std::span<const float>(w[n]) : std::span<const float>();
  };
  std::vector<double> q = linear(xd, B * T, d, w["q_proj.weight"], H * D, bias("q_proj.bias"));
  std::vector<double> k = linear(xd, B * T, d, w["k_proj.weight"], K * D, bias("k_proj.bias"));
  std::vector<double> v = linear(xd, B * T, d, w["v_proj.weight"], K * D, bias("v_proj.bias"));
  if (c.qk_norm != attnkit::QkNorm::kNone) {
    rms_norm(q, D, w["q_norm.weight"], c.rms_norm_eps, D);
    rms_norm(k, D, w["k_norm.weight"], c.rms_norm_eps, D);
  }
  std::vector<int64_t> pos(size_t(B * T));
  for (int64_t i = 0; i < B * T; ++i) pos[size_t(i)] = i % T;
  rope(q, D, D, 0, H, pos, c.rope.theta, false);
  rope(k, D, D, 0, K, pos, c.rope.theta, false);
  attnkit_test::OracleOptions o;
  o.batch = B;
  o.seqlen_q = o.seqlen_k = T;
  o.num_heads = H;
  o.num_kv_heads = K;
  o.head_dim = o.head_dim_v = D;
  o.causal = true;
  o.window_left = c.sliding_window > 0 ? c.sliding_window - 1 : -1;
  o.softcap = c.softcap;
  const attnkit_test::OracleResult att = attnkit_test::attention_f64(o, q, k, v);
  return linear(att.out, B * T, H * D, w["o_proj.weight"], d, bias("o_proj.bias"));
}

// The layer's output over x [B, T, d] computed in steps through a cache: a
// prefill of `prefill` tokens, then one token at a time. forward(x_step,
// out_step) runs one step; the outputs come back reassembled as [B, T, d].
template <typename Forward>
std::vector<float> in_steps(const std::vector<float>& x, int64_t B, int64_t T, int64_t d,
                            int64_t prefill, Forward forward) {
  std::vector<float> all(x.size());
  for (int64_t t0 = 0, t1 = prefill; t0 < T; t0 = t1, t1 = t0 + 1) {
    const std::vector<float> xs = take(x, B, T, d, token_range(t0, t1));
    std::vector<float> o(xs.size());
    const Status st = forward(attnkit::make_view(xs.data(), DType::kF32, {B, t1 - t0, d}),
                              attnkit::make_view(o.data(), DType::kF32, {B, t1 - t0, d}));
    EXPECT_TRUE(st.ok()) << st.to_string();
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(o.begin() + b * (t1 - t0) * d, (t1 - t0) * d, all.begin() + (b * T + t0) * d);
  }
  return all;
}

TEST(HeadParallel, GqaShapesMatchTheReferenceWithAndWithoutCache) {
  for (const GqaCase& g : kGqaCases) {
    SCOPED_TRACE(g.name);
    const AttentionConfig c = gqa_config(g);
    Weights w = gqa_weights(c, 100);
    const WeightMap map = w.build(kPrefix);
    auto dist = HeadParallelAttention::create(MPI_COMM_WORLD, c);
    ASSERT_TRUE(dist.ok()) << dist.status().to_string();
    ASSERT_TRUE(dist->load_weights(map, kPrefix).ok());
    auto single = AttentionLayer::create(c);
    ASSERT_TRUE(single.ok());
    ASSERT_TRUE(single->load_weights(map, kPrefix).ok());
    EXPECT_EQ(dist->local_config().num_heads, dist->share().num_heads());

    const int64_t B = 2, T = 7, d = c.hidden_size, n = std::max(d, c.num_heads * c.head_dim);
    const std::vector<float> x = uniform(size_t(B * T * d), 7);
    const std::vector<double> ref = gqa_reference(c, w, x, B, T);
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {B, T, d});

    // Whole sequence, no cache.
    std::vector<float> got(x.size()), want(x.size());
    ASSERT_TRUE(dist->forward(xv, attnkit::make_view(got.data(), DType::kF32, {B, T, d})).ok());
    ASSERT_TRUE(single->forward(xv, attnkit::make_view(want.data(), DType::kF32, {B, T, d})).ok());
    EXPECT_TRUE(within_twice_single("no cache", got, want, ref, n));
    EXPECT_TRUE(same_on_every_rank(got));

    // Prefill 4 tokens, then decode 3 one at a time, through the caches.
    auto cache = dist->new_cache(B, T);
    auto single_cache = single->new_cache(B, T);
    ASSERT_TRUE(cache.ok() && single_cache.ok());
    EXPECT_EQ(cache->spec().num_kv_heads, dist->share().num_kv_heads());
    const std::vector<float> got_c = in_steps(
        x, B, T, d, 4, [&](auto xs, auto os) { return dist->forward(xs, os, {}, &*cache); });
    const std::vector<float> want_c = in_steps(x, B, T, d, 4, [&](auto xs, auto os) {
      return single->forward(xs, os, {}, &*single_cache);
    });
    EXPECT_EQ(cache->length(), T);
    EXPECT_TRUE(within_twice_single("prefill + decode", got_c, want_c, ref, n));
  }
}

// The per-layer features of gpt-oss, Gemma 3, Llama 4 and Qwen3-Next: the
// shards must compute what the single layer computes (itself held to a
// float64 reference in tests/layers/attention_families_test.cc). Sinks and
// the gate rows are cut per head; norms, NoPE temperature and chunks are
// per token.
TEST(HeadParallel, PerLayerFeaturesMatchTheSingleLayer) {
  struct Kind {
    const char* name;
    void (*set)(AttentionConfig&);
  };
  const Kind kinds[] = {
      {"gpt_oss sinks, yarn, window",
       [](AttentionConfig& c) {
         c.sinks = true;
         c.rope.scaling.type = attnkit::RopeScaling::Type::kYarn;
         c.rope.scaling.factor = 32.0;
         c.rope.scaling.original_max_position_embeddings = 4096;
         c.rope.scaling.truncate = false;
         c.sliding_window = 3;
       }},
      {"qwen3_next gate, 1 + w norms, partial rope",
       [](AttentionConfig& c) {
         c.output_gate = true;
         c.qk_norm = attnkit::QkNorm::kRmsOnePlus;
         c.rope.rotary_dim = 4;
       }},
      {"llama4 nope, temperature",
       [](AttentionConfig& c) {
         c.use_rope = false;
         c.temperature_tuning = true;
         c.floor_scale = 2.0;
       }},
      {"llama4 rope, l2 norm, chunk",
       [](AttentionConfig& c) {
         c.rope.pairing = attnkit::RopePairing::kInterleaved;
         c.qk_norm = attnkit::QkNorm::kL2;
         c.chunk_size = 3;
       }},
  };
  for (const Kind& k : kinds) {
    SCOPED_TRACE(k.name);
    AttentionConfig c = gqa_config(kGqaCases[0]);  // 8 heads, 2 kv heads, biases
    k.set(c);
    Weights w;
    const int64_t g = c.output_gate ? 2 : 1, q = c.num_heads * c.head_dim,
                  kv = c.num_kv_heads * c.head_dim, d = c.hidden_size;
    w.add("q_proj.weight", {g * q, d}, 1);
    w.add("k_proj.weight", {kv, d}, 2);
    w.add("v_proj.weight", {kv, d}, 3);
    w.add("o_proj.weight", {d, q}, 4);
    w.add("q_proj.bias", {g * q}, 5);
    w.add("k_proj.bias", {kv}, 6);
    w.add("v_proj.bias", {kv}, 7);
    w.add("o_proj.bias", {d}, 8);
    if (c.qk_norm == attnkit::QkNorm::kRmsOnePlus) {
      w.add("q_norm.weight", {c.head_dim}, 9);
      w.add("k_norm.weight", {c.head_dim}, 10);
    }
    if (c.sinks) w.add("sinks", {c.num_heads}, 11);
    const WeightMap map = w.build(kPrefix);
    auto dist = HeadParallelAttention::create(MPI_COMM_WORLD, c);
    ASSERT_TRUE(dist.ok()) << dist.status().to_string();
    const Status loaded = dist->load_weights(map, kPrefix);
    ASSERT_TRUE(loaded.ok()) << loaded.to_string();
    auto single = AttentionLayer::create(c);
    ASSERT_TRUE(single.ok());
    ASSERT_TRUE(single->load_weights(map, kPrefix).ok());

    const int64_t B = 2, T = 7;
    const std::vector<float> x = uniform(size_t(B * T * d), 7);
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {B, T, d});
    std::vector<float> got(x.size()), want(x.size());
    ASSERT_TRUE(dist->forward(xv, attnkit::make_view(got.data(), DType::kF32, {B, T, d})).ok());
    ASSERT_TRUE(single->forward(xv, attnkit::make_view(want.data(), DType::kF32, {B, T, d})).ok());
    auto cache = dist->new_cache(B, T);
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    EXPECT_EQ(cache->spec().chunk_size, c.chunk_size);
    const std::vector<float> got_c = in_steps(
        x, B, T, d, 4, [&](auto xs, auto os) { return dist->forward(xs, os, {}, &*cache); });
    // The shards' o_proj partial sums are added in another order than the
    // single layer's one GEMM: f32 rounding of a 64-term sum of O(1) terms.
    double mag = 0.0;
    for (float v : want) mag = std::max(mag, double(std::fabs(v)));
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5 * mag) << "element " << i;
      ASSERT_NEAR(got_c[i], want[i], 1e-5 * mag) << "element " << i << " (through the cache)";
    }
    EXPECT_TRUE(same_on_every_rank(got));
  }
}

// ---- MLA -----------------------------------------------------------------

MlaConfig mla_config(int64_t q_lora) {
  MlaConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 32;
  c.num_attention_heads = 6;  // uneven on 4 ranks
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 8;
  return c;
}

Weights mla_weights(const MlaConfig& c, uint64_t seed) {
  Weights w;
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dqk = c.qk_head_dim();
  if (c.q_lora_rank > 0) {
    w.add("q_a_proj.weight", {c.q_lora_rank, d}, seed + 1);
    w.add("q_a_layernorm.weight", {c.q_lora_rank}, seed + 2, true);
    w.add("q_b_proj.weight", {H * dqk, c.q_lora_rank}, seed + 3);
  } else {
    w.add("q_proj.weight", {H * dqk, d}, seed + 1);
  }
  w.add("kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, d}, seed + 4);
  w.add("kv_a_layernorm.weight", {c.kv_lora_rank}, seed + 5, true);
  w.add("kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, seed + 6);
  w.add("o_proj.weight", {d, H * c.v_head_dim}, seed + 7);
  return w;
}

// DeepSeek's MLA over x [B, T, hidden], positions 0..T-1, float64, naive form.
std::vector<double> mla_reference(const MlaConfig& c, const Weights& w, const std::vector<float>& x,
                                  int64_t B, int64_t T) {
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dc = c.kv_lora_rank,
                dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim,
                dqk = c.qk_head_dim(), rows_n = B * T;
  const std::vector<double> xd(x.begin(), x.end());
  std::vector<double> q;
  if (c.q_lora_rank > 0) {
    std::vector<double> cq = linear(xd, rows_n, d, w["q_a_proj.weight"], c.q_lora_rank);
    rms_norm(cq, c.q_lora_rank, w["q_a_layernorm.weight"], c.rms_norm_eps, c.q_lora_rank);
    q = linear(cq, rows_n, c.q_lora_rank, w["q_b_proj.weight"], H * dqk);
  } else {
    q = linear(xd, rows_n, d, w["q_proj.weight"], H * dqk);
  }
  std::vector<double> kv = linear(xd, rows_n, d, w["kv_a_proj_with_mqa.weight"], dc + dr);
  rms_norm(kv, dc, w["kv_a_layernorm.weight"], c.rms_norm_eps, dc + dr);
  std::vector<int64_t> pos(static_cast<size_t>(rows_n));
  for (int64_t i = 0; i < rows_n; ++i) pos[size_t(i)] = i % T;
  rope(q, dr, dqk, dn, H, pos, c.rope_theta, true);
  rope(kv, dr, dc + dr, dc, 1, pos, c.rope_theta, true);
  // Per head: k = [W_UK_h c ; k_rope], v = W_UV_h c.
  const std::vector<float>& kvb = w["kv_b_proj.weight"];
  std::vector<double> k(size_t(rows_n * H * dqk)), v(size_t(rows_n * H * dv));
  for (int64_t r = 0; r < rows_n; ++r)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < dn + dv; ++i) {
        double s = 0.0;
        for (int64_t j = 0; j < dc; ++j)
          s += double(kvb[size_t((h * (dn + dv) + i) * dc + j)]) * kv[size_t(r * (dc + dr) + j)];
        if (i < dn)
          k[size_t((r * H + h) * dqk + i)] = s;
        else
          v[size_t((r * H + h) * dv + i - dn)] = s;
      }
      for (int64_t i = 0; i < dr; ++i)
        k[size_t((r * H + h) * dqk + dn + i)] = kv[size_t(r * (dc + dr) + dc + i)];
    }
  attnkit_test::OracleOptions o;
  o.batch = B;
  o.seqlen_q = o.seqlen_k = T;
  o.num_heads = o.num_kv_heads = H;
  o.head_dim = dqk;
  o.head_dim_v = dv;
  o.causal = true;
  const attnkit_test::OracleResult att = attnkit_test::attention_f64(o, q, k, v);
  return linear(att.out, rows_n, H * dv, w["o_proj.weight"], d);
}

TEST(HeadParallel, MlaMatchesTheReferenceInBothFormsAndThroughTheLatentCache) {
  for (int64_t q_lora : {0, 12}) {
    SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora));
    const MlaConfig c = mla_config(q_lora);
    Weights w = mla_weights(c, 300 + uint64_t(q_lora));
    const WeightMap map = w.build(kPrefix);
    auto dist = HeadParallelLatentAttention::create(MPI_COMM_WORLD, c);
    ASSERT_TRUE(dist.ok()) << dist.status().to_string();
    ASSERT_TRUE(dist->load_weights(map, kPrefix).ok());
    auto single = LatentAttention::create(c);
    ASSERT_TRUE(single.ok());
    ASSERT_TRUE(single->load_weights(map, kPrefix).ok());

    const int64_t B = 2, T = 6, d = c.hidden_size;
    const int64_t n = std::max({d, c.kv_lora_rank, c.num_attention_heads * c.v_head_dim});
    const std::vector<float> x = uniform(size_t(B * T * d), 11);
    const std::vector<double> ref = mla_reference(c, w, x, B, T);
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {B, T, d});
    for (MlaForm form : {MlaForm::kNaive, MlaForm::kAbsorbed}) {
      std::vector<float> got(x.size()), want(x.size());
      ASSERT_TRUE(dist->forward(xv, attnkit::make_view(got.data(), DType::kF32, {B, T, d}), {},
                                nullptr, {}, form)
                      .ok());
      ASSERT_TRUE(single
                      ->forward(xv, attnkit::make_view(want.data(), DType::kF32, {B, T, d}), {},
                                nullptr, {}, form)
                      .ok());
      EXPECT_TRUE(within_twice_single(attnkit::mla_form_name(form), got, want, ref, n));
      EXPECT_TRUE(same_on_every_rank(got));
    }
    // Prefill 3 (naive under kAuto), then decode 3 (absorbed), through the
    // replicated latent caches; every rank's cache holds the same rows.
    auto cache = dist->new_cache(B, T);
    auto single_cache = single->new_cache(B, T);
    ASSERT_TRUE(cache.ok() && single_cache.ok());
    const std::vector<float> got_c = in_steps(
        x, B, T, d, 3, [&](auto xs, auto os) { return dist->forward(xs, os, {}, &*cache); });
    const std::vector<float> want_c = in_steps(x, B, T, d, 3, [&](auto xs, auto os) {
      return single->forward(xs, os, {}, &*single_cache);
    });
    EXPECT_TRUE(within_twice_single("prefill + decode", got_c, want_c, ref, n));
    const TensorView st = cache->storage();
    std::vector<float> latent(st.ptr<float>(), st.ptr<float>() + st.numel());
    EXPECT_TRUE(same_on_every_rank(latent));
  }
}

// ---- collective errors -----------------------------------------------------

bool contains(const Status& st, const std::string& words) {
  return st.message().find(words) != std::string::npos;
}

TEST(HeadParallelErrors, BadArgumentOnOneRankFailsEveryRankAndNoCacheMoves) {
  const GqaCase g = kGqaCases[0];
  const AttentionConfig c = gqa_config(g);
  Weights w = gqa_weights(c, 500);
  const WeightMap map = w.build(kPrefix);
  auto layer = HeadParallelAttention::create(MPI_COMM_WORLD, c);
  ASSERT_TRUE(layer.ok());
  ASSERT_TRUE(layer->load_weights(map, kPrefix).ok());
  const int rank = world_rank(), last = world_size() - 1;
  const int64_t B = 1, d = c.hidden_size;
  auto cache = layer->new_cache(B, 8);
  ASSERT_TRUE(cache.ok());
  std::vector<float> x = uniform(size_t(3 * d), 9), out(size_t(3 * d), 0.0f);
  ASSERT_TRUE(layer
                  ->forward(attnkit::make_view(x.data(), DType::kF32, {B, 3, d}),
                            attnkit::make_view(out.data(), DType::kF32, {B, 3, d}), {}, &*cache)
                  .ok());
  const std::vector<unsigned char> keys = attnkit_test::span_bytes(cache->keys());
  const std::vector<unsigned char> values = attnkit_test::span_bytes(cache->values());
  const std::vector<float> before = out;
  const auto unchanged = [&] {
    EXPECT_EQ(cache->length(), 3);
    EXPECT_EQ(attnkit_test::span_bytes(cache->keys()), keys);
    EXPECT_EQ(attnkit_test::span_bytes(cache->values()), values);
    EXPECT_EQ(out, before);
  };

  // The last rank passes x with the wrong hidden size.
  std::vector<float> wide(size_t(2 * (d + 1)), 0.5f);
  const TensorView bad_x = rank == last
                               ? attnkit::make_view(wide.data(), DType::kF32, {B, 2, d + 1})
                               : attnkit::make_view(x.data(), DType::kF32, {B, 2, d});
  Status st =
      layer->forward(bad_x, attnkit::make_view(out.data(), DType::kF32, {B, 2, d}), {}, &*cache);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(contains(
      st, "HeadParallelAttention::forward: x.shape[2] (hidden_size) = " + std::to_string(d + 1)))
      << st.message();
  EXPECT_TRUE(contains(st, "(on rank " + std::to_string(last) + " of")) << st.message();
  unchanged();

  // Sequence lengths that differ between ranks.
  if (world_size() > 1) {
    const int64_t T = rank == 0 ? 1 : 2;
    st = layer->forward(attnkit::make_view(x.data(), DType::kF32, {B, T, d}),
                        attnkit::make_view(out.data(), DType::kF32, {B, T, d}), {}, &*cache);
    EXPECT_EQ(st.message(),
              "HeadParallelAttention::forward: x.shape[1] (seq) = 1 on rank 0 but 2 on rank 1; "
              "every rank must pass the same");
    unchanged();
  }

  // One rank's cache has no room for the call.
  auto small = layer->new_cache(B, rank == last ? 4 : 8);
  ASSERT_TRUE(small.ok());
  std::vector<float> scratch(out.size());
  ASSERT_TRUE(layer
                  ->forward(attnkit::make_view(x.data(), DType::kF32, {B, 3, d}),
                            attnkit::make_view(scratch.data(), DType::kF32, {B, 3, d}), {}, &*small)
                  .ok());
  const std::vector<unsigned char> small_keys = attnkit_test::span_bytes(small->keys());
  st = layer->forward(attnkit::make_view(x.data(), DType::kF32, {B, 2, d}),
                      attnkit::make_view(out.data(), DType::kF32, {B, 2, d}), {}, &*small);
  EXPECT_EQ(st.code(), attnkit::StatusCode::kOutOfRange);
  EXPECT_TRUE(contains(
      st, "cache length 3 + 2 new tokens exceeds max_seq_len = 4 (on rank " + std::to_string(last)))
      << st.message();
  EXPECT_EQ(small->length(), 3);
  EXPECT_EQ(attnkit_test::span_bytes(small->keys()), small_keys);
  unchanged();

  // Weights missing on one rank: no rank's weights change.
  WeightMap partial = map;
  if (rank == last) partial.erase(std::string(kPrefix) + ".k_proj.weight");
  Weights other = gqa_weights(c, 501);
  WeightMap other_map = other.build(kPrefix);
  if (rank == last) other_map = partial;
  st = layer->load_weights(other_map, kPrefix);
  EXPECT_EQ(st.code(), attnkit::StatusCode::kNotFound);
  EXPECT_TRUE(contains(st, "k_proj.weight")) << st.message();
  std::vector<float> again(x.size());
  auto fresh = layer->new_cache(B, 8);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(layer
                  ->forward(attnkit::make_view(x.data(), DType::kF32, {B, 3, d}),
                            attnkit::make_view(again.data(), DType::kF32, {B, 3, d}), {}, &*fresh)
                  .ok());
  EXPECT_EQ(again, before);  // the old weights, bit for bit
}

TEST(HeadParallelErrors, CreateFailsEverywhereWhenARankWouldOwnNoHead) {
  AttentionConfig c = gqa_config(kGqaCases[2]);
  c.num_heads = c.num_kv_heads = 1;
  auto layer = HeadParallelAttention::create(MPI_COMM_WORLD, c);
  if (world_size() == 1) {
    EXPECT_TRUE(layer.ok());
    return;
  }
  ASSERT_FALSE(layer.ok());
  EXPECT_TRUE(
      contains(layer.status(), "num_heads = 1 must be >= ranks = " + std::to_string(world_size())))
      << layer.status().message();
  // A config that differs between ranks.
  AttentionConfig d = gqa_config(kGqaCases[0]);
  if (world_rank() == 1) d.rope.theta = 500000.0;
  auto mixed = HeadParallelAttention::create(MPI_COMM_WORLD, d);
  ASSERT_FALSE(mixed.ok());
  EXPECT_TRUE(contains(mixed.status(), "the config's other fields")) << mixed.status().message();
  // A config.json that one rank cannot parse.
  const std::string json = world_rank() == 1 ? "{\"hidden_size\": 32" : R"({
    "model_type": "llama", "hidden_size": 32, "num_attention_heads": 8,
    "num_key_value_heads": 2})";
  auto parsed = HeadParallelAttention::from_config_json(MPI_COMM_WORLD, json);
  ASSERT_FALSE(parsed.ok());
  EXPECT_TRUE(contains(parsed.status(), "(on rank 1 of")) << parsed.status().message();
}

TEST(HeadParallelErrors, MlaBadFormOnOneRankFailsEveryRank) {
  const MlaConfig c = mla_config(0);
  Weights w = mla_weights(c, 700);
  auto layer = HeadParallelLatentAttention::create(MPI_COMM_WORLD, c);
  ASSERT_TRUE(layer.ok());
  ASSERT_TRUE(layer->load_weights(w.build(kPrefix), kPrefix).ok());
  auto cache = layer->new_cache(1, 4);
  ASSERT_TRUE(cache.ok());
  const int64_t d = c.hidden_size;
  std::vector<float> x = uniform(size_t(2 * d), 3), out(size_t(2 * d), 0.0f);
  const MlaForm form = world_rank() == world_size() - 1 ? static_cast<MlaForm>(7) : MlaForm::kAuto;
  const Status st =
      layer->forward(attnkit::make_view(x.data(), DType::kF32, {1, 2, d}),
                     attnkit::make_view(out.data(), DType::kF32, {1, 2, d}), {}, &*cache, {}, form);
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(contains(st, "form = 7 is not an MlaForm value")) << st.message();
  EXPECT_EQ(cache->length(), 0);
  EXPECT_EQ(out, std::vector<float>(out.size(), 0.0f));
}

}  // namespace
