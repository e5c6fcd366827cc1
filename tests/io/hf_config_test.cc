// attention_config_from_json on real Hugging Face config.json files (copied
// verbatim below, so the test needs no network or shared folder), the
// per-family rules, every kind of bad config, validate() and the seeds'
// variant constructor.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/rope.h"

namespace {

using attnkit::AttentionConfig;
using attnkit::RopePairing;
using attnkit::RopeScaling;
using attnkit::StatusCode;

// meta-llama/Llama-2-7b-hf (no rope_theta: the 10000 default applies).
constexpr std::string_view kLlama2_7B = R"({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

// meta-llama/Meta-Llama-3-8B
constexpr std::string_view kLlama3_8B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// meta-llama/Llama-3.1-8B
constexpr std::string_view kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// mistralai/Mistral-7B-v0.1
constexpr std::string_view kMistral7B = R"({
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

// Qwen/Qwen2.5-7B (sliding_window is set but use_sliding_window is false).
constexpr std::string_view kQwen25_7B = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 131072,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 152064
})";

// Qwen/Qwen3-8B (rope_theta is a JSON integer here).
constexpr std::string_view kQwen3_8B = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 12288,
  "max_position_embeddings": 40960,
  "max_window_layers": 36,
  "model_type": "qwen3",
  "num_attention_heads": 32,
  "num_hidden_layers": 36,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// google/gemma-2-9b
constexpr std::string_view kGemma2_9B = R"({
  "architectures": ["Gemma2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": 1,
  "final_logit_softcapping": 30.0,
  "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "gemma2",
  "num_attention_heads": 16,
  "num_hidden_layers": 42,
  "num_key_value_heads": 8,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "sliding_window_size": 4096,
  "torch_dtype": "float32",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 256000
})";

AttentionConfig parse_ok(std::string_view text, int64_t layer = 0) {
  auto r = attnkit::attention_config_from_json(text, layer);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : AttentionConfig{};
}

// A real config with some top-level fields set (null included) ...
std::string patched(std::string_view base, const nlohmann::json& patch) {
  nlohmann::json j = nlohmann::json::parse(base);
  for (const auto& [key, value] : patch.items()) j[key] = value;
  return j.dump();
}
// ... or removed.
std::string without(std::string_view base, const char* key) {
  nlohmann::json j = nlohmann::json::parse(base);
  j.erase(key);
  return j.dump();
}

void expect_plain_llama_shape(const AttentionConfig& c) {
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.qk_norm, attnkit::QkNorm::kNone);
  EXPECT_TRUE(c.use_rope);
  EXPECT_TRUE(c.causal);
  EXPECT_EQ(c.rope.head_dim, c.head_dim);
  EXPECT_EQ(c.rope.rotary_dim, 0);
  EXPECT_EQ(c.rope.pairing, RopePairing::kHalfSplit);
  EXPECT_EQ(c.softcap, 0.0f);
  EXPECT_EQ(c.softmax_scale, 0.0f);
  EXPECT_TRUE(attnkit::validate(c).ok());
}

TEST(HfConfig, Llama2_7B) {
  const AttentionConfig c = parse_ok(kLlama2_7B);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c.sliding_window, 0);
  expect_plain_llama_shape(c);
}

TEST(HfConfig, Llama3_8B) {
  const AttentionConfig c = parse_ok(kLlama3_8B, 31);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope.theta, 500000.0);
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c.sliding_window, 0);
  expect_plain_llama_shape(c);
}

TEST(HfConfig, Llama31Llama3Scaling) {
  const AttentionConfig c = parse_ok(kLlama31_8B);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope.theta, 500000.0);
  const RopeScaling& s = c.rope.scaling;
  EXPECT_EQ(s.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(s.factor, 8.0);
  EXPECT_EQ(s.low_freq_factor, 1.0);
  EXPECT_EQ(s.high_freq_factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 8192);
  expect_plain_llama_shape(c);
  // The parsed RoPE builds, and pairs past the low-frequency wavelength
  // (i >= 35 for this config) are divided by 8.
  auto rope = attnkit::Rope::create(c.rope);
  ASSERT_TRUE(rope.ok());
  const double base63 = std::pow(500000.0, -126.0 / 128.0);
  EXPECT_NEAR(rope->inv_freq()[63], base63 / 8.0, 1e-12 * base63);
  EXPECT_EQ(rope->inv_freq()[0], 1.0);
}

