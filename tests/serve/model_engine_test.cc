// The serving engine (attnkit/serve.h) over a real decoder, attnkit::Model,
// loaded from tiny random checkpoints written here: a Llama (bf16 weights,
// as checkpoints ship), a Gemma-2 (sliding and full layers alternating,
// softcaps, sandwich norms; f32), a DeepSeek-V3 (MLA over the latent
// pool, a dense layer then MoE layers; f32) and a DeepSeek-V3.2 (the same
// with the lightning indexer's keys in the pool and top-6 sparse MLA, so
// most requests' later tokens attend to fewer keys than they see; f32).
//
// Three references for each request's greedy tokens:
//   - the same request served alone (max_seqs = 1, its prompt in one step);
//   - greedy decoding with Model::forward on the growing sequence (the
//     argmax of the last row), which runs through a private f32 pool of its
//     own page size: the engine holds the same f32 KV here;
//   - the same trace served without the prefix cache, when it shares
//     prompt prefixes.
// With Backend::kReference every kernel computes each token's row
// independently of the others (docs/PAGED.md), so batching, chunked
// prefill, the page size and taking over cached pages must all give the
// same bits; tests/serve/engine_test.cc holds the fast kernels' batch
// invariance on the fixture.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attnkit/model.h"
#include "attnkit/serve.h"
#include "attnkit/weights.h"
#include "common/engine_runs.h"
#include "common/random.h"

namespace attnkit {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using attnkit_test::expect_same;
using attnkit_test::Rng;
using attnkit_test::serve_all;
using attnkit_test::Served;

constexpr int64_t kVocab = 89, kHidden = 32, kInter = 48;

using Shapes = std::map<std::string, std::vector<int64_t>>;

void add_mlp(Shapes& s, const std::string& m, int64_t inter) {
  s[m + "gate_proj.weight"] = {inter, kHidden};
  s[m + "up_proj.weight"] = {inter, kHidden};
  s[m + "down_proj.weight"] = {kHidden, inter};
}

// config.json and the tensors it implies for a 2-layer (DeepSeek: 3-layer)
// "llama", "gemma2", "deepseek_v3" or "deepseek_v32" of hidden 32 and 4
// query heads.
json config_of(const std::string& model_type) {
  json c = {{"model_type", model_type},
            {"vocab_size", kVocab},
            {"hidden_size", kHidden},
            {"intermediate_size", kInter},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", 8},
            {"rms_norm_eps", 1e-5},
            {"rope_theta", 10000.0},
            {"tie_word_embeddings", model_type == "gemma2"}};
  if (model_type == "gemma2")  // layer 0 sees the last 4 tokens, layer 1 all
    c.update({{"sliding_window", 4},
              {"query_pre_attn_scalar", 8},
              {"attn_logit_softcapping", 50.0},
              {"final_logit_softcapping", 30.0}});
  if (model_type == "deepseek_v3" || model_type == "deepseek_v32") {
    c.update({{"num_hidden_layers", 3},
              {"num_key_value_heads", 4},
              {"q_lora_rank", 16},
              {"kv_lora_rank", 16},
              {"qk_nope_head_dim", 8},
              {"qk_rope_head_dim", 4},
              {"v_head_dim", 8},
              {"n_routed_experts", 4},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 16},
              {"n_shared_experts", 1},
              {"first_k_dense_replace", 1},
              {"n_group", 2},
              {"topk_group", 1},
              {"rope_scaling", nullptr}});
    c.erase("head_dim");
  }
  if (model_type == "deepseek_v32")
    c.update({{"index_n_heads", 2}, {"index_head_dim", 128}, {"index_topk", 6}});
  return c;
}

