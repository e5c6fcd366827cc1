// attnkit::Model on tiny random checkpoints written here: forward_step over
// the paged pool (prefill chunks, then decode) gives the logits forward()
// gives for the same positions; a one-layer model whose mixer and MLP
// outputs are zero reduces to lm_head(norm(embed)), checked against a
// float64 loop; sharded and single-file checkpoints load the same model;
// bad checkpoints and bad steps are errors naming what is wrong and change
// nothing. tests/python/test_model.py holds every family against a float64
// decoder written from Hugging Face's modeling files.
#include "attnkit/model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attnkit/weights.h"
#include "common/random.h"

namespace attnkit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using attnkit_test::Rng;

constexpr int64_t kVocab = 97, kHidden = 64, kInter = 96, kHeads = 4, kKvHeads = 2, kHeadDim = 16;

struct Checkpoint {
  json config;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, std::vector<float>> values;
};

// The MLA and feed-forward weights of a DeepSeek-V3 layer with the sizes
// tiny() configures; `sparse`: DeepSeek-V3.2's lightning indexer too (2
// heads of 128).
void add_deepseek_layer(Checkpoint* c, const std::string& p, bool moe, bool sparse) {
  const std::string a = p + "self_attn.";
  if (sparse) {
    c->shapes[a + "indexer.wq_b.weight"] = {2 * 128, 24};
    c->shapes[a + "indexer.wk.weight"] = {128, kHidden};
    c->shapes[a + "indexer.k_norm.weight"] = {128};
    c->shapes[a + "indexer.k_norm.bias"] = {128};
    c->shapes[a + "indexer.weights_proj.weight"] = {2, kHidden};
  }
  c->shapes[a + "q_a_proj.weight"] = {24, kHidden};
  c->shapes[a + "q_a_layernorm.weight"] = {24};
  c->shapes[a + "q_b_proj.weight"] = {kHeads * 24, 24};
  c->shapes[a + "kv_a_proj_with_mqa.weight"] = {32 + 8, kHidden};
  c->shapes[a + "kv_a_layernorm.weight"] = {32};
  c->shapes[a + "kv_b_proj.weight"] = {kHeads * (16 + 12), 32};
  c->shapes[a + "o_proj.weight"] = {kHidden, kHeads * 12};
  const std::string m = p + "mlp.";
  if (!moe) {
    c->shapes[m + "gate_proj.weight"] = {kInter, kHidden};
    c->shapes[m + "up_proj.weight"] = {kInter, kHidden};
    c->shapes[m + "down_proj.weight"] = {kHidden, kInter};
    return;
  }
  c->shapes[m + "gate.weight"] = {8, kHidden};
  c->shapes[m + "gate.e_score_correction_bias"] = {8};
  for (const std::string e : {"experts.0.", "experts.1.", "experts.2.", "experts.3.", "experts.4.",
                              "experts.5.", "experts.6.", "experts.7.", "shared_experts."}) {
    c->shapes[m + e + "gate_proj.weight"] = {32, kHidden};
    c->shapes[m + e + "up_proj.weight"] = {32, kHidden};
    c->shapes[m + e + "down_proj.weight"] = {kHidden, 32};
  }
}

