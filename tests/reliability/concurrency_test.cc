// Concurrency and determinism through the public API.
//
// Concurrency: an inference server calls one loaded layer from many
// threads, each request with its own cache. Several threads run whole
// sessions (prefill, then decode steps) at once on shared AttentionLayer
// (plain and sliding-window), LatentAttention and MoeLayer objects, each
// with its own cache and thread count, and every output must be the same
// bits as the same session run alone. ThreadSanitizer runs these in CI
// (scripts/sanitize.sh), which is what turns "no data race" into a check.
//
// Determinism: the kernels' task lists and reduction orders depend on the
// shapes only (src/core/threads.h, src/kernels/cpu/tile_policy.h), so the
// same call gives the same bits for 1, 2, 3 or 7 threads and on every run:
// checked for decode (sdpa, KVCache with and without a window, layers) and
// for prefill-shaped sdpa calls.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/kv_cache.h"
#include "attnkit/latent_attention.h"
#include "attnkit/moe.h"
#include "common/random.h"
#include "reliability/test_layers.h"

namespace {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::AttentionOptions;
using attnkit::DType;
using attnkit::KVCache;
using attnkit::LatentAttention;
using attnkit::LatentCache;
using attnkit::MlaConfig;
using attnkit::MoeConfig;
using attnkit::MoeLayer;
using attnkit::RunOptions;
using attnkit::Status;
using attnkit::TensorView;
using attnkit::WeightMap;
using attnkit_reliability::gqa_config;
using attnkit_reliability::make_attention_layer;
using attnkit_reliability::make_mla_layer;
using attnkit_reliability::make_moe_layer;
using attnkit_reliability::mla_config;
using attnkit_reliability::moe_config;
using attnkit_reliability::OwnedWeights;
using attnkit_test::Rng;

constexpr int kThreadCounts[] = {1, 2, 3, 7};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- one session: prefill, then decode steps, every output recorded -------

constexpr int64_t kPrefill = 9, kDecodeSteps = 6, kTokens = kPrefill + kDecodeSteps;

struct Layers {
  OwnedWeights gqa_w, ring_w, mla_w, moe_w;
  AttentionLayer gqa = make_attention_layer(gqa_config(0), gqa_w, 1);
  AttentionLayer ring = make_attention_layer(gqa_config(4), ring_w, 2);
  LatentAttention mla = make_mla_layer(mla_w, 3);
  MoeLayer moe = make_moe_layer(moe_w, 4);
};

// Session `s`: its own input x [2, kTokens, hidden] per layer and its own
// caches. Returns every output of every call, concatenated.
std::vector<float> run_session(Layers& layers, int s, int num_threads) {
  Rng rng(1000 + uint64_t(s));
  const int64_t B = 2;
  RunOptions run;
  run.num_threads = num_threads;
  std::vector<float> all;
  auto record = [&](const std::vector<float>& out) {
    all.insert(all.end(), out.begin(), out.end());
  };

  // Prefill kPrefill tokens, then one token per step, through a cache.
  auto steps = [&](int64_t hidden, auto&& forward) {
    const std::vector<float> x = attnkit_test::normal_vector(size_t(B * kTokens * hidden), rng);
    for (int64_t t0 = 0; t0 < kTokens;) {
      const int64_t T = t0 == 0 ? kPrefill : 1;
      // Tokens [t0, t0 + T) of every batch item, contiguous (MLA requires it).
      std::vector<float> chunk;
      for (int64_t b = 0; b < B; ++b)
        chunk.insert(chunk.end(), x.begin() + (b * kTokens + t0) * hidden,
                     x.begin() + (b * kTokens + t0 + T) * hidden);
      std::vector<float> out(size_t(B * T * hidden), -1.0f);
      const Status st = forward(attnkit::make_view(chunk.data(), DType::kF32, {B, T, hidden}),
                                attnkit::make_view(out.data(), DType::kF32, {B, T, hidden}));
      EXPECT_TRUE(st.ok()) << st.to_string();
      record(out);
      t0 += T;
    }
  };

  for (AttentionLayer* layer : {&layers.gqa, &layers.ring}) {
    auto cache = layer->new_cache(B, kTokens);
    EXPECT_TRUE(cache.ok()) << cache.status().to_string();
    steps(layer->config().hidden_size, [&](const TensorView& x, const TensorView& out) {
      return layer->forward(x, out, {}, &*cache, run);
    });
  }
  auto latent = layers.mla.new_cache(B, kTokens);
  EXPECT_TRUE(latent.ok()) << latent.status().to_string();
  steps(layers.mla.config().hidden_size, [&](const TensorView& x, const TensorView& out) {
    return layers.mla.forward(x, out, {}, &*latent, run);
  });
  steps(layers.moe.config().hidden_size, [&](const TensorView& x, const TensorView& out) {
    return layers.moe.forward(x, out, nullptr, run);
  });
  return all;
}

TEST(ReliabilityConcurrency, LayersCalledFromManyThreadsMatchSerialRuns) {
  Layers layers;
  constexpr int kSessions = 4;
  std::vector<std::vector<float>> serial(kSessions);
  for (int s = 0; s < kSessions; ++s) serial[size_t(s)] = run_session(layers, s, 1);
  for (int s = 1; s < kSessions; ++s)
    ASSERT_FALSE(same_bits(serial[0], serial[size_t(s)])) << "sessions must differ";

  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> got(kSessions);
    std::vector<std::thread> threads;
    for (int s = 0; s < kSessions; ++s)
      threads.emplace_back([&, s] {
        // Mixed thread counts: 0 (default), 1, 2, 3 — the shared pool is
        // contended and some calls run inline.
        got[size_t(s)] = run_session(layers, s, (s + round) % 4);
      });
    for (std::thread& t : threads) t.join();
    for (int s = 0; s < kSessions; ++s)
      EXPECT_TRUE(same_bits(got[size_t(s)], serial[size_t(s)]))
          << "session " << s << " round " << round;
  }
}

