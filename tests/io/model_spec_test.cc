// model_spec_from_json on the published config.json of each family
// (tests/data/configs/, sources in its README.md): per-layer kinds, windows,
// chunks, RoPE bases, every default the reader applies, a wrapper's
// text_config, every bad input the reader refuses, and the older readers
// (attention / MLA / MoE / model shape) agreeing with the spec they derive
// from.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>

#include "attnkit/analysis.h"
#include "attnkit/config.h"
#include "attnkit/model_spec.h"

namespace attnkit {
namespace {

using nlohmann::json;

json load(const std::string& name) {
  const std::string path = std::string(ATTNKIT_TEST_DATA_DIR) + "/configs/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

// Llama 4 Scout as published (its llama3 RoPE scaling has equal band
// factors, 1 and 1).
json scout() { return load("Llama-4-Scout-17B-16E.json"); }

ModelSpec spec_ok(const json& j) {
  auto r = model_spec_from_json(j.dump());
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : ModelSpec{};
}

void expect_error(const json& j, const std::string& needle) {
  auto r = model_spec_from_json(j.dump());
  ASSERT_FALSE(r.ok()) << "accepted; wanted an error naming " << needle;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind("model_spec_from_json: ", 0), 0u) << m;
  EXPECT_NE(m.find(needle), std::string::npos) << "message does not name " << needle << ": " << m;
}

// ---------------------------------------------------------------- gpt-oss

void expect_gpt_oss(const ModelSpec& s, int64_t layers, int64_t experts) {
  EXPECT_EQ(s.model_type, "gpt_oss");
  EXPECT_EQ(s.wrapper_model_type, "");
  ASSERT_EQ(s.num_layers, layers);
  ASSERT_EQ(static_cast<int64_t>(s.layers.size()), layers);
  EXPECT_EQ(s.hidden_size, 2880);
  EXPECT_EQ(s.vocab_size, 201088);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.quantization.quant_method, "mxfp4");
  EXPECT_EQ(s.quantization.modules_not_to_convert,
            (std::vector<std::string>{"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                      "model.embed_tokens", "lm_head"}));
  for (int64_t i = 0; i < layers; ++i) {
    SCOPED_TRACE(i);
    const LayerSpec& l = s.layers[static_cast<size_t>(i)];
    ASSERT_EQ(l.kind, LayerKind::kAttention);
    const AttentionConfig& a = l.attention;
    EXPECT_EQ(a.sliding_window, i % 2 == 0 ? 128 : 0);  // even layers slide
    EXPECT_EQ(a.chunk_size, 0);
    EXPECT_EQ(a.num_heads, 64);
    EXPECT_EQ(a.num_kv_heads, 8);
    EXPECT_EQ(a.head_dim, 64);
    EXPECT_TRUE(a.sinks);
    EXPECT_TRUE(a.qkv_bias);
    EXPECT_TRUE(a.o_bias);
    EXPECT_EQ(a.qk_norm, QkNorm::kNone);
    EXPECT_TRUE(a.use_rope);
    EXPECT_EQ(a.rope.theta, 150000.0);
    EXPECT_EQ(a.rope.pairing, RopePairing::kHalfSplit);
    EXPECT_EQ(a.rope.scaling.type, RopeScaling::Type::kYarn);
    EXPECT_EQ(a.rope.scaling.factor, 32.0);
    EXPECT_EQ(a.rope.scaling.original_max_position_embeddings, 4096);
    EXPECT_FALSE(a.rope.scaling.truncate);
    ASSERT_EQ(l.ffn.kind, FeedForwardKind::kMoe);
    const MoeConfig& m = l.ffn.moe;
    EXPECT_EQ(m.naming, MoeWeightNaming::kGptOss);
    EXPECT_EQ(m.activation, MoeActivation::kGptOssSwiGlu);
    EXPECT_EQ(m.n_routed_experts, experts);
    EXPECT_EQ(m.num_experts_per_tok, 4);
    EXPECT_EQ(m.moe_intermediate_size, 2880);
    EXPECT_EQ(m.swiglu_limit, 7.0);
    EXPECT_TRUE(m.router_bias);
    EXPECT_TRUE(m.expert_bias);
    EXPECT_TRUE(m.norm_topk_prob);
    EXPECT_EQ(m.n_shared_experts, 0);
  }
}

TEST(ModelSpec, GptOss20bAnd120b) {
  expect_gpt_oss(spec_ok(load("gpt-oss-20b.json")), 24, 32);
  expect_gpt_oss(spec_ok(load("gpt-oss-120b.json")), 36, 128);
}

TEST(ModelSpec, GptOssDefaults) {
  // GptOssConfig: layer_types (even layers slide), window 128, the YaRN
  // block, top-k under its original name, swiglu_limit 7, attention biases.
  json j = load("gpt-oss-20b.json");
  for (const char* key : {"layer_types", "sliding_window", "rope_scaling", "num_experts_per_tok",
                          "swiglu_limit", "attention_bias", "rope_theta"})
    j.erase(key);
  expect_gpt_oss(spec_ok(j), 24, 32);
  // quantization_config is recorded, never refused, whatever its shape.
  for (const json& q : {json("mxfp4"), json::array(), json{{"quant_method", 4}}}) {
    json k = load("gpt-oss-20b.json");
    k["quantization_config"] = q;
    EXPECT_EQ(spec_ok(k).quantization.quant_method, "");
  }
}

// ---------------------------------------------------------------- Gemma 3

void expect_gemma3_layers(const ModelSpec& s, int64_t pattern, int64_t window) {
  for (int64_t i = 0; i < s.num_layers; ++i) {
    SCOPED_TRACE(i);
    const AttentionConfig& a = s.layers[static_cast<size_t>(i)].attention;
    ASSERT_EQ(s.layers[static_cast<size_t>(i)].kind, LayerKind::kAttention);
    const bool local = (i + 1) % pattern != 0;
    EXPECT_EQ(a.sliding_window, local ? window : 0);
    EXPECT_EQ(a.qk_norm, QkNorm::kRmsOnePlus);
    EXPECT_EQ(a.softcap, 0.0f);  // attn_logit_softcapping is null in Gemma 3
    EXPECT_FALSE(a.qkv_bias);
    // Local layers: rope_local_base_freq, unscaled; global: rope_theta with
    // the linear factor 8.
    EXPECT_EQ(a.rope.theta, local ? 10000.0 : 1e6);
    EXPECT_EQ(a.rope.scaling.type, local ? RopeScaling::Type::kNone : RopeScaling::Type::kLinear);
    if (!local) {
      EXPECT_EQ(a.rope.scaling.factor, 8.0);
    }
    EXPECT_EQ(s.layers[static_cast<size_t>(i)].ffn.kind, FeedForwardKind::kDense);
    EXPECT_EQ(s.layers[static_cast<size_t>(i)].ffn.hidden_act, "gelu_pytorch_tanh");
  }
}

TEST(ModelSpec, Gemma3_4bAsReleased) {
  // The wrapper's text_config names six fields; Gemma3TextConfig's defaults
  // fill the rest (8 heads, 4 kv heads, head_dim 256, pattern 6, ...).
  const ModelSpec s = spec_ok(load("gemma-3-4b-it.json"));
  EXPECT_EQ(s.wrapper_model_type, "gemma3");
  EXPECT_EQ(s.model_type, "gemma3_text");
  ASSERT_EQ(s.num_layers, 34);
  EXPECT_EQ(s.hidden_size, 2560);
  EXPECT_EQ(s.vocab_size, 262208);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.rms_norm_eps, 1e-6);
  const AttentionConfig& a = s.layers[0].attention;
  EXPECT_EQ(a.num_heads, 8);
  EXPECT_EQ(a.num_kv_heads, 4);
  EXPECT_EQ(a.head_dim, 256);
  EXPECT_EQ(a.softmax_scale, 1.0f / 16.0f);  // query_pre_attn_scalar 256
  EXPECT_EQ(s.layers[0].ffn.intermediate_size, 10240);
  expect_gemma3_layers(s, 6, 1024);
  EXPECT_EQ(s.layers[5].attention.sliding_window, 0);
  EXPECT_EQ(s.layers[4].attention.sliding_window, 1024);
}

TEST(ModelSpec, Gemma3_27bAndTheTextModelAlone) {
  const ModelSpec s = spec_ok(load("gemma-3-27b-it.json"));
  ASSERT_EQ(s.num_layers, 62);
  const AttentionConfig& a = s.layers[0].attention;
  EXPECT_EQ(a.num_heads, 32);
  EXPECT_EQ(a.num_kv_heads, 16);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.softmax_scale, static_cast<float>(1.0 / std::sqrt(168.0)));
  expect_gemma3_layers(s, 6, 1024);
  // The text model's config on its own (Gemma3ForCausalLM), another pattern.
  json text = load("gemma-3-27b-it.json")["text_config"];
  text["sliding_window_pattern"] = 2;
  const ModelSpec alone = spec_ok(text);
  EXPECT_EQ(alone.wrapper_model_type, "");
  expect_gemma3_layers(alone, 2, 1024);
  // layer_types, when given, decides.
  json types = json::array();
  for (int i = 0; i < 62; ++i) types.push_back(i < 60 ? "sliding_attention" : "full_attention");
  text["layer_types"] = types;
  const ModelSpec listed = spec_ok(text);
  EXPECT_EQ(listed.layers[59].attention.sliding_window, 1024);
  EXPECT_EQ(listed.layers[60].attention.sliding_window, 0);
  // Hugging Face v5 writes one rope block per layer type.
  text.erase("rope_scaling");
  text["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 20000.0}}}};
  const ModelSpec v5 = spec_ok(text);
  EXPECT_EQ(v5.layers[0].attention.rope.theta, 20000.0);
  EXPECT_EQ(v5.layers[0].attention.rope.scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(v5.layers[60].attention.rope.theta, 1e6);
  EXPECT_EQ(v5.layers[60].attention.rope.scaling.type, RopeScaling::Type::kLinear);
}

// ---------------------------------------------------------------- Llama 4

void expect_scout_layers(const ModelSpec& s) {
  for (int64_t i = 0; i < s.num_layers; ++i) {
    SCOPED_TRACE(i);
    const AttentionConfig& a = s.layers[static_cast<size_t>(i)].attention;
    const bool rope = (i + 1) % 4 != 0;
    EXPECT_EQ(a.use_rope, rope);
    EXPECT_EQ(a.chunk_size, rope ? 8192 : 0);  // RoPE layers chunked, NoPE layers global
    EXPECT_EQ(a.sliding_window, 0);
    EXPECT_EQ(a.qk_norm, rope ? QkNorm::kL2 : QkNorm::kNone);
    EXPECT_EQ(a.temperature_tuning, !rope);
    EXPECT_EQ(a.floor_scale, 8192.0);
    EXPECT_EQ(a.attn_scale, 0.1);
    EXPECT_EQ(a.rope.pairing, RopePairing::kInterleaved);
  }
}

TEST(ModelSpec, Llama4ScoutWrapper) {
  const ModelSpec s = spec_ok(load("Llama-4-Scout-17B-16E.json"));
  EXPECT_EQ(s.wrapper_model_type, "llama4");
  EXPECT_EQ(s.model_type, "llama4_text");
  ASSERT_EQ(s.num_layers, 48);
  EXPECT_EQ(s.max_position_embeddings, 10485760);
  expect_scout_layers(s);
  const AttentionConfig& a = s.layers[0].attention;
  EXPECT_EQ(a.num_heads, 40);
  EXPECT_EQ(a.num_kv_heads, 8);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.rope.theta, 500000.0);
  EXPECT_EQ(a.rope.scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(a.rope.scaling.factor, 16.0);
  for (const LayerSpec& l : s.layers) {
    ASSERT_EQ(l.ffn.kind, FeedForwardKind::kMoe);
    EXPECT_EQ(l.ffn.moe.naming, MoeWeightNaming::kLlama4);
    EXPECT_EQ(l.ffn.moe.n_routed_experts, 16);
    EXPECT_EQ(l.ffn.moe.num_experts_per_tok, 1);
    EXPECT_EQ(l.ffn.moe.moe_intermediate_size, 8192);
    EXPECT_EQ(l.ffn.moe.n_shared_experts, 1);
    EXPECT_EQ(l.ffn.moe.scoring_func, MoeScoringFunc::kSigmoid);
    EXPECT_FALSE(l.ffn.moe.norm_topk_prob);
  }
}

TEST(ModelSpec, Llama4Defaults) {
  json j = scout();
  json& t = j["text_config"];
  // Absent or empty no_rope_layers: NoPE on every 4th layer; absent
  // attention_chunk_size 8192, attn_temperature_tuning true, use_qk_norm
  // true, floor_scale 8192, attn_scale 0.1.
  for (const char* key : {"attention_chunk_size", "attn_temperature_tuning", "use_qk_norm",
                          "floor_scale", "attn_scale", "moe_layers"})
    t.erase(key);
  t["no_rope_layers"] = json::array();
  expect_scout_layers(spec_ok(j));
  t.erase("no_rope_layers");
  expect_scout_layers(spec_ok(j));
  // interleave_moe_layer_step 2: odd layers MoE, the others dense MLPs of
  // intermediate_size_mlp.
  t["interleave_moe_layer_step"] = 2;
  const ModelSpec s = spec_ok(j);
  for (int64_t i = 0; i < 48; ++i) {
    const FeedForwardSpec& f = s.layers[static_cast<size_t>(i)].ffn;
    EXPECT_EQ(f.kind, i % 2 == 1 ? FeedForwardKind::kMoe : FeedForwardKind::kDense) << i;
    if (i % 2 == 0) {
      EXPECT_EQ(f.intermediate_size, 16384);
    }
  }
  // An explicit no_rope_layers list is taken as given.
  json rope = json::array();
  for (int i = 0; i < 48; ++i) rope.push_back(i == 0 ? 0 : 1);
  t["no_rope_layers"] = rope;
  const ModelSpec listed = spec_ok(j);
  EXPECT_FALSE(listed.layers[0].attention.use_rope);
  EXPECT_TRUE(listed.layers[3].attention.use_rope);
  EXPECT_EQ(listed.layers[3].attention.chunk_size, 8192);
}

// ---------------------------------------------------------------- Qwen3-Next

void expect_qwen3_next(const ModelSpec& s) {
  ASSERT_EQ(s.num_layers, 48);
  for (int64_t i = 0; i < 48; ++i) {
    SCOPED_TRACE(i);
    const LayerSpec& l = s.layers[static_cast<size_t>(i)];
    if ((i + 1) % 4 != 0) {
      ASSERT_EQ(l.kind, LayerKind::kLinearAttention);
      EXPECT_EQ(l.linear.num_k_heads, 16);
      EXPECT_EQ(l.linear.num_v_heads, 32);
      EXPECT_EQ(l.linear.key_head_dim, 128);
      EXPECT_EQ(l.linear.value_head_dim, 128);
      EXPECT_EQ(l.linear.conv_kernel, 4);
      EXPECT_EQ(l.linear.state_values(), 32 * 128 * 128);
      EXPECT_EQ(l.linear.conv_state_values(), 3 * (2 * 16 * 128 + 32 * 128));
    } else {
      ASSERT_EQ(l.kind, LayerKind::kAttention);
      EXPECT_TRUE(l.attention.output_gate);
      EXPECT_EQ(l.attention.qk_norm, QkNorm::kRmsOnePlus);
      EXPECT_EQ(l.attention.num_heads, 16);
      EXPECT_EQ(l.attention.num_kv_heads, 2);
      EXPECT_EQ(l.attention.head_dim, 256);
      EXPECT_EQ(l.attention.rope.rotary_dim, 64);  // 256 * 0.25
      EXPECT_EQ(l.attention.rope.theta, 1e7);
    }
    ASSERT_EQ(l.ffn.kind, FeedForwardKind::kMoe);
    EXPECT_EQ(l.ffn.moe.n_routed_experts, 512);
    EXPECT_EQ(l.ffn.moe.num_experts_per_tok, 10);
    EXPECT_EQ(l.ffn.moe.moe_intermediate_size, 512);
    EXPECT_EQ(l.ffn.moe.n_shared_experts, 1);
    EXPECT_TRUE(l.ffn.moe.norm_topk_prob);
  }
}

TEST(ModelSpec, Qwen3NextHybrid) {
  expect_qwen3_next(spec_ok(load("Qwen3-Next-80B-A3B-Instruct.json")));
  // Defaults: full_attention_interval 4, partial_rotary_factor 0.25, the
  // Gated DeltaNet sizes of Qwen3NextConfig (16 / 32 / 128 / 128 / 4),
  // norm_topk_prob true.
  json j = load("Qwen3-Next-80B-A3B-Instruct.json");
  for (const char* key : {"full_attention_interval", "partial_rotary_factor",
                          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_conv_kernel_dim", "norm_topk_prob"})
    j.erase(key);
  expect_qwen3_next(spec_ok(j));
  // layer_types decides when present; mlp_only_layers makes a layer dense.
  json types = json::array();
  for (int i = 0; i < 48; ++i) types.push_back(i == 0 ? "full_attention" : "linear_attention");
  j["layer_types"] = types;
  j["mlp_only_layers"] = {7};
  const ModelSpec s = spec_ok(j);
  EXPECT_EQ(s.layers[0].kind, LayerKind::kAttention);
  EXPECT_EQ(s.layers[3].kind, LayerKind::kLinearAttention);
  EXPECT_EQ(s.layers[7].ffn.kind, FeedForwardKind::kDense);
  EXPECT_EQ(s.layers[7].ffn.intermediate_size, 5120);
}

// ---------------------------------------------------------------- the older families

TEST(ModelSpec, Qwen2SlidingWindowWithoutMaxWindowLayers) {
  // configuration_qwen2.py: max_window_layers defaults to 28, so this
  // 28-layer model slides nowhere (a reader defaulting it to 0 would slide
  // every layer).
  json j = load("qwen2.5-7b-sliding-no-max-window-layers.json");
  const ModelSpec s = spec_ok(j);
  ASSERT_EQ(s.num_layers, 28);
  for (const LayerSpec& l : s.layers) EXPECT_EQ(l.attention.sliding_window, 0);
  auto shape = model_shape_from_json(j.dump());
  ASSERT_TRUE(shape.ok()) << shape.status().to_string();
  for (const LayerShape& l : shape->layers) EXPECT_EQ(l.sliding_window, 0);
  j["max_window_layers"] = 20;
  const ModelSpec twenty = spec_ok(j);
  for (int64_t i = 0; i < 28; ++i)
    EXPECT_EQ(twenty.layers[static_cast<size_t>(i)].attention.sliding_window, i >= 20 ? 131072 : 0);
  // An absent sliding_window is Qwen2Config's 4096.
  j.erase("sliding_window");
  EXPECT_EQ(spec_ok(j).layers[27].attention.sliding_window, 4096);
}

TEST(ModelSpec, DeepSeekV3) {
  const ModelSpec s = spec_ok(load("DeepSeek-V3.json"));
  ASSERT_EQ(s.num_layers, 61);
  EXPECT_EQ(s.quantization.quant_method, "fp8");
  for (int64_t i = 0; i < 61; ++i) {
    SCOPED_TRACE(i);
    const LayerSpec& l = s.layers[static_cast<size_t>(i)];
    ASSERT_EQ(l.kind, LayerKind::kLatentAttention);
    EXPECT_EQ(l.mla.kv_lora_rank, 512);
    EXPECT_EQ(l.mla.q_lora_rank, 1536);
    EXPECT_EQ(l.mla.qk_rope_head_dim, 64);
    EXPECT_EQ(l.mla.rope_scaling.type, RopeScaling::Type::kYarn);
    // first_k_dense_replace = 3 dense layers, then experts.
    EXPECT_EQ(l.ffn.kind, i < 3 ? FeedForwardKind::kDense : FeedForwardKind::kMoe);
    if (i < 3) {
      EXPECT_EQ(l.ffn.intermediate_size, 18432);
    }
  }
  EXPECT_EQ(s.layers[3].ffn.moe.n_routed_experts, 256);
  EXPECT_EQ(s.layers[3].ffn.moe.topk_method, MoeTopkMethod::kNoauxTc);
  // DeepseekV3Config's default first_k_dense_replace is 3 too; moe_layer_freq 2.
  json j = load("DeepSeek-V3.json");
  j.erase("first_k_dense_replace");
  j["moe_layer_freq"] = 2;
  const ModelSpec f = spec_ok(j);
  EXPECT_EQ(f.layers[3].ffn.kind, FeedForwardKind::kDense);
  EXPECT_EQ(f.layers[4].ffn.kind, FeedForwardKind::kMoe);
  // The derivations answer from the same spec.
  auto mla = mla_config_from_json(load("DeepSeek-V3.json").dump());
  ASSERT_TRUE(mla.ok()) << mla.status().to_string();
  EXPECT_EQ(mla->kv_lora_rank, 512);
  auto moe = moe_config_from_json(load("DeepSeek-V3.json").dump());
  ASSERT_TRUE(moe.ok()) << moe.status().to_string();
  EXPECT_EQ(moe->n_routed_experts, 256);
  EXPECT_EQ(moe->n_shared_experts, 1);
}

TEST(ModelSpec, Llama3_8B) {
  const ModelSpec s = spec_ok(load("Meta-Llama-3-8B.json"));
  ASSERT_EQ(s.num_layers, 32);
  EXPECT_EQ(s.vocab_size, 128256);
  EXPECT_FALSE(s.tie_word_embeddings);
  EXPECT_EQ(s.quantization.quant_method, "");
  for (const LayerSpec& l : s.layers) {
    EXPECT_EQ(l.kind, LayerKind::kAttention);
    EXPECT_EQ(l.attention.sliding_window, 0);
    EXPECT_EQ(l.attention.rope.theta, 500000.0);
    EXPECT_EQ(l.ffn.kind, FeedForwardKind::kDense);
    EXPECT_EQ(l.ffn.intermediate_size, 14336);
    EXPECT_EQ(l.ffn.hidden_act, "silu");
  }
}

TEST(ModelSpec, Gemma2AndMistralDefaults) {
  // Gemma2Config: attn_logit_softcapping 50, query_pre_attn_scalar 256,
  // sliding_window 4096, even layers sliding; MistralConfig: window 4096.
  const json gemma2 = {{"model_type", "gemma2"},   {"hidden_size", 2304},
                       {"num_hidden_layers", 4},   {"num_attention_heads", 8},
                       {"num_key_value_heads", 4}, {"intermediate_size", 9216}};
  const ModelSpec g = spec_ok(gemma2);
  EXPECT_EQ(g.layers[0].attention.softcap, 50.0f);
  EXPECT_EQ(g.layers[0].attention.softmax_scale, 1.0f / 16.0f);
  EXPECT_EQ(g.layers[0].attention.head_dim, 256);
  EXPECT_EQ(g.layers[0].attention.sliding_window, 4096);
  EXPECT_EQ(g.layers[1].attention.sliding_window, 0);
  EXPECT_EQ(g.layers[0].ffn.hidden_act, "gelu_pytorch_tanh");
  json no_cap = gemma2;
  no_cap["attn_logit_softcapping"] = nullptr;
  EXPECT_EQ(spec_ok(no_cap).layers[0].attention.softcap, 0.0f);
  const json mistral = {{"model_type", "mistral"},
                        {"hidden_size", 4096},
                        {"num_hidden_layers", 2},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 8}};
  EXPECT_EQ(spec_ok(mistral).layers[1].attention.sliding_window, 4096);
}

TEST(ModelSpec, RemainingFamilyDefaults) {
  // The config classes' defaults for fields a config leaves out.
  auto base = [](const char* type) {
    return json{{"model_type", type},       {"hidden_size", 1024},
                {"num_hidden_layers", 30},  {"num_attention_heads", 16},
                {"num_key_value_heads", 4}, {"intermediate_size", 2048},
                {"num_experts_per_tok", 2}, {"num_local_experts", 8},
                {"num_experts", 8},         {"moe_intermediate_size", 256}};
  };
  const ModelSpec llama = spec_ok(base("llama"));
  EXPECT_EQ(llama.rms_norm_eps, 1e-6);
  EXPECT_EQ(llama.layers[0].attention.rope.theta, 10000.0);
  EXPECT_EQ(llama.layers[0].attention.head_dim, 64);  // hidden_size / heads
  EXPECT_EQ(llama.layers[0].ffn.kind, FeedForwardKind::kDense);
  const ModelSpec mixtral = spec_ok(base("mixtral"));
  EXPECT_EQ(mixtral.rms_norm_eps, 1e-5);
  EXPECT_EQ(mixtral.layers[0].attention.rope.theta, 1e6);
  EXPECT_EQ(mixtral.layers[0].attention.sliding_window, 0);
  EXPECT_EQ(mixtral.layers[29].ffn.moe.naming, MoeWeightNaming::kMixtral);
  // qwen3: head_dim 128, q/k RMSNorm; with use_sliding_window, layers from
  // max_window_layers = 28 on slide with the 4096 default window.
  json qwen3 = base("qwen3");
  qwen3["use_sliding_window"] = true;
  const ModelSpec q3 = spec_ok(qwen3);
  EXPECT_EQ(q3.layers[0].attention.head_dim, 128);
  EXPECT_EQ(q3.layers[0].attention.qk_norm, QkNorm::kRms);
  EXPECT_EQ(q3.layers[27].attention.sliding_window, 0);
  EXPECT_EQ(q3.layers[28].attention.sliding_window, 4096);
  // qwen2_moe: every layer MoE (decoder_sparse_step 1), no renormalising;
  // qwen3_moe the same; decoder_sparse_step 2 makes odd layers MoE.
  const ModelSpec q2m = spec_ok(base("qwen2_moe"));
  EXPECT_EQ(q2m.layers[0].ffn.kind, FeedForwardKind::kMoe);
  EXPECT_FALSE(q2m.layers[0].ffn.moe.norm_topk_prob);
  EXPECT_TRUE(q2m.layers[0].attention.qkv_bias);
  EXPECT_FALSE(q2m.layers[0].attention.o_bias);
  json q3m = base("qwen3_moe");
  q3m["decoder_sparse_step"] = 2;
  const ModelSpec sparse = spec_ok(q3m);
  EXPECT_EQ(sparse.layers[0].ffn.kind, FeedForwardKind::kDense);
  EXPECT_EQ(sparse.layers[1].ffn.kind, FeedForwardKind::kMoe);
  auto q3m_moe = moe_config_from_json(q3m.dump());
  ASSERT_TRUE(q3m_moe.ok()) << q3m_moe.status().to_string();
  EXPECT_EQ(q3m_moe->naming, MoeWeightNaming::kDeepseek);
  // gpt-oss: rms_norm_eps 1e-5, rope_theta 150000, head_dim 64.
  json oss = load("gpt-oss-20b.json");
  for (const char* key : {"rms_norm_eps", "rope_theta", "head_dim"}) oss.erase(key);
  const ModelSpec o = spec_ok(oss);
  EXPECT_EQ(o.rms_norm_eps, 1e-5);
  EXPECT_EQ(o.layers[0].attention.rope.theta, 150000.0);
  EXPECT_EQ(o.layers[0].attention.head_dim, 64);
  // Llama 4: rope_theta 500000, rms_norm_eps 1e-5, head_dim 128.
  json l4 = scout();
  for (const char* key : {"rope_theta", "rms_norm_eps", "head_dim"}) l4["text_config"].erase(key);
  const ModelSpec s = spec_ok(l4);
  EXPECT_EQ(s.layers[0].attention.rope.theta, 500000.0);
  EXPECT_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_EQ(s.layers[0].attention.head_dim, 128);
  // DeepSeek-V2: first_k_dense_replace 0, 2 shared experts, softmax greedy.
  json v2 = load("DeepSeek-V3.json");
  v2["model_type"] = "deepseek_v2";
  for (const char* key :
       {"first_k_dense_replace", "n_shared_experts", "scoring_func", "topk_method",
        "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group"})
    v2.erase(key);
  const ModelSpec d2 = spec_ok(v2);
  EXPECT_EQ(d2.layers[0].ffn.kind, FeedForwardKind::kMoe);
  EXPECT_EQ(d2.layers[0].ffn.moe.n_shared_experts, 2);
  EXPECT_EQ(d2.layers[0].ffn.moe.scoring_func, MoeScoringFunc::kSoftmax);
  EXPECT_EQ(d2.layers[0].ffn.moe.topk_method, MoeTopkMethod::kGreedy);
  EXPECT_FALSE(d2.layers[0].ffn.moe.norm_topk_prob);
}

// ---------------------------------------------------------------- one integer rule

TEST(ModelSpec, IntegralFloatsAreAcceptedEverywhere) {
  // 4096.0 reads as 4096 in every reader; 4096.5 is refused by every one,
  // naming the field.
  json llama = load("Meta-Llama-3-8B.json");
  llama["hidden_size"] = 4096.0;
  llama["num_hidden_layers"] = 32.0;
  EXPECT_EQ(spec_ok(llama).hidden_size, 4096);
  auto attention = attention_config_from_json(llama.dump(), 31);
  ASSERT_TRUE(attention.ok()) << attention.status().to_string();
  EXPECT_EQ(attention->hidden_size, 4096);
  auto shape = model_shape_from_json(llama.dump());
  ASSERT_TRUE(shape.ok()) << shape.status().to_string();
  EXPECT_EQ(shape->num_layers, 32);
  json v3 = load("DeepSeek-V3.json");
  v3["kv_lora_rank"] = 512.0;
  v3["n_routed_experts"] = 256.0;
  auto mla = mla_config_from_json(v3.dump());
  ASSERT_TRUE(mla.ok()) << mla.status().to_string();
  EXPECT_EQ(mla->kv_lora_rank, 512);
  auto moe = moe_config_from_json(v3.dump());
  ASSERT_TRUE(moe.ok()) << moe.status().to_string();
  EXPECT_EQ(moe->n_routed_experts, 256);

  llama["hidden_size"] = 4096.5;
  expect_error(llama, "hidden_size = 4096.5 must be an integer");
  EXPECT_FALSE(attention_config_from_json(llama.dump()).ok());
  EXPECT_FALSE(model_shape_from_json(llama.dump()).ok());
  v3["kv_lora_rank"] = 512.5;
  auto bad_mla = mla_config_from_json(v3.dump());
  ASSERT_FALSE(bad_mla.ok());
  EXPECT_NE(bad_mla.status().message().find("kv_lora_rank = 512.5"), std::string::npos);
  v3["kv_lora_rank"] = 512;
  v3["n_routed_experts"] = 256.5;
  auto bad_moe = moe_config_from_json(v3.dump());
  ASSERT_FALSE(bad_moe.ok());
  EXPECT_NE(bad_moe.status().message().find("n_routed_experts = 256.5"), std::string::npos);
}

// ---------------------------------------------------------------- bad input

TEST(ModelSpecErrors, LayerTypes) {
  json j = load("gpt-oss-20b.json");
  j["layer_types"].erase(j["layer_types"].begin());
  expect_error(j, "layer_types has 23 entries, must have num_hidden_layers = 24");
  j = load("gpt-oss-20b.json");
  j["layer_types"][5] = "chunked_attention";
  expect_error(j,
               "layer_types[5] = \"chunked_attention\" must be \"full_attention\" or "
               "\"sliding_attention\"");
  j["layer_types"] = "sliding_attention";
  expect_error(j, "layer_types = \"sliding_attention\" must be a list of strings");
  json q = load("Qwen3-Next-80B-A3B-Instruct.json");
  json types = json::array();
  for (int i = 0; i < 48; ++i) types.push_back(i == 2 ? "sliding_attention" : "full_attention");
  q["layer_types"] = types;
  expect_error(q,
               "layer_types[2] = \"sliding_attention\" must be \"full_attention\" or "
               "\"linear_attention\"");
  json g = load("gemma-3-4b-it.json");
  g["text_config"]["layer_types"] = json::array({"full_attention"});
  expect_error(g, "text_config.layer_types has 1 entries");
}

TEST(ModelSpecErrors, FamilyFieldsOfTheWrongType) {
  struct Case {
    const char* file;
    const char* field;
    json value;
    std::string needle;
  };
  const Case cases[] = {
      {"gemma-3-27b-it.json", "sliding_window_pattern", "6",
       "text_config.sliding_window_pattern = \"6\" must be an integer"},
      {"gemma-3-27b-it.json", "sliding_window_pattern", 0,
       "text_config.sliding_window_pattern = 0 must be >= 1"},
      {"gemma-3-27b-it.json", "rope_local_base_freq", "1e4", "text_config.rope_local_base_freq"},
      {"Llama-4-Scout-17B-16E.json", "no_rope_layers", "1110",
       "text_config.no_rope_layers = \"1110\" must be a list"},
      {"Llama-4-Scout-17B-16E.json", "use_qk_norm", "yes",
       "text_config.use_qk_norm = \"yes\" must be true or false"},
      {"Llama-4-Scout-17B-16E.json", "attention_chunk_size", 81.5,
       "text_config.attention_chunk_size = 81.5 must be an integer"},
      {"Llama-4-Scout-17B-16E.json", "moe_layers", json::array({48}),
       "text_config.moe_layers[0] = 48 must be a layer index"},
      {"Qwen3-Next-80B-A3B-Instruct.json", "full_attention_interval", 4.5,
       "full_attention_interval = 4.5 must be an integer"},
      {"Qwen3-Next-80B-A3B-Instruct.json", "linear_num_key_heads", "16", "linear_num_key_heads"},
      {"Qwen3-Next-80B-A3B-Instruct.json", "linear_num_value_heads", 24,
       "linear_num_value_heads = 24 must be a multiple of linear_num_key_heads = 16"},
      {"Qwen3-Next-80B-A3B-Instruct.json", "shared_expert_intermediate_size", 700,
       "shared_expert_intermediate_size = 700"},
      {"gpt-oss-20b.json", "swiglu_limit", "7", "swiglu_limit = \"7\" must be a number"},
      {"gpt-oss-20b.json", "swiglu_alpha", 2.0, "swiglu_alpha = 2 is not supported"},
      {"gpt-oss-20b.json", "sliding_window", -1, "sliding_window = -1"},
      {"DeepSeek-V3.json", "first_k_dense_replace", "3", "first_k_dense_replace"},
      {"DeepSeek-V3.json", "moe_layer_freq", 0, "moe_layer_freq = 0 must be >= 1"},
      {"qwen2.5-7b-sliding-no-max-window-layers.json", "use_sliding_window", 1,
       "use_sliding_window = 1 must be true or false"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.file) + " " + c.field);
    json j = std::string_view(c.file) == "Llama-4-Scout-17B-16E.json" ? scout() : load(c.file);
    json& fields = j.contains("text_config") ? j["text_config"] : j;
    fields[c.field] = c.value;
    expect_error(j, c.needle);
  }
}

TEST(ModelSpecErrors, FieldsThatChangeTheArithmetic) {
  // An unsupported rope type, on a wrapper's text model: named by its path.
  json g = load("gemma-3-4b-it.json");
  g["text_config"]["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  expect_error(g, "text_config.rope_scaling.rope_type = \"dynamic\" is not supported");
  json l = load("Meta-Llama-3-8B.json");
  l["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  expect_error(l, "rope_scaling.rope_type = \"longrope\" is not supported");
  // An unknown model_type is refused by name.
  l["model_type"] = "granite";
  expect_error(l, "model_type = \"granite\" is not supported; accepted: \"llama\"");
}

TEST(ModelSpecErrors, TextConfig) {
  json g = load("gemma-3-4b-it.json");
  g["text_config"] = json::array({1, 2});
  expect_error(g, "text_config = [1,2] must be an object");
  g["text_config"] = "gemma3_text";
  expect_error(g, "text_config = \"gemma3_text\" must be an object");
  g.erase("text_config");
  expect_error(g, "text_config is missing: model_type = \"gemma3\" is a multimodal wrapper");
  json s = load("Llama-4-Scout-17B-16E.json");
  s["text_config"].erase("num_hidden_layers");
  expect_error(s, "required field text_config.num_hidden_layers is missing");
}

TEST(ModelSpecErrors, RequiredFieldsAndJson) {
  json l = load("Meta-Llama-3-8B.json");
  l.erase("num_hidden_layers");
  expect_error(l, "required field num_hidden_layers is missing");
  expect_error(json::array({1}), "the top level must be a JSON object");
  auto r = model_spec_from_json("{\"hidden_size\": 4096,, }");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not valid JSON"), std::string::npos);
}

// ---------------------------------------------------------------- derivations

TEST(ModelSpecDerived, OlderReadersAnswerFromTheSpec) {
  const std::string next = load("Qwen3-Next-80B-A3B-Instruct.json").dump();
  auto linear = attention_config_from_json(next, 0);
  ASSERT_FALSE(linear.ok());
  EXPECT_NE(linear.status().message().find("layer 0 of model_type \"qwen3_next\" is linear "
                                           "attention"),
            std::string::npos)
      << linear.status().message();
  auto full = attention_config_from_json(next, 3);
  ASSERT_TRUE(full.ok()) << full.status().to_string();
  EXPECT_TRUE(full->output_gate);
  // Qwen3-Next's one shared expert (512 wide) is sigmoid-gated.
  auto gated = moe_config_from_json(next);
  ASSERT_TRUE(gated.ok()) << gated.status().to_string();
  EXPECT_TRUE(gated->shared_expert_gate);
  EXPECT_EQ(gated->n_shared_experts * gated->moe_intermediate_size, 512);

  const std::string text = scout().dump();
  const ModelSpec s = spec_ok(scout());
  ASSERT_EQ(s.num_layers, 48);
  for (int64_t layer : {0, 3}) {
    auto a = attention_config_from_json(text, layer);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->use_rope, s.layers[static_cast<size_t>(layer)].attention.use_rope);
    EXPECT_EQ(a->chunk_size, s.layers[static_cast<size_t>(layer)].attention.chunk_size);
  }

  const std::string oss = load("gpt-oss-20b.json").dump();
  auto experts = moe_config_from_json(oss);
  ASSERT_TRUE(experts.ok()) << experts.status().to_string();
  EXPECT_EQ(experts->naming, MoeWeightNaming::kGptOss);
  EXPECT_TRUE(validate(*experts).ok());
  auto shape = model_shape_from_json(oss);
  ASSERT_TRUE(shape.ok()) << shape.status().to_string();
  ASSERT_EQ(shape->layers.size(), 24u);
  EXPECT_EQ(shape->layers[0].sliding_window, 128);
  EXPECT_EQ(shape->layers[1].sliding_window, 0);

  auto dense = moe_config_from_json(load("Meta-Llama-3-8B.json").dump());
  ASSERT_FALSE(dense.ok());
  EXPECT_NE(dense.status().message().find("model_type = \"llama\" has no MoE layer"),
            std::string::npos);
  auto not_mla = mla_config_from_json(load("gpt-oss-20b.json").dump());
  ASSERT_FALSE(not_mla.ok());
  EXPECT_NE(not_mla.status().message().find("has no MLA layer"), std::string::npos);
}

// final_logit_softcapping: Gemma2Config's default 30, off for the others
// (Gemma 3's text_config has none), null turns it off, negative is an error.
TEST(ModelSpecFinalSoftcap, DefaultsNullAndRange) {
  json gemma2 = {{"model_type", "gemma2"},   {"hidden_size", 64},        {"num_hidden_layers", 2},
                 {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
                 {"intermediate_size", 96},  {"vocab_size", 97}};
  auto s = model_spec_from_json(gemma2.dump());
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->final_logit_softcapping, 30.0);
  gemma2["final_logit_softcapping"] = nullptr;
  EXPECT_EQ(model_spec_from_json(gemma2.dump())->final_logit_softcapping, 0.0);
  gemma2["final_logit_softcapping"] = 12.5;
  EXPECT_EQ(model_spec_from_json(gemma2.dump())->final_logit_softcapping, 12.5);
  gemma2["final_logit_softcapping"] = -1.0;
  auto bad = model_spec_from_json(gemma2.dump());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("final_logit_softcapping = -1"), std::string::npos)
      << bad.status().message();
  auto gemma3 = model_spec_from_json(load("gemma-3-4b-it.json").dump());
  ASSERT_TRUE(gemma3.ok()) << gemma3.status().to_string();
  EXPECT_EQ(gemma3->final_logit_softcapping, 0.0);
}

}  // namespace
}  // namespace attnkit
