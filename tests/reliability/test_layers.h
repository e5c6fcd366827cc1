// Small layers with random weights (AttentionLayer with qk-norm and an
// optional sliding window, DeepSeek-V3-style LatentAttention, Mixtral-style
// MoeLayer), shared by the reliability tests that need loaded layers.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/latent_attention.h"
#include "attnkit/moe.h"
#include "attnkit/weights.h"
#include "common/random.h"

namespace attnkit_reliability {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::DType;
using attnkit::LatentAttention;
using attnkit::MlaConfig;
using attnkit::MoeConfig;
using attnkit::MoeLayer;
using attnkit::Status;
using attnkit::WeightMap;
using attnkit_test::Rng;

// Owns random f32 weights and the WeightMap of views over them.
struct OwnedWeights {
  std::vector<std::vector<float>> storage;
  WeightMap map;

  void add(const std::string& name, std::initializer_list<int64_t> shape, Rng& rng) {
    int64_t n = 1, fan_in = 1;
    for (int64_t d : shape) n *= d;
    fan_in = *(shape.end() - 1);
    const float a = 1.0f / std::sqrt(float(fan_in));
    storage.push_back(attnkit_test::uniform_vector(size_t(n), rng, -a, a));
    // Norm weights near 1, as trained checkpoints have them.
    if (shape.size() == 1)
      for (float& x : storage.back()) x = 1.0f + 0.5f * x;
    map[name] = attnkit::make_view(storage.back().data(), DType::kF32, shape);
  }
};

inline AttentionConfig gqa_config(int64_t sliding_window) {
  AttentionConfig c;
  c.model_type = "qwen3";
  c.hidden_size = 48;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.qk_norm = attnkit::QkNorm::kRms;
  c.rope.head_dim = 16;
  c.sliding_window = sliding_window;
  return c;
}

inline AttentionLayer make_attention_layer(const AttentionConfig& c, OwnedWeights& w,
                                           uint64_t seed) {
  Rng rng(seed);
  const int64_t d = c.hidden_size, qo = c.num_heads * c.head_dim, kvo = c.num_kv_heads * c.head_dim;
  w.add("q_proj.weight", {qo, d}, rng);
  w.add("k_proj.weight", {kvo, d}, rng);
  w.add("v_proj.weight", {kvo, d}, rng);
  w.add("o_proj.weight", {d, qo}, rng);
  w.add("q_norm.weight", {c.head_dim}, rng);
  w.add("k_norm.weight", {c.head_dim}, rng);
  auto layer = AttentionLayer::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  const Status st = layer->load_weights(w.map);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return std::move(layer).value();
}

inline MlaConfig mla_config() {
  MlaConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 40;
  c.num_attention_heads = 4;
  c.q_lora_rank = 24;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 12;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 10;
  return c;
}

inline LatentAttention make_mla_layer(OwnedWeights& w, uint64_t seed) {
  const MlaConfig c = mla_config();
  Rng rng(seed);
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dqk = c.qk_head_dim(), dr = c.qk_rope_head_dim,
                dn = c.qk_nope_head_dim, dv = c.v_head_dim;
  w.add("q_a_proj.weight", {dq, d}, rng);
  w.add("q_a_layernorm.weight", {dq}, rng);
  w.add("q_b_proj.weight", {H * dqk, dq}, rng);
  w.add("kv_a_proj_with_mqa.weight", {dc + dr, d}, rng);
  w.add("kv_a_layernorm.weight", {dc}, rng);
  w.add("kv_b_proj.weight", {H * (dn + dv), dc}, rng);
  w.add("o_proj.weight", {d, H * dv}, rng);
  auto layer = LatentAttention::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  const Status st = layer->load_weights(w.map);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return std::move(layer).value();
}

inline MoeConfig moe_config() {
  MoeConfig c;
  c.model_type = "mixtral";
  c.naming = attnkit::MoeWeightNaming::kMixtral;
  c.hidden_size = 40;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  return c;
}

inline MoeLayer make_moe_layer(OwnedWeights& w, uint64_t seed) {
  const MoeConfig c = moe_config();
  Rng rng(seed);
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  w.add("block_sparse_moe.gate.weight", {E, H}, rng);
  for (int64_t e = 0; e < E; ++e) {
    const std::string p = "block_sparse_moe.experts." + std::to_string(e) + ".";
    w.add(p + "w1.weight", {I, H}, rng);
    w.add(p + "w3.weight", {I, H}, rng);
    w.add(p + "w2.weight", {H, I}, rng);
  }
  auto layer = MoeLayer::create(c);
  EXPECT_TRUE(layer.ok()) << layer.status().to_string();
  const Status st = layer->load_weights(w.map);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return std::move(layer).value();
}

}  // namespace attnkit_reliability