// Several threads calling sdpa on shared read-only inputs (decode and
// prefill shapes, fast and reference) with their own outputs.
TEST(ReliabilityConcurrency, SdpaFromManyThreadsOnSharedInputs) {
  Rng rng(7);
  const int64_t B = 2, Sk = 1100, H = 8, Hkv = 2, D = 32;
  const auto q = attnkit_test::normal_vector(size_t(B * 64 * H * D), rng);
  const auto k = attnkit_test::normal_vector(size_t(B * Sk * Hkv * D), rng);
  const auto v = attnkit_test::normal_vector(size_t(B * Sk * Hkv * D), rng);
  auto call = [&](int64_t Sq, attnkit::Backend backend, int threads) {
    std::vector<float> out(size_t(B * Sq * H * D));
    AttentionOptions o;
    o.causal = true;
    o.backend = backend;
    o.num_threads = threads;
    const Status st = attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {B, Sq, H, D}),
                                    attnkit::make_view(k.data(), DType::kF32, {B, Sk, Hkv, D}),
                                    attnkit::make_view(v.data(), DType::kF32, {B, Sk, Hkv, D}),
                                    attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, D}), o);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  };
  const int64_t shapes[] = {1, 64};
  const attnkit::Backend backends[] = {attnkit::Backend::kFast, attnkit::Backend::kReference};
  std::vector<std::vector<float>> expected;
  for (int64_t sq : shapes)
    for (attnkit::Backend be : backends) expected.push_back(call(sq, be, 1));
  std::vector<std::thread> threads;
  std::vector<int> ok(8, 0);
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      const size_t which = size_t(t % 4);
      const auto out = call(shapes[which / 2], backends[which % 2], 1 + t % 3);
      ok[size_t(t)] = same_bits(out, expected[which]);
    });
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 8; ++t) EXPECT_TRUE(ok[size_t(t)]) << "thread " << t;
}

// ---- determinism across thread counts and runs ----------------------------

std::vector<float> sdpa_once(int64_t Sq, DType kv, int threads) {
  Rng rng(11);
  const int64_t B = 2, Sk = 2500, H = 8, Hkv = 2, D = 64;
  const auto q = attnkit_test::normal_vector(size_t(B * Sq * H * D), rng);
  const auto kf = attnkit_test::normal_vector(size_t(B * Sk * Hkv * D), rng);
  const auto vf = attnkit_test::normal_vector(size_t(B * Sk * Hkv * D), rng);
  std::vector<attnkit::bf16> kb, vb;
  for (float x : kf) kb.push_back(attnkit::float_to_bf16(x));
  for (float x : vf) vb.push_back(attnkit::float_to_bf16(x));
  const void* kp = kv == DType::kBF16 ? static_cast<const void*>(kb.data()) : kf.data();
  const void* vp = kv == DType::kBF16 ? static_cast<const void*>(vb.data()) : vf.data();
  std::vector<float> out(size_t(B * Sq * H * D)), lse(size_t(B * H * Sq));
  const std::vector<int32_t> lens = {2500, 1777};  // caches of different lengths
  AttentionOptions o;
  o.causal = true;
  o.seqlens_k = lens;
  o.num_threads = threads;
  const Status st = attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {B, Sq, H, D}),
                                  attnkit::make_view(kp, kv, {B, Sk, Hkv, D}),
                                  attnkit::make_view(vp, kv, {B, Sk, Hkv, D}),
                                  attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, D}), o,
                                  attnkit::make_view(lse.data(), DType::kF32, {B, H, Sq}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  out.insert(out.end(), lse.begin(), lse.end());
  return out;
}