// Qwen3-Next's layer i of tiny(): Gated DeltaNet (2 key heads of 16, 4
// value heads of 12, kernel 4) on the even layers, gated full attention on
// the odd ones; 4 routed experts (top 2) and the gated shared expert, dense
// on layer 2 (mlp_only_layers).
void add_qwen3_next_layer(Checkpoint* c, const std::string& p, int64_t i) {
  if (i % 2 == 0) {
    const std::string a = p + "linear_attn.";
    c->shapes[a + "in_proj_qkvz.weight"] = {2 * 2 * 16 + 2 * 4 * 12, kHidden};
    c->shapes[a + "in_proj_ba.weight"] = {2 * 4, kHidden};
    c->shapes[a + "conv1d.weight"] = {2 * 2 * 16 + 4 * 12, 1, 4};
    c->shapes[a + "A_log"] = {4};
    c->shapes[a + "dt_bias"] = {4};
    c->shapes[a + "norm.weight"] = {12};
    c->shapes[a + "out_proj.weight"] = {kHidden, 4 * 12};
  } else {
    const std::string a = p + "self_attn.";
    c->shapes[a + "q_proj.weight"] = {2 * kHeads * kHeadDim, kHidden};  // [query | gate]
    c->shapes[a + "k_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
    c->shapes[a + "v_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
    c->shapes[a + "o_proj.weight"] = {kHidden, kHeads * kHeadDim};
    c->shapes[a + "q_norm.weight"] = {kHeadDim};
    c->shapes[a + "k_norm.weight"] = {kHeadDim};
  }
  const std::string m = p + "mlp.";
  if (i == 2) {
    c->shapes[m + "gate_proj.weight"] = {kInter, kHidden};
    c->shapes[m + "up_proj.weight"] = {kInter, kHidden};
    c->shapes[m + "down_proj.weight"] = {kHidden, kInter};
    return;
  }
  c->shapes[m + "gate.weight"] = {4, kHidden};
  c->shapes[m + "shared_expert_gate.weight"] = {1, kHidden};
  for (const std::string e :
       {"experts.0.", "experts.1.", "experts.2.", "experts.3.", "shared_expert."}) {
    c->shapes[m + e + "gate_proj.weight"] = {32, kHidden};
    c->shapes[m + e + "up_proj.weight"] = {32, kHidden};
    c->shapes[m + e + "down_proj.weight"] = {kHidden, 32};
  }
}

// Llama 4's layer i of tiny(): chunked attention (chunk 4, RoPE, L2
// qk-norm) except NoPE layer 2 (temperature tuning, floor_scale 4, so the
// scale changes within the test's positions); top-1 input-scaled experts
// (fused gate_up_proj / down_proj) and a shared expert on layer 1, dense
// feed_forward on layers 0 and 2.
void add_llama4_layer(Checkpoint* c, const std::string& p, int64_t i) {
  c->shapes[p + "self_attn.q_proj.weight"] = {kHeads * kHeadDim, kHidden};
  c->shapes[p + "self_attn.k_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
  c->shapes[p + "self_attn.v_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
  c->shapes[p + "self_attn.o_proj.weight"] = {kHidden, kHeads * kHeadDim};
  const std::string f = p + "feed_forward.";
  if (i != 1) {
    c->shapes[f + "gate_proj.weight"] = {kInter, kHidden};
    c->shapes[f + "up_proj.weight"] = {kInter, kHidden};
    c->shapes[f + "down_proj.weight"] = {kHidden, kInter};
    return;
  }
  c->shapes[f + "router.weight"] = {4, kHidden};
  c->shapes[f + "experts.gate_up_proj"] = {4, kHidden, 2 * 32};
  c->shapes[f + "experts.down_proj"] = {4, 32, kHidden};
  c->shapes[f + "shared_expert.gate_proj.weight"] = {32, kHidden};
  c->shapes[f + "shared_expert.up_proj.weight"] = {32, kHidden};
  c->shapes[f + "shared_expert.down_proj.weight"] = {kHidden, 32};
}

// A Llama (or Gemma-2, DeepSeek-V3, Qwen3-Next, Llama 4) checkpoint of `layers`
// layers with N(0, 1/in) matrices and 1 + N(0, 0.3) norm gains (Gemma's and
// Qwen3-Next's zero-centred norms: N(0, 0.3), their (1 + w)).
Checkpoint tiny(const std::string& model_type, int64_t layers, uint64_t seed) {
  Checkpoint c;
  const bool gemma = model_type == "gemma2";
  const bool next = model_type == "qwen3_next";
  const bool llama4 = model_type == "llama4_text";
  c.config = {{"model_type", model_type},
              {"vocab_size", kVocab},
              {"hidden_size", kHidden},
              {"intermediate_size", kInter},
              {"num_hidden_layers", layers},
              {"num_attention_heads", kHeads},
              {"num_key_value_heads", kKvHeads},
              {"head_dim", kHeadDim},
              {"rms_norm_eps", 1e-5},
              {"tie_word_embeddings", gemma}};
  if (gemma) {
    c.config["sliding_window"] = 4;
    c.config["query_pre_attn_scalar"] = 16;
  }
  const bool sparse = model_type == "deepseek_v32";
  const bool deepseek = model_type == "deepseek_v3" || sparse;
  if (deepseek) {
    // MLA (q_lora_rank 24, kv_lora_rank 32, d_n 16, d_r 8, d_v 12) and, from
    // layer 1 on, 8 routed experts (top 2 by noaux_tc) and a shared one.
    c.config.update({{"num_key_value_heads", kHeads},
                     {"q_lora_rank", 24},
                     {"kv_lora_rank", 32},
                     {"qk_nope_head_dim", 16},
                     {"qk_rope_head_dim", 8},
                     {"v_head_dim", 12},
                     {"n_routed_experts", 8},
                     {"num_experts_per_tok", 2},
                     {"moe_intermediate_size", 32},
                     {"n_shared_experts", 1},
                     {"first_k_dense_replace", 1},
                     {"n_group", 4},
                     {"topk_group", 2},
                     {"rope_scaling", nullptr}});
    c.config.erase("head_dim");
  }
  // DeepSeek-V3.2: each query attends to the 4 keys its indexer ranks best,
  // so every position past the 4th of the tests' sequences is sparse.
  if (sparse) c.config.update({{"index_n_heads", 2}, {"index_head_dim", 128}, {"index_topk", 4}});
  if (next) {
    json types = json::array();
    for (int64_t i = 0; i < layers; ++i)
      types.push_back(i % 2 == 0 ? "linear_attention" : "full_attention");
    c.config.update({{"layer_types", types},
                     {"partial_rotary_factor", 0.25},
                     {"linear_num_key_heads", 2},
                     {"linear_num_value_heads", 4},
                     {"linear_key_head_dim", 16},
                     {"linear_value_head_dim", 12},
                     {"linear_conv_kernel_dim", 4},
                     {"num_experts", 4},
                     {"num_experts_per_tok", 2},
                     {"moe_intermediate_size", 32},
                     {"shared_expert_intermediate_size", 32},
                     {"mlp_only_layers", json::array({2})}});
  }
  if (llama4)
    c.config.update({{"intermediate_size", 32},
                     {"intermediate_size_mlp", kInter},
                     {"num_local_experts", 4},
                     {"num_experts_per_tok", 1},
                     {"moe_layers", json::array({1})},
                     {"no_rope_layer_interval", 3},
                     {"attention_chunk_size", 4},
                     {"floor_scale", 4},
                     {"attn_scale", 0.1},
                     {"rope_scaling", nullptr}});
  c.shapes["model.embed_tokens.weight"] = {kVocab, kHidden};
  c.shapes["model.norm.weight"] = {kHidden};
  if (!gemma) c.shapes["lm_head.weight"] = {kVocab, kHidden};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* n : {"input_layernorm", "post_attention_layernorm"})
      c.shapes[p + n + ".weight"] = {kHidden};
    if (gemma)
      for (const char* n : {"pre_feedforward_layernorm", "post_feedforward_layernorm"})
        c.shapes[p + n + ".weight"] = {kHidden};
    if (deepseek) {
      add_deepseek_layer(&c, p, i >= 1, sparse);
      continue;
    }
    if (next) {
      add_qwen3_next_layer(&c, p, i);
      continue;
    }
    if (llama4) {
      add_llama4_layer(&c, p, i);
      continue;
    }
    c.shapes[p + "self_attn.q_proj.weight"] = {kHeads * kHeadDim, kHidden};
    c.shapes[p + "self_attn.k_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
    c.shapes[p + "self_attn.v_proj.weight"] = {kKvHeads * kHeadDim, kHidden};
    c.shapes[p + "self_attn.o_proj.weight"] = {kHidden, kHeads * kHeadDim};
    c.shapes[p + "mlp.gate_proj.weight"] = {kInter, kHidden};
    c.shapes[p + "mlp.up_proj.weight"] = {kInter, kHidden};
    c.shapes[p + "mlp.down_proj.weight"] = {kHidden, kInter};
  }
  Rng rng(seed);
  for (const auto& [name, shape] : c.shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float>& v = c.values[name];
    v.resize(static_cast<size_t>(n));
    const bool norm = name.ends_with("norm.weight");
    // The Gated DeltaNet's output norm applies w itself, never 1 + w.
    const bool zero_centred = (gemma || next) && !name.ends_with("linear_attn.norm.weight");
    // Fan-in: the last dim for nn.Linear [out, in], the middle one for
    // Llama 4's fused x @ W experts [E, in, out].
    const int64_t fan_in =
        shape.size() == 3 && !name.ends_with("conv1d.weight") ? shape[1] : shape.back();
    const float scale = norm ? 0.3f : 1.0f / std::sqrt(static_cast<float>(fan_in));
    for (float& x : v) x = (norm && !zero_centred ? 1.0f : 0.0f) + rng.normal(0.0f, scale);
  }
  return c;
}

std::string temp_dir(const std::string& stem) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = ::testing::TempDir() + "attnkit_model_" + info->name() + "_" + stem +
                          "_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

WeightMap views(const Checkpoint& c, const std::vector<std::string>& names) {
  WeightMap m;
  for (const std::string& n : names) {
    const auto& s = c.shapes.at(n);
    const void* data = c.values.at(n).data();
    m[n] = s.size() == 1   ? make_view(data, DType::kF32, {s[0]})
           : s.size() == 2 ? make_view(data, DType::kF32, {s[0], s[1]})
                           : make_view(data, DType::kF32, {s[0], s[1], s[2]});
  }
  return m;
}

// Writes config.json and the weights: one file, or `shards` files and the
// index (tensor k in shard k % shards).
std::string write(const Checkpoint& c, const std::string& stem, int shards = 1) {
  const std::string dir = temp_dir(stem);
  std::ofstream(dir + "/config.json") << c.config.dump();
  std::vector<std::string> names;
  for (const auto& [n, s] : c.shapes) names.push_back(n);
  if (shards == 1) {
    EXPECT_TRUE(save_safetensors(dir + "/model.safetensors", views(c, names)).ok());
    return dir;
  }
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (int s = 0; s < shards; ++s) {
    std::vector<std::string> part;
    const std::string file = "model-" + std::to_string(s + 1) + ".safetensors";
    for (size_t k = static_cast<size_t>(s); k < names.size(); k += static_cast<size_t>(shards)) {
      part.push_back(names[k]);
      index["weight_map"][names[k]] = file;
    }
    EXPECT_TRUE(save_safetensors(dir + "/" + file, views(c, part)).ok());
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  return dir;
}

Model load(const std::string& dir) {
  auto m = Model::from_pretrained(dir);
  EXPECT_TRUE(m.ok()) << m.status().message();
  return std::move(m).value();
}

std::string load_error(const std::string& dir) {
  auto m = Model::from_pretrained(dir);
  EXPECT_FALSE(m.ok());
  return m.ok() ? "" : m.status().message();
}

// logits [b, s, vocab] of forward() over one row of tokens.
std::vector<float> forward_all(Model& m, std::vector<int32_t> tokens) {
  auto r = m.forward(make_view(tokens.data(), DType::kI32, {1, std::ssize(tokens)}));
  EXPECT_TRUE(r.ok()) << r.status().message();
  return std::vector<float>(r->ptr<float>(), r->ptr<float>() + r->numel());
}

// |a - b| <= 1e-5 max|b| elementwise: the fp32 pipeline's rounding in two
// groupings of the same rows (GEMM blocking, attention splits), far below
// any wrong position, mask or norm.
void expect_close(std::span<const float> got, std::span<const float> want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(static_cast<double>(got[i]) - want[i]), 1e-5 * scale)
        << what << " element " << i << ": got " << got[i] << ", want " << want[i];
}

// Two sequences: prompts of 7 and 3 tokens prefilled in chunks (4 + 3 and
// 3), then 4 decode steps each; every step's last-token logits equal
// forward()'s at that position.
void check_steps_equal_forward(const std::string& model_type) {
  Model m = load(write(tiny(model_type, 3, 5), "m"));
  Rng rng(9);
  std::vector<std::vector<int32_t>> seqs = {std::vector<int32_t>(11), std::vector<int32_t>(7)};
  for (auto& s : seqs)
    for (int32_t& t : s) t = static_cast<int32_t>(rng.integer(0, kVocab - 1));
  std::vector<std::vector<float>> want = {forward_all(m, seqs[0]), forward_all(m, seqs[1])};
  auto pool = m.new_pool(8, 4, DType::kF32, false);
  auto states = m.new_state_pool(0);
  ASSERT_TRUE(pool.ok() && states.ok());
  const std::vector<int64_t> ids = {pool->add_sequence(), pool->add_sequence()};
  for (int64_t id : ids) ASSERT_TRUE(states->add_sequence(id).ok());
  // Tokens per sequence per step: prompt chunks, then one at a time.
  const std::vector<std::vector<int64_t>> steps = {{4, 3}, {3, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 0}};
  std::vector<int64_t> done = {0, 0};
  for (const auto& counts : steps) {
    std::vector<int32_t> tokens, cu = {0};
    std::vector<int64_t> step_ids, step_counts;
    for (size_t s = 0; s < 2; ++s) {
      if (counts[s] == 0) continue;
      for (int64_t t = 0; t < counts[s]; ++t) tokens.push_back(seqs[s][done[s] + t]);
      cu.push_back(static_cast<int32_t>(tokens.size()));
      step_ids.push_back(ids[s]);
      step_counts.push_back(counts[s]);
    }
    ASSERT_TRUE(pool->append(step_ids, step_counts).ok());
    std::vector<float> logits(step_ids.size() * kVocab);
    Status st = m.forward_step(tokens, cu, step_ids, *pool, *states, logits, {});
    ASSERT_TRUE(st.ok()) << st.message();
    for (size_t k = 0, s = 0; s < 2; ++s) {
      if (counts[s] == 0) continue;
      done[s] += counts[s];
      const auto row = std::span<const float>(want[s]).subspan(
          static_cast<size_t>((done[s] - 1) * kVocab), kVocab);
      expect_close(std::span<const float>(logits).subspan(k++ * kVocab, kVocab), row,
                   model_type + " sequence " + std::to_string(s) + " position " +
                       std::to_string(done[s] - 1));
    }
  }
}

TEST(Model, LlamaStepsOverThePoolEqualForward) { check_steps_equal_forward("llama"); }

// Gemma-2: sliding layer 0 (window 4 < 11 tokens) and full layer 1 share a
// pool without a window, softcaps, (1 + w) sandwich norms.
TEST(Model, Gemma2StepsOverThePoolEqualForward) { check_steps_equal_forward("gemma2"); }

// DeepSeek-V3: MLA over the latent pool, a dense layer, then MoE layers.
TEST(Model, DeepseekStepsOverTheLatentPoolEqualForward) {
  check_steps_equal_forward("deepseek_v3");
}

// DeepSeek-V3.2: the lightning indexer's keys stored in the latent pool
// beside each token's latent row, top-4 sparse MLA from the 5th position
// on, in prefill chunks and in decode. The two paths score the keys alike
// up to fp32 rounding (a one-token step's indexer projections take the
// one-row GEMV); a near-tie at the top-k cut broken differently would move
// a logit far past the bound, and none occurs for this seed.
TEST(Model, DeepseekV32SparseStepsOverTheLatentPoolEqualForward) {
  check_steps_equal_forward("deepseek_v32");
}

// The pool of a sparse model carries the indexer key of every token and
// layer (128 fp8 codes and one f32 scale), and the top-k is in force: the
// same weights with index_topk 64 (every key selected) give the dense
// logits at every position, which differ from the sparse ones past the
// 4th position only.
TEST(Model, DeepseekV32PoolCarriesIndexerKeysAndTheTopkSelects) {
  Checkpoint c = tiny("deepseek_v32", 2, 12);
  Model sparse = load(write(c, "sparse"));
  auto pool = sparse.new_pool(4, 4, DType::kF32, false);
  ASSERT_TRUE(pool.ok()) << pool.status().message();
  EXPECT_EQ(pool->spec().index_head_dim, 128);
  EXPECT_EQ(pool->spec().num_layers, 2);
  auto cached = sparse.new_pool(4, 4, DType::kBF16, true);  // the engine's prefix-caching pool
  ASSERT_TRUE(cached.ok()) << cached.status().message();
  EXPECT_EQ(cached->spec().index_head_dim, 128);
  EXPECT_TRUE(cached->spec().prefix_caching);
  for (int64_t l = 0; l < 2; ++l) {
    auto keys = pool->index_keys(l);
    ASSERT_TRUE(keys.ok() && keys->present());
    EXPECT_EQ(keys->shape[1], 128);
  }
  c.config["index_topk"] = 64;
  Model wide = load(write(c, "wide"));
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
  const std::vector<float> s = forward_all(sparse, tokens), w = forward_all(wide, tokens);
  const auto row = [](const std::vector<float>& v, int64_t t) {
    return std::span<const float>(v).subspan(static_cast<size_t>(t * kVocab), kVocab);
  };
  for (int64_t t = 0; t < 4; ++t)
    expect_close(row(s, t), row(w, t), "position " + std::to_string(t));
  double moved = 0.0;
  for (size_t i = 4 * kVocab; i < s.size(); ++i)
    moved = std::max(moved, std::fabs(static_cast<double>(s[i]) - w[i]));
  EXPECT_GT(moved, 1e-2) << "top-4 of up to 10 keys must change some logit";
}

// Qwen3-Next: Gated DeltaNet layers 0 and 2 carry each sequence's state
// across steps in the state pool (same ids as the paged pool), gated full
// attention on layer 1 in the paged pool; MoE with the gated shared expert.
TEST(Model, Qwen3NextStepsOverThePoolAndStatesEqualForward) {
  check_steps_equal_forward("qwen3_next");
}

// Llama 4: chunked layers 0-1 and NoPE layer 2 share a pool without a
// chunk (each passes its own); the NoPE layer's temperature follows the
// pool's positions across steps; input-scaled experts on layer 1.
TEST(Model, Llama4StepsOverThePoolEqualForward) { check_steps_equal_forward("llama4_text"); }

TEST(Model, Qwen3NextStatePoolHoldsItsLinearLayers) {
  Checkpoint c = tiny("qwen3_next", 3, 8);
  // Hugging Face skips the multi-token-prediction head on load; so does Model.
  c.shapes["mtp.fc.weight"] = {kHidden, 2 * kHidden};
  c.values["mtp.fc.weight"].resize(2 * kHidden * kHidden);
  Model m = load(write(c, "m"));
  // Per linear layer: S [4, 16, 12] and the conv's last 3 inputs of 2*2*16 + 4*12 channels.
  const int64_t per_layer = (4 * 16 * 12 + 3 * (2 * 2 * 16 + 4 * 12)) * 4;
  EXPECT_EQ(m.state_bytes_per_sequence(), 2 * per_layer);
  auto states = m.new_state_pool(3);
  ASSERT_TRUE(states.ok()) << states.status().message();
  EXPECT_EQ(states->num_layers(), 2);
  EXPECT_EQ(states->max_sequences(), 3);
  EXPECT_EQ(states->bytes_per_sequence(), m.state_bytes_per_sequence());

  // A step with a state pool of no layers (another model's) is refused
  // before anything runs; so is a sequence the state pool does not hold.
  auto pool = m.new_pool(4, 4, DType::kF32, false);
  auto none = LinearStatePool::create({}, 0);
  ASSERT_TRUE(pool.ok() && none.ok());
  const std::vector<int64_t> ids = {pool->add_sequence()};
  ASSERT_TRUE(pool->append(ids, std::vector<int64_t>{2}).ok());
  std::vector<float> logits(kVocab, -7.0f);
  const std::vector<int32_t> tokens = {1, 2}, cu = {0, 2};
  Status st = m.forward_step(tokens, cu, ids, *pool, *none, logits, {});
  EXPECT_NE(st.message().find("states has 0 layers; this model has 2 linear-attention layers"),
            std::string::npos)
      << st.message();
  st = m.forward_step(tokens, cu, ids, *pool, *states, logits, {});
  EXPECT_FALSE(st.ok());
  for (float x : logits) ASSERT_EQ(x, -7.0f);
  ASSERT_TRUE(states->add_sequence(ids[0]).ok());
  st = m.forward_step(tokens, cu, ids, *pool, *states, logits, {});
  EXPECT_TRUE(st.ok()) << st.message();

  Checkpoint extra = tiny("qwen3_next", 3, 8);
  extra.shapes["model.layers.0.linear_attn.extra"] = {4};
  extra.values["model.layers.0.linear_attn.extra"].resize(4);
  std::string msg = load_error(write(extra, "extra"));
  EXPECT_NE(msg.find("model.layers.0.linear_attn.extra"), std::string::npos) << msg;
  Checkpoint missing = tiny("qwen3_next", 3, 8);
  missing.shapes.erase("model.layers.1.mlp.shared_expert_gate.weight");
  msg = load_error(write(missing, "missing"));
  EXPECT_NE(msg.find("layer 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.layers.1.mlp.shared_expert_gate.weight"), std::string::npos) << msg;
}

TEST(Model, ZeroMixerAndMlpLeaveNormOfEmbeddingThroughLmHead) {
  Checkpoint c = tiny("llama", 1, 3);
  for (const char* n : {"self_attn.o_proj.weight", "mlp.down_proj.weight"}) {
    auto& v = c.values["model.layers.0." + std::string(n)];
    std::fill(v.begin(), v.end(), 0.0f);
  }
  Model m = load(write(c, "m"));
  const std::vector<int32_t> tokens = {0, 96, 13};
  const std::vector<float> got = forward_all(m, tokens);
  const auto& E = c.values["model.embed_tokens.weight"];
  const auto& g = c.values["model.norm.weight"];
  const auto& W = c.values["lm_head.weight"];
  std::vector<float> want;
  for (int32_t t : tokens) {
    double ss = 0.0;
    for (int64_t i = 0; i < kHidden; ++i)
      ss += static_cast<double>(E[t * kHidden + i]) * E[t * kHidden + i];
    const double inv = 1.0 / std::sqrt(ss / kHidden + 1e-5);
    for (int64_t v = 0; v < kVocab; ++v) {
      double acc = 0.0;
      for (int64_t i = 0; i < kHidden; ++i)
        acc += E[t * kHidden + i] * inv * g[i] * static_cast<double>(W[v * kHidden + i]);
      want.push_back(static_cast<float>(acc));
    }
  }
  expect_close(got, want, "lm_head(norm(embed))");
}

TEST(Model, ShardedCheckpointLoadsTheSameModel) {
  const Checkpoint c = tiny("llama", 2, 4);
  Model one = load(write(c, "one"));
  Model three = load(write(c, "three", 3));
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  EXPECT_EQ(forward_all(one, tokens), forward_all(three, tokens));
  EXPECT_EQ(one.weight_bytes(), three.weight_bytes());
  EXPECT_EQ(one.num_layers(), 2);
  EXPECT_EQ(one.vocab_size(), kVocab);
}

TEST(Model, BadCheckpointsAreNamed) {
  Checkpoint c = tiny("llama", 2, 6);
  Checkpoint missing = c;
  missing.shapes.erase("model.layers.1.mlp.up_proj.weight");
  std::string msg = load_error(write(missing, "missing"));
  EXPECT_NE(msg.find("layer 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.layers.1.mlp.up_proj.weight' is missing"), std::string::npos) << msg;

  Checkpoint extra = c;
  extra.shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] = {kHeadDim / 2};
  extra.values["model.layers.0.self_attn.rotary_emb.inv_freq"].resize(kHeadDim / 2);
  EXPECT_TRUE(Model::from_pretrained(write(extra, "buffer")).ok()) << "a RoPE buffer is skipped";
  extra.shapes["model.final.bias"] = {kHidden};
  extra.values["model.final.bias"].resize(kHidden);
  msg = load_error(write(extra, "extra"));
  EXPECT_NE(msg.find("\"model.final.bias\""), std::string::npos) << msg;

  Checkpoint shaped = c;
  shaped.shapes["lm_head.weight"] = {kVocab - 1, kHidden};
  msg = load_error(write(shaped, "shape"));
  EXPECT_NE(msg.find("[96, 64], expected [97, 64]"), std::string::npos) << msg;

  const std::string dir = write(c, "truncated", 2);
  fs::resize_file(dir + "/model-2.safetensors", fs::file_size(dir + "/model-2.safetensors") - 8);
  msg = load_error(dir);
  EXPECT_NE(msg.find("model-2.safetensors"), std::string::npos) << msg;
  fs::remove(dir + "/model-2.safetensors");
  msg = load_error(dir);
  EXPECT_NE(msg.find("shard \"model-2.safetensors\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;

  // A dtype no layer holds: the norm's gain as int32.
  const std::string dtype_dir = write(c, "dtype");
  std::vector<std::string> names;
  for (const auto& [n, shape] : c.shapes) names.push_back(n);
  WeightMap ints = views(c, names);
  const std::vector<int32_t> gain(kHidden, 1);
  ints["model.norm.weight"] = make_view(gain.data(), DType::kI32, {kHidden});
  ASSERT_TRUE(save_safetensors(dtype_dir + "/model.safetensors", ints).ok());
  msg = load_error(dtype_dir);
  EXPECT_NE(msg.find("'model.norm.weight' has dtype i32"), std::string::npos) << msg;

  Checkpoint unknown = c;
  unknown.config["model_type"] = "gemma";  // read for the analysis only
  msg = load_error(write(unknown, "family"));
  EXPECT_NE(msg.find("model_type \"gemma\" is not loaded"), std::string::npos) << msg;
}

// A quantized checkpoint (gpt-oss ships MXFP4 experts) is refused before
// any weight is read, naming the method and the way out.
TEST(Model, QuantizedCheckpointIsRefusedNamingTheMethodAndTheWayOut) {
  for (const char* method : {"mxfp4", "fp8"}) {
    Checkpoint c = tiny("llama", 1, 2);
    c.config["quantization_config"] = {{"quant_method", method},
                                       {"modules_to_not_convert", json::array({"lm_head"})}};
    const std::string msg = load_error(write(c, method));
    EXPECT_NE(msg.find("Model::from_pretrained: quantization_config.quant_method = \"" +
                       std::string(method) + "\""),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("load a bf16 dequantized checkpoint instead"), std::string::npos) << msg;
  }
}

TEST(Model, BadStepsChangeNothing) {
  Model m = load(write(tiny("llama", 1, 7), "m"));
  auto pool = m.new_pool(4, 4, DType::kF32, false);
  auto states = m.new_state_pool(0);
  ASSERT_TRUE(pool.ok() && states.ok());
  const std::vector<int64_t> ids = {pool->add_sequence()};
  ASSERT_TRUE(pool->append(ids, std::vector<int64_t>{3}).ok());
  std::vector<float> logits(kVocab, -7.0f);
  const std::vector<int32_t> cu = {0, 3};
  Status st =
      m.forward_step(std::vector<int32_t>{1, kVocab, 2}, cu, ids, *pool, *states, logits, {});
  EXPECT_NE(st.message().find("token_ids[1] = 97 is outside the vocabulary [0, 97)"),
            std::string::npos)
      << st.message();
  st = m.forward_step(std::vector<int32_t>{1, 2, 3}, std::vector<int32_t>{0, 2}, ids, *pool,
                      *states, logits, {});
  EXPECT_NE(st.message().find("cu_seqlens"), std::string::npos) << st.message();
  st = m.forward_step(std::vector<int32_t>{1, 2, 3}, cu, ids, *pool, *states,
                      std::span<float>(logits).first(kVocab - 1), {});
  EXPECT_NE(st.message().find("logits"), std::string::npos) << st.message();
  for (float x : logits) ASSERT_EQ(x, -7.0f);
  EXPECT_EQ(pool->written(ids[0], 0).value(), 0);
  std::vector<int64_t> bad = {1, -1};
  auto r = m.forward(make_view(bad.data(), DType::kI64, {1, 2}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("Model::forward: token_ids[0, 1] = -1"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace attnkit