Shapes shapes_of(const json& c) {
  const bool gemma = c["model_type"] == "gemma2", sparse = c["model_type"] == "deepseek_v32";
  const bool deepseek = c["model_type"] == "deepseek_v3" || sparse;
  Shapes s;
  s["model.embed_tokens.weight"] = {kVocab, kHidden};
  s["model.norm.weight"] = {kHidden};
  if (!gemma) s["lm_head.weight"] = {kVocab, kHidden};
  for (int64_t i = 0; i < c["num_hidden_layers"].get<int64_t>(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    for (const char* n : {"input_layernorm", "post_attention_layernorm"})
      s[p + n + ".weight"] = {kHidden};
    if (gemma)
      for (const char* n : {"pre_feedforward_layernorm", "post_feedforward_layernorm"})
        s[p + n + ".weight"] = {kHidden};
    if (!deepseek) {
      s[a + "q_proj.weight"] = {4 * 8, kHidden};
      s[a + "k_proj.weight"] = {2 * 8, kHidden};
      s[a + "v_proj.weight"] = {2 * 8, kHidden};
      s[a + "o_proj.weight"] = {kHidden, 4 * 8};
      add_mlp(s, p + "mlp.", kInter);
      continue;
    }
    s[a + "q_a_proj.weight"] = {16, kHidden};
    s[a + "q_a_layernorm.weight"] = {16};
    s[a + "q_b_proj.weight"] = {4 * (8 + 4), 16};
    s[a + "kv_a_proj_with_mqa.weight"] = {16 + 4, kHidden};
    s[a + "kv_a_layernorm.weight"] = {16};
    s[a + "kv_b_proj.weight"] = {4 * (8 + 8), 16};
    s[a + "o_proj.weight"] = {kHidden, 4 * 8};
    if (sparse) {
      s[a + "indexer.wq_b.weight"] = {2 * 128, 16};
      s[a + "indexer.wk.weight"] = {128, kHidden};
      s[a + "indexer.k_norm.weight"] = {128};
      s[a + "indexer.k_norm.bias"] = {128};
      s[a + "indexer.weights_proj.weight"] = {2, kHidden};
    }
    if (i == 0) {
      add_mlp(s, p + "mlp.", kInter);
      continue;
    }
    s[p + "mlp.gate.weight"] = {4, kHidden};
    s[p + "mlp.gate.e_score_correction_bias"] = {4};
    for (const std::string e : {"experts.0.", "experts.1.", "experts.2.", "experts.3."})
      add_mlp(s, p + "mlp." + e, 16);
    add_mlp(s, p + "mlp.shared_experts.", 16);
  }
  return s;
}

// Writes dir/config.json and dir/model.safetensors: matrices N(0, 1/in),
// the embedding N(0, 1), norm gains 1 + N(0, 0.3) (Gemma's stored w
// N(0, 0.3)), stored as bf16 when `as_bf16`, else f32.
std::string write_checkpoint(const std::string& model_type, bool as_bf16, uint64_t seed) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = ::testing::TempDir() + "attnkit_model_engine_" + info->name() + "_" +
                          model_type + "_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const json c = config_of(model_type);
  std::ofstream(dir + "/config.json") << c.dump();
  Rng rng(seed);
  std::map<std::string, std::vector<float>> f32;
  std::map<std::string, std::vector<bf16>> b16;
  WeightMap views;
  for (const auto& [name, shape] : shapes_of(c)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float>& v = f32[name];
    const bool norm = name.ends_with("norm.weight"), bias = shape.size() == 1 && !norm;
    const float scale = norm || bias ? 0.3f
                        : name.ends_with("embed_tokens.weight")
                            ? 1.0f
                            : 1.0f / std::sqrt(static_cast<float>(shape.back()));
    for (int64_t k = 0; k < n; ++k)
      v.push_back((norm && model_type != "gemma2" ? 1.0f : 0.0f) + rng.normal(0.0f, scale));
    if (!as_bf16) {
      views[name] = shape.size() == 1 ? make_view(v.data(), DType::kF32, {shape[0]})
                                      : make_view(v.data(), DType::kF32, {shape[0], shape[1]});
      continue;
    }
    std::vector<bf16>& h = b16[name];
    for (float x : v) h.push_back(float_to_bf16(x));
    views[name] = shape.size() == 1 ? make_view(h.data(), DType::kBF16, {shape[0]})
                                    : make_view(h.data(), DType::kBF16, {shape[0], shape[1]});
  }
  const Status st = save_safetensors(dir + "/model.safetensors", views);
  EXPECT_TRUE(st.ok()) << st.message();
  return dir;
}

struct Family {
  const char* model_type;
  bool as_bf16;
};

const std::vector<Family> kFamilies = {
    {"llama", true}, {"gemma2", false}, {"deepseek_v3", false}, {"deepseek_v32", false}};

Model load(const Family& f, uint64_t seed) {
  ModelLoadOptions lo;
  lo.run.backend = Backend::kReference;  // forward()'s kernels, as the engine's below
  auto m = Model::from_pretrained(write_checkpoint(f.model_type, f.as_bf16, seed), lo);
  EXPECT_TRUE(m.ok()) << m.status().message();
  return std::move(m).value();
}

std::vector<int32_t> tokens(Rng& rng, int64_t n) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(rng.integer(0, kVocab - 1)));
  return t;
}

EngineOptions reference_options() {
  EngineOptions o;
  o.run.backend = Backend::kReference;
  o.kv_dtype = DType::kF32;  // forward()'s private pool holds f32
  o.page_size = 4;
  o.kv_memory = int64_t{8} << 20;
  return o;
}