TEST(HfConfig, Mistral7BSlidingOnEveryLayer) {
  for (int64_t layer : {0, 1, 17, 31}) {
    const AttentionConfig c = parse_ok(kMistral7B, layer);
    EXPECT_EQ(c.model_type, "mistral");
    EXPECT_EQ(c.hidden_size, 4096);
    EXPECT_EQ(c.num_heads, 32);
    EXPECT_EQ(c.num_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_EQ(c.rope.theta, 10000.0);
    EXPECT_EQ(c.sliding_window, 4096) << "layer " << layer;
    expect_plain_llama_shape(c);
  }
  // Mistral-7B-v0.2 removed the window with an explicit null; an absent key
  // is MistralConfig's default, 4096.
  const AttentionConfig v2 = parse_ok(patched(kMistral7B, {{"sliding_window", nullptr}}));
  EXPECT_EQ(v2.sliding_window, 0);
  EXPECT_EQ(parse_ok(without(kMistral7B, "sliding_window")).sliding_window, 4096);
}

TEST(HfConfig, Qwen25_7BQkvBiasNoWindow) {
  const AttentionConfig c = parse_ok(kQwen25_7B, 27);
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.hidden_size, 3584);
  EXPECT_EQ(c.num_heads, 28);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.qk_norm, attnkit::QkNorm::kNone);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.pairing, RopePairing::kHalfSplit);
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window is false
  // Qwen2Attention hard-codes its biases; attention_bias does not move them.
  for (bool flag : {false, true}) {
    const AttentionConfig q = parse_ok(patched(kQwen25_7B, {{"attention_bias", flag}}));
    EXPECT_TRUE(q.qkv_bias);
    EXPECT_FALSE(q.o_bias);
  }
}

TEST(HfConfig, Qwen2SlidingFromMaxWindowLayers) {
  const std::string text =
      patched(kQwen25_7B,
              {{"use_sliding_window", true}, {"max_window_layers", 20}, {"sliding_window", 32768}});
  EXPECT_EQ(parse_ok(text, 0).sliding_window, 0);
  EXPECT_EQ(parse_ok(text, 19).sliding_window, 0);
  EXPECT_EQ(parse_ok(text, 20).sliding_window, 32768);
  EXPECT_EQ(parse_ok(text, 27).sliding_window, 32768);
}

TEST(HfConfig, Qwen3_8BQkNorm) {
  const AttentionConfig c = parse_ok(kQwen3_8B, 35);
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.qk_norm, attnkit::QkNorm::kRms);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.head_dim, 128);
  EXPECT_EQ(c.sliding_window, 0);
  // head_dim is read, not derived: Qwen3-0.6B has 1024 / 16 = 64 but 128.
  const AttentionConfig small =
      parse_ok(patched(kQwen3_8B, {{"hidden_size", 1024}, {"num_attention_heads", 16}}));
  EXPECT_EQ(small.head_dim, 128);
  // attention_bias covers all four projections.
  const AttentionConfig biased = parse_ok(patched(kQwen3_8B, {{"attention_bias", true}}));
  EXPECT_TRUE(biased.qkv_bias);
  EXPECT_TRUE(biased.o_bias);
}