// Decode (1 and 4 queries: keys split) and prefill (300 queries: tiles
// only): the same bits for every thread count, on every run.
TEST(ReliabilityDeterminism, SdpaIsBitIdenticalAcrossThreadCountsAndRuns) {
  for (DType kv : {DType::kF32, DType::kBF16})
    for (int64_t sq : {1, 4, 300}) {
      SCOPED_TRACE(std::string(attnkit::dtype_name(kv)) + " seqlen_q=" + std::to_string(sq));
      const std::vector<float> first = sdpa_once(sq, kv, 1);
      for (int repeat = 0; repeat < 2; ++repeat)
        for (int threads : kThreadCounts)
          EXPECT_TRUE(same_bits(sdpa_once(sq, kv, threads), first)) << threads << " threads";
    }
}

// KVCache decode, with and without a sliding window, f32 and bf16
// storage: one cache per thread count fed the same tokens (a 300-token
// prefill, then 1-token steps) gives the same bits at every step.
TEST(ReliabilityDeterminism, KVCacheDecodeIsBitIdenticalAcrossThreadCounts) {
  for (int64_t window : {0, 200})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE("window=" + std::to_string(window) + " " + attnkit::dtype_name(dtype));
      const int64_t B = 2, H = 8, Hkv = 2, D = 32, steps = 8, prefill = 300;
      std::vector<KVCache> caches;
      for (size_t c = 0; c < std::size(kThreadCounts) + 1; ++c) {
        auto r = KVCache::create({B, prefill + steps, Hkv, D, 0, dtype, window});
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        caches.push_back(std::move(r).value());
      }
      Rng rng(21);
      for (int64_t s = 0; s <= steps; ++s) {
        const int64_t T = s == 0 ? prefill : 1;
        const auto q = attnkit_test::normal_vector(size_t(B * T * H * D), rng);
        const auto k = attnkit_test::normal_vector(size_t(B * T * Hkv * D), rng);
        const auto v = attnkit_test::normal_vector(size_t(B * T * Hkv * D), rng);
        std::vector<float> first;
        for (size_t c = 0; c < caches.size(); ++c) {
          // The last cache repeats 1 thread: run-to-run.
          const int threads = c < std::size(kThreadCounts) ? kThreadCounts[c] : 1;
          std::vector<float> out(size_t(B * T * H * D));
          AttentionOptions o;
          o.num_threads = threads;
          const Status st =
              caches[c].attend(attnkit::make_view(q.data(), DType::kF32, {B, T, H, D}),
                               attnkit::make_view(k.data(), DType::kF32, {B, T, Hkv, D}),
                               attnkit::make_view(v.data(), DType::kF32, {B, T, Hkv, D}),
                               attnkit::make_view(out.data(), DType::kF32, {B, T, H, D}), o);
          ASSERT_TRUE(st.ok()) << st.to_string();
          if (c == 0)
            first = out;
          else
            EXPECT_TRUE(same_bits(out, first)) << "step " << s << ", " << threads << " threads";
        }
      }
    }
}

// Whole layers (projections, norms, RoPE, attention, MoE routing and
// experts): a session gives the same bits for every thread count.
TEST(ReliabilityDeterminism, LayerSessionsAreBitIdenticalAcrossThreadCounts) {
  Layers layers;
  const std::vector<float> first = run_session(layers, 0, 1);
  for (int repeat = 0; repeat < 2; ++repeat)
    for (int threads : kThreadCounts)
      EXPECT_TRUE(same_bits(run_session(layers, 0, threads), first)) << threads << " threads";
}

}  // namespace