// Greedy decoding with forward() on the growing sequence: `n` tokens.
std::vector<int32_t> greedy_by_forward(Model& m, std::vector<int32_t> seq, int64_t n) {
  std::vector<int32_t> out;
  for (int64_t k = 0; k < n; ++k) {
    auto logits = m.forward(make_view(seq.data(), DType::kI32, {1, std::ssize(seq)}));
    EXPECT_TRUE(logits.ok()) << logits.status().message();
    if (!logits.ok()) return out;
    const float* last = logits->ptr<float>() + (std::ssize(seq) - 1) * kVocab;
    out.push_back(static_cast<int32_t>(std::max_element(last, last + kVocab) - last));
    seq.push_back(out.back());
  }
  return out;
}

// Issue 34's target on a checkpoint: 16 concurrent requests (their prompts
// chunked under a 40-token step budget) give each request's tokens alone,
// bit for bit, and the tokens of greedy decoding with forward().
TEST(ModelEngine, SixteenConcurrentRequestsGiveTheTokensOfEachAloneAndOfForward) {
  for (const Family& f : kFamilies) {
    SCOPED_TRACE(f.model_type);
    Model m = load(f, 11);
    Rng rng(12);
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t i = 0; i < 16; ++i) prompts.push_back(tokens(rng, 3 + (i * 5) % 17));
    EngineOptions o = reference_options();
    o.max_tokens_per_step = 40;
    const Served together = serve_all(m, prompts, 8, o);
    EXPECT_EQ(together.stats.peak_running, 16);
    o.max_seqs = 1;
    o.max_tokens_per_step = 1 << 20;
    expect_same(together, serve_all(m, prompts, 8, o), "16 together vs alone");
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_EQ(together.tokens[i].size(), 8u);
      EXPECT_EQ(together.tokens[i], greedy_by_forward(m, prompts[i], 8)) << "request " << i;
    }
  }
}

// Shared system prompts (two of 10 tokens: two whole pages of 4 and two
// tokens more) and their own tokens after them: the prefix cache takes the
// whole pages over and changes no bit of any logits row, served all at
// once and one at a time.
TEST(ModelEngine, PrefixCachingChangesNoBitsOfACheckpointsTokens) {
  for (const Family& f : kFamilies) {
    SCOPED_TRACE(f.model_type);
    Model m = load(f, 21);
    Rng rng(22);
    const std::vector<std::vector<int32_t>> systems = {tokens(rng, 10), tokens(rng, 10)};
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t i = 0; i < 8; ++i) {
      prompts.push_back(systems[static_cast<size_t>(i % 2)]);
      const std::vector<int32_t> own = tokens(rng, 1 + i % 5);
      prompts.back().insert(prompts.back().end(), own.begin(), own.end());
    }
    for (int64_t max_seqs : {int64_t{1}, int64_t{256}}) {
      SCOPED_TRACE("max_seqs " + std::to_string(max_seqs));
      EngineOptions o = reference_options();
      o.max_seqs = max_seqs;
      EngineOptions on = o;
      on.prefix_caching = true;
      const Served cached = serve_all(m, prompts, 5, on);
      expect_same(cached, serve_all(m, prompts, 5, o), "prefix cache on vs off");
      // One at a time, every request after each system prompt's first
      // takes over its 2 whole pages.
      if (max_seqs == 1) {
        EXPECT_EQ(cached.stats.prompt_tokens_cached, 6 * 8);
      }
      EXPECT_EQ(cached.stats.prompt_tokens_computed + cached.stats.prompt_tokens_cached,
                cached.stats.prompt_tokens_admitted);
    }
  }
}

// A request outside the checkpoint's vocabulary is refused by name; the
// engine serves the others.
TEST(ModelEngine, TokensOutsideTheCheckpointsVocabularyAreRefused) {
  Model m = load(kFamilies[0], 31);
  auto e = Engine::create(m, reference_options());
  ASSERT_TRUE(e.ok()) << e.status().message();
  auto bad = e->add_request(std::vector<int32_t>{1, kVocab, 2}, 3);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("prompt_token_ids[1] = 89"), std::string::npos)
      << bad.status().message();
  auto good = e->add_request(std::vector<int32_t>{1, 2, 3}, 3);
  ASSERT_TRUE(good.ok());
  int64_t generated = 0;
  while (e->has_unfinished()) {
    auto step = e->step();
    ASSERT_TRUE(step.ok()) << step.status().message();
    for (const StepOutput& s : *step) generated += std::ssize(s.new_token_ids);
  }
  EXPECT_EQ(generated, 3);
}

}  // namespace
}  // namespace attnkit