TEST(HfConfig, Qwen3YarnWithoutMscale) {
  // The Qwen model cards' long-context recipe.
  const AttentionConfig c = parse_ok(patched(
      kQwen3_8B,
      {{"rope_scaling",
        {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}}}}));
  const RopeScaling& s = c.rope.scaling;
  EXPECT_EQ(s.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(s.factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 32768);
  EXPECT_EQ(s.beta_fast, 32.0);
  EXPECT_EQ(s.beta_slow, 1.0);
  EXPECT_EQ(s.mscale, 0.0);
  EXPECT_EQ(s.mscale_all_dim, 0.0);
  auto rope = attnkit::Rope::create(c.rope);
  ASSERT_TRUE(rope.ok());
  EXPECT_NEAR(rope->attention_factor(), 1.0 + 0.1 * std::log(4.0), 1e-15);
  // Legacy "type" key, beta given as 0 (transformers' `or 32`), and the
  // pre-extension length falling back to max_position_embeddings.
  const AttentionConfig legacy = parse_ok(
      patched(kQwen3_8B, {{"rope_scaling", {{"type", "yarn"}, {"factor", 2}, {"beta_fast", 0}}}}));
  EXPECT_EQ(legacy.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(legacy.rope.scaling.factor, 2.0);
  EXPECT_EQ(legacy.rope.scaling.beta_fast, 32.0);
  EXPECT_EQ(legacy.rope.scaling.original_max_position_embeddings, 40960);
}

TEST(HfConfig, YarnTruncateFalseIsKept) {
  // gpt-oss's "truncate": false keeps YaRN's correction range fractional.
  const AttentionConfig c = parse_ok(
      patched(kQwen3_8B,
              {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", false}}}}));
  EXPECT_EQ(c.rope.scaling.type, RopeScaling::Type::kYarn);
  EXPECT_FALSE(c.rope.scaling.truncate);
  EXPECT_TRUE(
      parse_ok(patched(kQwen3_8B, {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}))
          .rope.scaling.truncate);
}

TEST(HfConfig, Gemma2_9BAlternatingWindowsSoftcapScale) {
  for (int64_t layer = 0; layer < 42; ++layer) {
    const AttentionConfig c = parse_ok(kGemma2_9B, layer);
    EXPECT_EQ(c.model_type, "gemma2");
    EXPECT_EQ(c.hidden_size, 3584);
    EXPECT_EQ(c.num_heads, 16);
    EXPECT_EQ(c.num_kv_heads, 8);
    EXPECT_EQ(c.head_dim, 256);  // not 3584 / 16
    EXPECT_EQ(c.rope.head_dim, 256);
    EXPECT_FALSE(c.qkv_bias);
    EXPECT_FALSE(c.o_bias);
    EXPECT_EQ(c.qk_norm, attnkit::QkNorm::kNone);
    EXPECT_EQ(c.softcap, 50.0f);
    EXPECT_EQ(c.softmax_scale, 1.0f / 16.0f);  // 256^-0.5
    EXPECT_EQ(c.rope.theta, 10000.0);
    EXPECT_EQ(c.rms_norm_eps, 1e-6);
    EXPECT_EQ(c.sliding_window, layer % 2 == 0 ? 4096 : 0) << "layer " << layer;
  }
  // Gemma-2-27B: query_pre_attn_scalar 144 with head_dim 128.
  const AttentionConfig big =
      parse_ok(patched(kGemma2_9B, {{"head_dim", 128}, {"query_pre_attn_scalar", 144}}));
  EXPECT_EQ(big.softmax_scale, static_cast<float>(1.0 / 12.0));
}

TEST(HfConfig, LayerTypesTakePrecedence) {
  // Every fourth layer full, the rest sliding, overriding Gemma-2's even/odd.
  nlohmann::json types = nlohmann::json::array();
  for (int i = 0; i < 42; ++i) types.push_back(i % 4 == 3 ? "full_attention" : "sliding_attention");
  const std::string text = patched(kGemma2_9B, {{"layer_types", types}});
  for (int64_t layer = 0; layer < 42; ++layer)
    EXPECT_EQ(parse_ok(text, layer).sliding_window, layer % 4 == 3 ? 0 : 4096) << layer;
  // ... and switches a window on for a family that has no rule of its own.
  nlohmann::json one = nlohmann::json::array();
  for (int i = 0; i < 32; ++i) one.push_back(i == 5 ? "sliding_attention" : "full_attention");
  const std::string llama = patched(kLlama3_8B, {{"layer_types", one}, {"sliding_window", 1024}});
  EXPECT_EQ(parse_ok(llama, 5).sliding_window, 1024);
  EXPECT_EQ(parse_ok(llama, 6).sliding_window, 0);
}

TEST(HfConfig, UnsupportedModelTypesAreRejectedByName) {
  // Families the layer does not implement must not be read through the
  // llama rules into a layer that is not theirs.
  for (const char* type : {"gpt2", "bert", "falcon", "gemma", "granite_like"}) {
    auto r = attnkit::attention_config_from_json(patched(kLlama3_8B, {{"model_type", type}}));
    ASSERT_FALSE(r.ok()) << type;
    EXPECT_NE(r.status().message().find("model_type = \"" + std::string(type) +
                                        "\" is not supported; accepted: \"llama\""),
              std::string::npos)
        << r.status().message();
  }
  // A multimodal wrapper is read through its text_config, which must be there.
  auto wrapper =
      attnkit::attention_config_from_json(patched(kLlama3_8B, {{"model_type", "gemma3"}}));
  ASSERT_FALSE(wrapper.ok());
  EXPECT_NE(wrapper.status().message().find("text_config is missing"), std::string::npos)
      << wrapper.status().message();
  for (const char* type :
       {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2"})
    EXPECT_EQ(parse_ok(patched(kLlama3_8B, {{"model_type", type}})).model_type, type);
}

TEST(HfConfig, LlamaRulesForBiasRotaryFactorAndRopeBlocks) {
  const AttentionConfig c = parse_ok(
      patched(kLlama3_8B,
              {{"attention_bias", true}, {"partial_rotary_factor", 0.5}, {"rope_theta", 25000}}));
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_EQ(c.rope.rotary_dim, 64);
  EXPECT_EQ(c.rope.theta, 25000.0);
  // Linear scaling and HF v5's rope_parameters block (theta inside).
  const AttentionConfig lin = parse_ok(patched(
      kLlama3_8B,
      {{"rope_scaling", nullptr},
       {"rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1e5}}}}));
  EXPECT_EQ(lin.rope.scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(lin.rope.scaling.factor, 2.0);
  EXPECT_EQ(lin.rope.theta, 1e5);
  const AttentionConfig def =
      parse_ok(patched(kLlama3_8B, {{"rope_scaling", {{"rope_type", "default"}}}}));
  EXPECT_EQ(def.rope.scaling.type, RopeScaling::Type::kNone);
  // Missing num_key_value_heads means MHA; missing model_type is fine.
  const AttentionConfig mha =
      parse_ok(patched(kLlama3_8B, {{"num_key_value_heads", nullptr}, {"model_type", nullptr}}));
  EXPECT_EQ(mha.num_kv_heads, 32);
  EXPECT_EQ(mha.model_type, "");
}

// ---------------------------------------------------------------- bad configs

void expect_error(std::string_view text, const std::string& needle, int64_t layer = 0) {
  auto r = attnkit::attention_config_from_json(text, layer);
  ASSERT_FALSE(r.ok()) << "accepted a config that should mention " << needle << ": " << text;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind("attention_config_from_json: ", 0), 0u) << m;
  EXPECT_NE(m.find(needle), std::string::npos)
      << "message does not mention " << needle << ": " << m;
}

TEST(HfConfigErrors, MalformedJsonReportsThePosition) {
  // The second comma is byte 22 (1-based).
  expect_error("{\"hidden_size\": 4096,, }", "(byte 22): parse error at line 1, column 22");
  // A missing comma: nlohmann points at the end of the unexpected token.
  expect_error("{\n  \"hidden_size\": 4096\n  \"num_attention_heads\": 32\n}", "line 3, column 23");
  expect_error("", "not valid JSON");
  expect_error(kLlama3_8B.substr(0, 100), "not valid JSON");
  expect_error("[1, 2]", "top level must be a JSON object");
  expect_error("42", "top level");
}

TEST(HfConfigErrors, MissingRequiredFields) {
  expect_error(without(kLlama3_8B, "hidden_size"), "required field hidden_size is missing");
  expect_error(without(kLlama3_8B, "num_attention_heads"),
               "required field num_attention_heads is missing");
  expect_error(patched(kLlama3_8B, {{"num_attention_heads", nullptr}}),
               "required field num_attention_heads is null");
}

TEST(HfConfigErrors, WrongJsonTypes) {
  const std::pair<nlohmann::json, std::string> cases[] = {
      {{{"hidden_size", "4096"}}, "hidden_size = \"4096\" must be an integer"},
      {{{"num_attention_heads", 32.5}}, "num_attention_heads = 32.5 must be an integer"},
      {{{"num_key_value_heads", true}}, "num_key_value_heads = true must be an integer"},
      {{{"head_dim", {1, 2}}}, "head_dim"},
      {{{"num_hidden_layers", "32"}}, "num_hidden_layers"},
      {{{"attention_bias", "false"}}, "attention_bias = \"false\" must be true or false"},
      {{{"rope_theta", "5e5"}}, "rope_theta = \"5e5\" must be a number"},
      {{{"rms_norm_eps", {{"a", 1}}}}, "rms_norm_eps"},
      {{{"model_type", 7}}, "model_type = 7 must be a string"},
      {{{"rope_scaling", 5}}, "rope_scaling = 5 must be an object or null"},
      {{{"rope_scaling", {{"rope_type", "linear"}, {"factor", "8"}}}}, "rope_scaling.factor"},
      {{{"rope_scaling", {{"rope_type", 3}, {"factor", 8}}}}, "rope_scaling.rope_type"},
      {{{"sliding_window", "4096"}}, "sliding_window"},
      {{{"layer_types", "sliding_attention"}}, "layer_types"},
      {{{"partial_rotary_factor", "half"}}, "partial_rotary_factor"},
      {{{"attn_logit_softcapping", false}}, "attn_logit_softcapping"},
      {{{"query_pre_attn_scalar", "256"}}, "query_pre_attn_scalar"},
      {{{"max_position_embeddings", 1.5}}, "max_position_embeddings"},
  };
  for (const auto& [patch, needle] : cases) {
    SCOPED_TRACE(patch.dump());
    expect_error(patched(kLlama3_8B, patch), needle);
  }
  // Integers past int64 and integral floats.
  std::string huge(kLlama3_8B);
  huge.replace(huge.find("\"hidden_size\": 4096"), 19, "\"hidden_size\": 18446744073709551615");
  expect_error(huge, "does not fit in 64 bits");
  const AttentionConfig integral = parse_ok(patched(kLlama3_8B, {{"hidden_size", 4096.0}}));
  EXPECT_EQ(integral.hidden_size, 4096);
}

TEST(HfConfigErrors, InconsistentOrOutOfRangeSizes) {
  expect_error(patched(kLlama3_8B, {{"num_key_value_heads", 6}}),
               "num_key_value_heads = 6 must divide num_attention_heads = 32");
  expect_error(patched(kLlama3_8B, {{"hidden_size", -4096}}),
               "hidden_size = -4096 must be in [1, ");
  expect_error(patched(kLlama3_8B, {{"num_attention_heads", 0}}), "num_attention_heads = 0");
  expect_error(patched(kLlama3_8B, {{"num_key_value_heads", -8}}), "num_key_value_heads = -8");
  expect_error(patched(kLlama3_8B, {{"head_dim", -1}}), "head_dim = -1");
  expect_error(patched(kLlama3_8B, {{"hidden_size", int64_t{1} << 40}}), "hidden_size");
  expect_error(patched(kLlama3_8B, {{"num_hidden_layers", 0}}), "num_hidden_layers = 0");
  expect_error(patched(kLlama3_8B, {{"max_position_embeddings", -1}}),
               "max_position_embeddings = -1");
  expect_error(patched(kLlama3_8B, {{"hidden_size", 4100}}),
               "head_dim is not given and hidden_size = 4100 is not divisible");
  expect_error(patched(kLlama3_8B, {{"sliding_window", -5}}), "sliding_window = -5");
  expect_error(patched(kGemma2_9B, {{"query_pre_attn_scalar", 0}}), "query_pre_attn_scalar = 0");
  expect_error(patched(kGemma2_9B, {{"attn_logit_softcapping", -50}}),
               "attn_logit_softcapping = -50");
  expect_error(patched(kLlama3_8B, {{"partial_rotary_factor", 1.5}}),
               "partial_rotary_factor = 1.5");
  // 64 * 0.33 = 21.12 -> 21 rotary features: odd.
  expect_error(patched(kLlama3_8B, {{"head_dim", 64}, {"partial_rotary_factor", 0.33}}),
               "partial_rotary_factor = 0.33");
  expect_error(patched(kLlama3_8B, {{"rope_theta", 1}}), "theta = 1 must be finite and > 1");
  expect_error(patched(kLlama3_8B, {{"rms_norm_eps", 0}}), "rms_norm_eps = 0");
}

TEST(HfConfigErrors, LayerIndexOutOfRange) {
  expect_error(kLlama3_8B, "layer_index = -1 must be in [0, num_hidden_layers = 32)", -1);
  expect_error(kLlama3_8B, "layer_index = 32 must be in [0, num_hidden_layers = 32)", 32);
  // Without num_hidden_layers only negatives are out of range.
  EXPECT_TRUE(
      attnkit::attention_config_from_json(without(kLlama3_8B, "num_hidden_layers"), 1000).ok());
}

TEST(HfConfigErrors, BadRopeScaling) {
  auto with = [](nlohmann::json rs) { return patched(kLlama3_8B, {{"rope_scaling", rs}}); };
  expect_error(with({{"rope_type", "dynamic"}, {"factor", 2.0}}),
               "rope_scaling.rope_type = \"dynamic\" is not supported; accepted: \"default\"");
  expect_error(with({{"type", "longrope"}, {"factor", 2.0}}), "rope_scaling.type = \"longrope\"");
  expect_error(with({{"rope_type", "su"}}), "\"su\" is not supported");
  expect_error(with({{"rope_type", "linear"}}), "required field rope_scaling.factor is missing");
  expect_error(with({{"rope_type", "llama3"},
                     {"factor", 8.0},
                     {"low_freq_factor", 1.0},
                     {"original_max_position_embeddings", 8192}}),
               "rope_scaling.high_freq_factor is missing");
  expect_error(with({{"rope_type", "llama3"},
                     {"factor", 8.0},
                     {"low_freq_factor", 4.0},
                     {"high_freq_factor", 1.0},
                     {"original_max_position_embeddings", 8192}}),
               "scaling.high_freq_factor = 1 must be finite and > scaling.low_freq_factor = 4");
  expect_error(with({{"rope_type", "llama3"},
                     {"factor", 0.5},
                     {"low_freq_factor", 1.0},
                     {"high_freq_factor", 4.0},
                     {"original_max_position_embeddings", 8192}}),
               "scaling.factor = 0.5");
  expect_error(with({{"rope_type", "linear"}, {"factor", -2}}), "scaling.factor = -2");
  expect_error(with({{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", "no"}}),
               "rope_scaling.truncate = \"no\" must be true or false");
  expect_error(with({{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 0.5}, {"beta_slow", 2}}),
               "scaling.beta_fast = 0.5");
  expect_error(patched(without(kLlama3_8B, "max_position_embeddings"),
                       {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}),
               "original_max_position_embeddings is missing and so is max_position_embeddings");
}

TEST(HfConfigErrors, BadWindows) {
  nlohmann::json types = nlohmann::json::array();
  for (int i = 0; i < 32; ++i) types.push_back("sliding_attention");
  expect_error(patched(kLlama3_8B, {{"layer_types", types}}),
               "layer 0 uses sliding-window attention but sliding_window is missing");
  expect_error(patched(kMistral7B, {{"layer_types", types}, {"sliding_window", nullptr}}),
               "sliding_window is null");
  types[3] = "linear_attention";
  expect_error(patched(kMistral7B, {{"layer_types", types}}),
               "layer_types[3] = \"linear_attention\" must be", 3);
  types.erase(types.begin());
  expect_error(patched(kMistral7B, {{"layer_types", types}}),
               "layer_types has 31 entries, must have num_hidden_layers = 32");
  // Qwen2Config: use_sliding_window with a null window slides nowhere.
  EXPECT_EQ(parse_ok(patched(kQwen25_7B, {{"use_sliding_window", true},
                                          {"sliding_window", nullptr},
                                          {"max_window_layers", 0}}),
                     5)
                .sliding_window,
            0);
}

TEST(HfConfigErrors, MlaConfigIsRedirected) {
  expect_error(patched(kLlama3_8B, {{"model_type", "deepseek_v3"}, {"kv_lora_rank", 512}}),
               "mla_config_from_json");
}

TEST(HfConfigErrors, NothingThrowsOnTruncatedOrRetypedInput) {
  // Every prefix of a real config, and every top-level field replaced by
  // every JSON type: each call returns (ok or InvalidArgument), none throws.
  const std::string_view base = kLlama31_8B;
  for (size_t n = 0; n < base.size(); ++n) {
    auto r = attnkit::attention_config_from_json(base.substr(0, n));
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes parsed";
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  const nlohmann::json values[] = {
      nullptr, true, "x", nlohmann::json::array(), nlohmann::json::object(), -1, 0, 1.5, 1e300, 7};
  const nlohmann::json j = nlohmann::json::parse(base);
  for (const auto& [key, unused] : j.items()) {
    for (const auto& v : values) {
      nlohmann::json m = j;
      m[key] = v;
      auto r = attnkit::attention_config_from_json(m.dump(), 3);
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
        EXPECT_NE(r.status().message().find(key == "rope_theta" ? "theta" : key), std::string::npos)
            << key << " = " << v.dump() << ": " << r.status().message();
      }
    }
  }
}

// ---------------------------------------------------------------- validate

TEST(HfConfigValidate, ChecksEveryInvariant) {
  AttentionConfig good = parse_ok(kLlama31_8B);
  ASSERT_TRUE(attnkit::validate(good).ok());
  EXPECT_FALSE(attnkit::validate(AttentionConfig{}).ok());
  auto expect_bad = [&](auto mutate, const std::string& needle) {
    AttentionConfig c = good;
    mutate(c);
    const auto st = attnkit::validate(c);
    ASSERT_FALSE(st.ok()) << needle;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message().rfind("AttentionConfig: ", 0), 0u) << st.message();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  expect_bad([](AttentionConfig& c) { c.hidden_size = 0; }, "hidden_size = 0");
  expect_bad([](AttentionConfig& c) { c.num_heads = -1; }, "num_heads = -1");
  expect_bad([](AttentionConfig& c) { c.num_kv_heads = 0; }, "num_kv_heads = 0");
  expect_bad([](AttentionConfig& c) { c.num_kv_heads = 5; }, "num_kv_heads = 5 must divide");
  expect_bad([](AttentionConfig& c) { c.head_dim = (int64_t{1} << 20) + 1; }, "head_dim");
  expect_bad([](AttentionConfig& c) { c.rms_norm_eps = NAN; }, "rms_norm_eps");
  expect_bad([](AttentionConfig& c) { c.sliding_window = -1; }, "sliding_window = -1");
  expect_bad([](AttentionConfig& c) { c.softcap = -1.0f; }, "softcap");
  expect_bad([](AttentionConfig& c) { c.softcap = INFINITY; }, "softcap");
  expect_bad([](AttentionConfig& c) { c.softmax_scale = -0.5f; }, "softmax_scale");
  expect_bad([](AttentionConfig& c) { c.rope.head_dim = 64; }, "rope.head_dim = 64");
  expect_bad([](AttentionConfig& c) { c.rope.theta = 0.5; }, "rope: Rope::create: theta");
  expect_bad([](AttentionConfig& c) { c.rope.rotary_dim = 129; }, "rotary_dim");
  // Without RoPE the rope block is not consulted.
  AttentionConfig no_rope = good;
  no_rope.use_rope = false;
  no_rope.rope.theta = 0.5;
  EXPECT_TRUE(attnkit::validate(no_rope).ok());
}

// ---------------------------------------------------------------- variants

TEST(HfConfigVariant, MhaMqaGqa) {
  struct Case {
    const char* variant;
    int64_t kv_heads;
  };
  for (const Case& v : {Case{"mha", 8}, Case{"mqa", 1}, Case{"gqa-2", 2}, Case{"gqa-4", 4},
                        Case{"gqa-8", 8}, Case{"gqa-1", 1}}) {
    SCOPED_TRACE(v.variant);
    auto r = attnkit::attention_config_from_variant(v.variant, 512, 8);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->hidden_size, 512);
    EXPECT_EQ(r->num_heads, 8);
    EXPECT_EQ(r->num_kv_heads, v.kv_heads);
    EXPECT_EQ(r->head_dim, 64);
    EXPECT_TRUE(r->qkv_bias);
    EXPECT_TRUE(r->o_bias);
    EXPECT_EQ(r->qk_norm, attnkit::QkNorm::kNone);
    EXPECT_FALSE(r->use_rope);
    EXPECT_FALSE(r->causal);
    EXPECT_EQ(r->sliding_window, 0);
    EXPECT_EQ(r->softcap, 0.0f);
    EXPECT_EQ(r->softmax_scale, 0.0f);
    EXPECT_TRUE(attnkit::validate(*r).ok());
  }
  auto nobias = attnkit::attention_config_from_variant("gqa-2", 64, 4, false);
  ASSERT_TRUE(nobias.ok());
  EXPECT_FALSE(nobias->qkv_bias);
  EXPECT_FALSE(nobias->o_bias);
  EXPECT_EQ(nobias->head_dim, 16);
}

TEST(HfConfigVariant, RejectsBadVariantsAndSizes) {
  auto expect_bad = [](std::string_view variant, int64_t d, int64_t h, const std::string& needle) {
    auto r = attnkit::attention_config_from_variant(variant, d, h);
    ASSERT_FALSE(r.ok()) << variant << " " << d << " " << h;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind("attention_config_from_variant: ", 0), 0u)
        << r.status().message();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  const std::string forms = "is not one of \"mha\", \"mqa\", \"gqa-N\"";
  for (std::string_view v : {"", "MHA", "gqa", "gqa2", "mla", "mha ", "gqa-+2", "gqa--1"})
    expect_bad(v, 512, 8, v.starts_with("gqa-") ? "N in gqa-N" : forms);
  const std::string n_rule = "N in gqa-N must be a whole number with 1 <= N <= num_heads = 8";
  for (std::string_view v : {"gqa-", "gqa-0", "gqa-3", "gqa-16", "gqa-2x", "gqa-1.0", "gqa- 2",
                             "gqa-99999999999999999999"})
    expect_bad(v, 512, 8, n_rule);
  expect_bad("mha", 500, 8, "d_model = 500 must be divisible by num_heads = 8");
  expect_bad("mha", 512, 0, "num_heads = 0");
  expect_bad("mha", 0, 8, "d_model = 0");
  expect_bad("mqa", -64, 8, "d_model = -64");
}

}  // namespace
