// Analysis arithmetic against values computed by hand from the published
// configs (shared/reference/mla.md, Tables 1 and 2, which were computed
// independently of this code).
#include <gtest/gtest.h>

#include <string>

#include "attnkit/analysis.h"
#include "attnkit/latent_attention.h"
#include "attnkit/rope.h"

namespace attnkit {
namespace {

struct Expect {
  const char* preset;
  int64_t layers, heads, kv_heads, head_dim;
  int64_t kv_bytes_per_token_bf16;     // all layers, latent for MLA
  int64_t naive_bytes_per_token_bf16;  // MLA only (0 otherwise)
  int64_t params_per_layer;
  int64_t decode_flops_4096;  // one layer, L = 4096, no window cap
};

// mla.md Table 1.
constexpr Expect kTable1[] = {
    {"GPT-2", 12, 12, 12, 64, 36864, 0, 2362368, 17307648},
    {"BERT-base", 12, 12, 12, 64, 36864, 0, 2362368, 17307648},
    {"Llama-2-7B", 32, 32, 32, 128, 524288, 0, 67108864, 201326592},
    {"Llama-2-70B", 80, 64, 8, 128, 327680, 0, 150994944, 436207616},
    {"Llama-3-8B", 32, 32, 8, 128, 131072, 0, 41943040, 150994944},
    {"Llama-3-70B", 80, 64, 8, 128, 327680, 0, 150994944, 436207616},
    {"Mistral-7B", 32, 32, 8, 128, 131072, 0, 41943040, 150994944},
    {"Falcon-7B", 32, 71, 1, 64, 8192, 0, 41877504, 158203904},
    {"Qwen2.5-7B", 28, 28, 4, 128, 57344, 0, 29364736, 117449728},
    {"Qwen3-8B", 36, 32, 8, 128, 147456, 0, 41943296, 150995456},
    {"Gemma-2-9B", 42, 16, 8, 256, 344064, 0, 44040192, 155189248},
    {"DeepSeek-V2-Lite", 27, 16, 16, 192, 31104, 276480, 13763072, 170132480},
    {"DeepSeek-V2", 60, 128, 128, 192, 69120, 4915200, 149227520, 1439305728},
    {"DeepSeek-V3", 61, 128, 128, 192, 70272, 4997120, 187107328, 1515065344},
    {"Kimi-K2", 61, 64, 64, 192, 70272, 2498560, 101124096, 772673536},
};

TEST(Analysis, PresetsMatchHandComputedTable) {
  for (const Expect& e : kTable1) {
    SCOPED_TRACE(e.preset);
    auto m = model_preset(e.preset);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->num_layers, e.layers);
    EXPECT_EQ(m->num_heads, e.heads);
    EXPECT_EQ(m->num_kv_heads, e.kv_heads);
    EXPECT_EQ(m->head_dim, e.head_dim);
    EXPECT_EQ(kv_bytes_per_token(*m, DType::kBF16), e.kv_bytes_per_token_bf16);
    if (m->mla) {
      EXPECT_EQ(kv_bytes_per_token(*m, DType::kBF16, false), e.naive_bytes_per_token_bf16);
    }
    EXPECT_EQ(attention_params_per_layer(*m), e.params_per_layer);
    // The table ignores window caps: layer 1 of Gemma-2 is global, Mistral's
    // window (4096) equals L, so both are uncapped at this L.
    EXPECT_DOUBLE_EQ(decode_flops_per_layer(*m, 4096, 1), static_cast<double>(e.decode_flops_4096));
  }
}

// mla.md Table 2: one sequence's bf16 KV cache in MiB (window-capped).
TEST(Analysis, CacheSizesWithWindows) {
  struct Row {
    const char* preset;
    int64_t context;
    double mib;
  };
  const Row rows[] = {
      {"Llama-2-7B", 4096, 2048.0},   {"Llama-3-8B", 8192, 1024.0},
      {"Mistral-7B", 4096, 512.0},    {"Mistral-7B", 32768, 512.0},
      {"Qwen2.5-7B", 131072, 7168.0}, {"Qwen3-8B", 40960, 5760.0},
      {"Gemma-2-9B", 4096, 1344.0},   {"Gemma-2-9B", 8192, 2016.0},
      {"DeepSeek-V3", 4096, 274.5},   {"DeepSeek-V3", 163840, 10980.0},
      {"Kimi-K2", 131072, 8784.0},    {"DeepSeek-V2-Lite", 4096, 121.5},
      {"GPT-2", 1024, 36.0},          {"Falcon-7B", 2048, 16.0},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string(r.preset) + " @ " + std::to_string(r.context));
    auto m = model_preset(r.preset);
    ASSERT_TRUE(m.ok());
    EXPECT_DOUBLE_EQ(
        static_cast<double>(kv_cache_bytes(*m, DType::kBF16, r.context, 1)) / (1 << 20), r.mib);
  }
  auto m = model_preset("Llama-3-8B");
  ASSERT_TRUE(m.ok());
  // Batch and dtype scale linearly: f32 is twice bf16, batch 16 is 16x.
  EXPECT_EQ(kv_cache_bytes(*m, DType::kF32, 1000, 16),
            32 * kv_cache_bytes(*m, DType::kBF16, 1000, 1));
}

TEST(Analysis, MlaConfigIgnoresMisleadingFields) {
  // DeepSeek configs carry num_key_value_heads = heads and, in transformers,
  // head_dim = qk_rope_head_dim; neither describes the latent cache.
  auto m = model_shape_from_json(R"({"model_type":"deepseek_v3","hidden_size":7168,
      "num_attention_heads":128,"num_key_value_heads":128,"head_dim":64,"num_hidden_layers":61,
      "q_lora_rank":1536,"kv_lora_rank":512,"qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128})");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE(m->mla);
  EXPECT_EQ(m->head_dim, 192);
  EXPECT_EQ(m->head_dim_v, 128);
  EXPECT_EQ(kv_values_per_token_per_layer(*m), 576);
  EXPECT_EQ(kv_values_per_token_per_layer(*m, false), 128 * 320);
}

TEST(Analysis, MlaFamilyWithoutMlaFieldsIsRejectedAsTheLayerRejectsIt) {
  // A deepseek_v3 config stripped of its MLA fields is not an MHA model of
  // head_dim hidden / heads: analyze and LatentAttention give one answer.
  const char* text = R"({"model_type":"deepseek_v3","hidden_size":7168,
      "num_attention_heads":128,"num_key_value_heads":128,"num_hidden_layers":61})";
  auto m = model_shape_from_json(text);
  ASSERT_FALSE(m.ok());
  auto layer_config = mla_config_from_json(text);
  ASSERT_FALSE(layer_config.ok());
  // One reader: the same message under each entry point's name.
  const std::string& a = m.status().message();
  const std::string& b = layer_config.status().message();
  EXPECT_EQ(a.substr(a.find(": ")), b.substr(b.find(": "))) << a << "\n" << b;
  EXPECT_NE(m.status().message().find("q_lora_rank is missing"), std::string::npos)
      << m.status().message();
  // rope_interleave is read by the same parser (and validated the same way).
  const std::string v3 = R"({"model_type":"deepseek_v3","hidden_size":7168,
      "num_attention_heads":128,"num_hidden_layers":61,"q_lora_rank":1536,"kv_lora_rank":512,
      "qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128)";
  auto interleaved = model_shape_from_json(v3 + "}");
  ASSERT_TRUE(interleaved.ok()) << interleaved.status().to_string();
  EXPECT_TRUE(interleaved->rope_interleave);
  auto half = model_shape_from_json(v3 + R"(,"rope_interleave":false})");
  ASSERT_TRUE(half.ok()) << half.status().to_string();
  EXPECT_FALSE(half->rope_interleave);
  auto bad = model_shape_from_json(v3 + R"(,"rope_interleave":"no"})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("rope_interleave"), std::string::npos);
}

TEST(Analysis, PrefillFlopsCountVisiblePairs) {
  auto m = model_preset("Mistral-7B");
  ASSERT_TRUE(m.ok());
  const double proj = 2.0 * static_cast<double>(attention_params_per_layer(*m));
  const double per_pair = 2.0 * 32 * 256;
  // S <= W: causal triangle S(S+1)/2.
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(*m, 100), 100 * proj + per_pair * 100 * 101 / 2);
  // S > W: rows past the window see exactly W keys.
  const double pairs = 4096.0 * 4097 / 2 + (5000.0 - 4096) * 4096;
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(*m, 5000), 5000 * proj + per_pair * pairs);
  auto bert = model_preset("bert-base");
  ASSERT_TRUE(bert.ok());
  EXPECT_FALSE(bert->causal);
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(*bert, 10),
                   10 * 2.0 * attention_params_per_layer(*bert) + 2.0 * 12 * 128 * 100);
}

TEST(Analysis, WhatIfSweeps) {
  auto m = model_preset("Llama-2-7B");
  ASSERT_TRUE(m.ok());
  const auto counts = valid_kv_head_counts(m->num_heads);
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 2, 4, 8, 16, 32}));
  for (int64_t n : counts) {
    auto g = with_kv_heads(*m, n);
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(kv_bytes_per_token(*g, DType::kBF16), 2 * n * 128 * 32 * 2);
    // Only k_proj and v_proj shrink.
    EXPECT_EQ(attention_params_per_layer(*m) - attention_params_per_layer(*g),
              2 * (32 - n) * 128 * 4096);
  }
  EXPECT_FALSE(with_kv_heads(*m, 3).ok());
  auto mla = with_mla(*m, 512, 64);
  ASSERT_TRUE(mla.ok()) << mla.status().to_string();
  EXPECT_EQ(kv_values_per_token_per_layer(*mla), 576);
  EXPECT_EQ(mla->qk_nope_head_dim, 64);
  EXPECT_FALSE(with_mla(*m, 512, 63).ok());
  auto ds = model_preset("DeepSeek-V3");
  ASSERT_TRUE(ds.ok());
  EXPECT_FALSE(with_kv_heads(*ds, 8).ok());
}

TEST(Analysis, BadConfigsNameTheField) {
  auto missing =
      model_shape_from_json(R"({"model_type":"llama","hidden_size":64,"num_hidden_layers":2})");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("num_attention_heads"), std::string::npos);
  auto bad_div = model_shape_from_json(
      R"({"model_type":"llama","hidden_size":64,"num_attention_heads":8,"num_key_value_heads":3,"num_hidden_layers":2})");
  ASSERT_FALSE(bad_div.ok());
  EXPECT_NE(bad_div.status().message().find("num_key_value_heads = 3"), std::string::npos);
  auto odd_rope =
      model_shape_from_json(R"({"model_type":"deepseek_v2","hidden_size":64,"num_attention_heads":4,
      "num_hidden_layers":2,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":7,"v_head_dim":8})");
  ASSERT_FALSE(odd_rope.ok());
  EXPECT_NE(odd_rope.status().message().find("qk_rope_head_dim"), std::string::npos);
  auto wrong_type = model_shape_from_json(
      R"({"hidden_size":"64","num_attention_heads":8,"num_hidden_layers":2})");
  ASSERT_FALSE(wrong_type.ok());
  EXPECT_NE(wrong_type.status().message().find("hidden_size = \"64\""), std::string::npos);
  EXPECT_FALSE(model_shape_from_json("{not json").ok());
  EXPECT_FALSE(model_shape_from_json("[1,2]").ok());
  auto unknown = model_preset("llama-9000");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("Llama-3-8B"), std::string::npos);
}

TEST(Analysis, PresetNamesResolveCaseInsensitively) {
  for (const std::string& name : preset_names()) EXPECT_TRUE(model_preset(name).ok()) << name;
  EXPECT_TRUE(model_preset("llama-3-8b").ok());
  EXPECT_TRUE(model_preset("Mistral-7B-v0.1").ok());
  EXPECT_TRUE(model_preset("deepseek_v3").ok());
}

}  // namespace
}  // namespace attnkit

namespace attnkit {
namespace {

// Found by the config fuzzer: out-of-range numbers must be rejected, not
// cast (undefined behaviour), and sizes are capped so products cannot
// overflow.
TEST(Analysis, HostileNumbersAreRejected) {
  for (const char* v :
       {"1844674407370955161524", "18446744073709551615", "1e300", "4096.5", "-3"}) {
    const std::string cfg =
        std::string(
            R"({"model_type":"llama","hidden_size":64,"num_attention_heads":8,"num_hidden_layers":)") +
        v + "}";
    auto m = model_shape_from_json(cfg);
    ASSERT_FALSE(m.ok()) << v;
    EXPECT_NE(m.status().message().find("num_hidden_layers"), std::string::npos)
        << m.status().message();
  }
  auto ok = model_shape_from_json(
      R"({"model_type":"llama","hidden_size":64.0,"num_attention_heads":8,"num_hidden_layers":2})");
  EXPECT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST(Analysis, CacheBytesPastInt64AreTheTrueValueNotCapped) {
  auto m = model_preset("Llama-2-70B");
  ASSERT_TRUE(m.ok());
  // 80 layers x 8 kv heads x (128 + 128) values x 4 B = 655360 B per token,
  // x 2^40 tokens x 2^20 sequences: about 7.2e23 B, far past 2^63.
  const double want = 655360.0 * 0x1p40 * 0x1p20;
  EXPECT_EQ(kv_cache_bytes(*m, DType::kF32, int64_t{1} << 40, int64_t{1} << 20), want);
  // The analyze example of the overflow: 2e9 tokens x 2e9 sequences in bf16.
  EXPECT_DOUBLE_EQ(kv_cache_bytes(*m, DType::kBF16, 2'000'000'000, 2'000'000'000),
                   327680.0 * 2e9 * 2e9);
  // Below 2^53 the double is exact.
  EXPECT_EQ(kv_cache_bytes(*m, DType::kBF16, 4096, 3), 327680.0 * 4096 * 3);
}

}  // namespace
}  // namespace attnkit

// Layer by layer: ModelSpec values built by hand from the published configs
// (docs/ANALYSIS.md names them), every expected figure worked out here from
// the config's numbers, not from the code under test.
namespace attnkit {
namespace {

LayerSpec attention_layer(int64_t d, int64_t h, int64_t kv, int64_t hd) {
  LayerSpec l;
  l.kind = LayerKind::kAttention;
  l.attention.hidden_size = d;
  l.attention.num_heads = h;
  l.attention.num_kv_heads = kv;
  l.attention.head_dim = hd;
  return l;
}

ModelSpec spec_of(std::vector<LayerSpec> layers, int64_t d) {
  ModelSpec s;
  s.num_layers = static_cast<int64_t>(layers.size());
  s.hidden_size = d;
  s.layers = std::move(layers);
  return s;
}

// openai/gpt-oss-20b: 24 layers alternating sliding (128) and full, 64 heads,
// 8 kv heads of 64, hidden 2880, q/k/v/o biases, sinks.
ModelSpec gpt_oss_20b() {
  std::vector<LayerSpec> layers;
  for (int i = 0; i < 24; ++i) {
    LayerSpec l = attention_layer(2880, 64, 8, 64);
    l.attention.qkv_bias = l.attention.o_bias = l.attention.sinks = true;
    if (i % 2 == 0) l.attention.sliding_window = 128;
    layers.push_back(l);
  }
  return spec_of(layers, 2880);
}

// google/gemma-3-4b-it's text_config: 34 layers, sliding_window 1024, the
// pattern (6) left to its default, 8 heads, 4 kv heads of 256.
ModelSpec gemma3_4b() {
  std::vector<LayerSpec> layers;
  for (int i = 0; i < 34; ++i) {
    LayerSpec l = attention_layer(2560, 8, 4, 256);
    l.attention.qk_norm = QkNorm::kRmsOnePlus;
    if ((i + 1) % 6 != 0) l.attention.sliding_window = 1024;
    layers.push_back(l);
  }
  return spec_of(layers, 2560);
}

// meta-llama/Llama-4-Scout-17B-16E: 48 layers, every 4th NoPE and global,
// the others chunked (attention_chunk_size 8192) with the L2 qk-norm; 40
// heads, 8 kv heads of 128.
ModelSpec llama4_scout() {
  std::vector<LayerSpec> layers;
  for (int i = 0; i < 48; ++i) {
    LayerSpec l = attention_layer(5120, 40, 8, 128);
    if ((i + 1) % 4 == 0) {
      l.attention.use_rope = false;
    } else {
      l.attention.chunk_size = 8192;
      l.attention.qk_norm = QkNorm::kL2;
    }
    layers.push_back(l);
  }
  return spec_of(layers, 5120);
}

// Qwen/Qwen3-Next-80B-A3B: 48 layers, every 4th full gated attention (16
// heads, 2 kv heads of 256), the rest Gated DeltaNet (16 key heads, 32
// value heads, 128 x 128, conv kernel 4).
ModelSpec qwen3_next() {
  std::vector<LayerSpec> layers;
  for (int i = 0; i < 48; ++i) {
    if ((i + 1) % 4 == 0) {
      LayerSpec l = attention_layer(2048, 16, 2, 256);
      l.attention.qk_norm = QkNorm::kRmsOnePlus;
      l.attention.output_gate = true;
      layers.push_back(l);
    } else {
      LayerSpec l;
      l.kind = LayerKind::kLinearAttention;
      l.linear = {2048, 16, 32, 128, 128, 4, 1e-6};
      layers.push_back(l);
    }
  }
  return spec_of(layers, 2048);
}

ModelShape shape_of(const ModelSpec& s) {
  auto m = model_shape_from_spec(s);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? *m : ModelShape{};
}

TEST(LayerAnalysis, GptOssHalfTheLayersHold128Tokens) {
  const ModelShape m = shape_of(gpt_oss_20b());
  EXPECT_EQ(layer_mix(m), "24 layers: 12 sliding 128, 12 full");
  // K+V: 8 kv heads x (64 + 64) values x 2 B = 2048 B per token and layer.
  EXPECT_EQ(kv_bytes_per_token(m, DType::kBF16), 24 * 2048);
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 32768, 1), 12.0 * 128 * 2048 + 12.0 * 32768 * 2048);
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 100, 3), 3 * 24.0 * 100 * 2048);
  // q 4096x2880, k and v 512x2880, o 2880x4096, biases 4096+512+512+2880,
  // one sink per head.
  EXPECT_EQ(attention_params_per_layer(m), 2 * 4096 * 2880 + 2 * 512 * 2880 + 8000 + 64);
  EXPECT_EQ(attention_params_total(m), 24 * attention_params_per_layer(m));
  EXPECT_EQ(linear_state_bytes(m, 1), 0.0);
}

TEST(LayerAnalysis, Gemma3AsReleasedHasFiveFullLayers) {
  const ModelShape m = shape_of(gemma3_4b());
  EXPECT_EQ(layer_mix(m), "34 layers: 29 sliding 1024, 5 full");
  // 4 kv heads x 512 values x 2 B = 4096 B per token and layer.
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 32768, 1),
            29.0 * 1024 * 4096 + 5.0 * 32768 * 4096);  // 756 MiB, not 136 MiB
  // qk-norm gains: 2 x 256.
  EXPECT_EQ(attention_params_per_layer(m), 2 * 2048 * 2560 + 2 * 1024 * 2560 + 512);
}

TEST(LayerAnalysis, Llama4ChunkedLayersHoldAtMostOneChunk) {
  const ModelShape m = shape_of(llama4_scout());
  EXPECT_EQ(layer_mix(m), "48 layers: 36 chunked 8192, 12 full NoPE");
  // 8 kv heads x 256 values x 2 B = 4096 B per token and layer.
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 32768, 1), 36.0 * 8192 * 4096 + 12.0 * 32768 * 4096);
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 5000, 1), 48.0 * 5000 * 4096);
  EXPECT_EQ(tokens_held(m, 0, 20000), 8192);
  EXPECT_EQ(tokens_held(m, 3, 20000), 20000);
  // The L2 qk-norm has no weight: q 5120x5120, k and v 1024x5120, o 5120x5120.
  const int64_t params = 2 * 5120 * 5120 + 2 * 1024 * 5120;
  EXPECT_EQ(attention_params_per_layer(m), params);
  // Prefill of 20000 tokens in a chunked layer: two whole chunks of 8192
  // and one of 3616, each a causal triangle.
  const double pairs = 2 * (8192.0 * 8193 / 2) + 3616.0 * 3617 / 2;
  const double per_pair = 2.0 * 40 * 256;
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(m, 20000, 0), 20000 * 2.0 * params + per_pair * pairs);
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(m, 20000, 3),
                   20000 * 2.0 * params + per_pair * 20000.0 * 20001 / 2);
  // Decode over the chunk's upper bound (8192), or all 20000 in a global layer.
  EXPECT_DOUBLE_EQ(decode_flops_per_layer(m, 20000, 0), 2.0 * params + per_pair * 8192);
  EXPECT_DOUBLE_EQ(decode_flops_per_layer(m, 20000, 3), 2.0 * params + per_pair * 20000);
}

TEST(LayerAnalysis, Qwen3NextHoldsTwelveLayersOfKvAndAConstantState) {
  const ModelShape m = shape_of(qwen3_next());
  EXPECT_EQ(layer_mix(m), "48 layers: 36 Gated DeltaNet, 12 full (gated)");
  // 2 kv heads x 512 values x 2 B = 2048 B per token, in 12 layers only.
  EXPECT_EQ(kv_bytes_per_token(m, DType::kBF16), 12 * 2048);
  EXPECT_EQ(kv_cache_bytes(m, DType::kBF16, 32768, 1), 768.0 * 1024 * 1024);
  // Per Gated DeltaNet layer and sequence: the state 32 x 128 x 128 and
  // the conv's last 3 inputs of 2 x 16 x 128 + 32 x 128 channels, f32.
  const int64_t state = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 4;
  EXPECT_EQ(state, 2195456);
  EXPECT_EQ(linear_state_bytes_per_layer(m, 0), state);
  EXPECT_EQ(linear_state_bytes_per_layer(m, 3), 0);
  EXPECT_EQ(linear_state_bytes(m, 2), 2.0 * 36 * state);
  EXPECT_EQ(cache_bytes(m, DType::kBF16, 32768, 2), 2 * 768.0 * 1024 * 1024 + 2.0 * 36 * state);
  // Full layer: q_proj 2 x 4096 rows (query and gate), k, v 512 rows, o,
  // q/k norm gains 2 x 256.
  EXPECT_EQ(layer_params(m, 3), 2 * 4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 512);
  EXPECT_EQ(attention_params_per_layer(m), layer_params(m, 3));
  // Gated DeltaNet layer: in_proj_qkvz (2 x 2048 + 2 x 4096) x 2048,
  // in_proj_ba 64 x 2048, conv 8192 x 4, dt_bias and A_log 32 each, norm
  // 128, out_proj 2048 x 4096.
  const int64_t projections = (12288 + 64 + 4096) * int64_t{2048};
  EXPECT_EQ(layer_params(m, 0), projections + 8192 * 4 + 64 + 128);
  // Its FLOPs per token, in prefill and decode alike: the projections,
  // the conv, and 7 x 32 x 128 x 128 for the state.
  const double per_token = 2.0 * projections + 2.0 * 8192 * 4 + 7.0 * 32 * 128 * 128;
  EXPECT_DOUBLE_EQ(decode_flops_per_layer(m, 32768, 0), per_token);
  EXPECT_DOUBLE_EQ(decode_flops_per_layer(m, 10, 0), per_token);
  EXPECT_DOUBLE_EQ(prefill_flops_per_layer(m, 1000, 0), 1000 * per_token);
  // A decode step reads the state (f32) once per sequence.
  EXPECT_DOUBLE_EQ(decode_bytes_per_layer(m, 32768, 3, DType::kBF16, DType::kBF16, 0),
                   2.0 * static_cast<double>(layer_params(m, 0)) + 3.0 * state);

  // One row per layer kind, summing to the model's totals.
  const auto groups = layer_group_figures(m, DType::kBF16, 32768, 1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].label, "Gated DeltaNet");
  EXPECT_EQ(groups[0].count, 36);
  EXPECT_EQ(groups[0].tokens_held, 0);
  EXPECT_EQ(groups[0].kv_bytes, 0.0);
  EXPECT_EQ(groups[0].state_bytes, 36.0 * state);
  EXPECT_EQ(groups[1].label, "full (gated)");
  EXPECT_EQ(groups[1].tokens_held, 32768);
  EXPECT_EQ(groups[1].kv_bytes, 768.0 * 1024 * 1024);
  const ModelTotals t = model_totals(m, 32768, 1, DType::kBF16, DType::kBF16);
  EXPECT_DOUBLE_EQ(groups[0].prefill_flops + groups[1].prefill_flops, t.prefill_flops);
  EXPECT_DOUBLE_EQ(groups[0].decode_flops + groups[1].decode_flops, t.decode_flops);
}

TEST(LayerAnalysis, WhatIfVariantsKeepTheLayerKinds) {
  const ModelShape m = shape_of(qwen3_next());
  auto mqa = with_kv_heads(m, 1);
  ASSERT_TRUE(mqa.ok()) << mqa.status().to_string();
  EXPECT_EQ(layer_mix(*mqa), layer_mix(m));
  EXPECT_EQ(kv_cache_bytes(*mqa, DType::kBF16, 32768, 1), 384.0 * 1024 * 1024);
  EXPECT_EQ(linear_state_bytes(*mqa, 1), linear_state_bytes(m, 1));
  auto mla = with_mla(m, 512, 64);
  ASSERT_TRUE(mla.ok()) << mla.status().to_string();
  // The gate belonged to the softmax attention MLA replaces.
  EXPECT_EQ(layer_mix(*mla), "48 layers: 36 Gated DeltaNet, 12 full");
  EXPECT_EQ(kv_bytes_per_token(*mla, DType::kBF16), 12 * 576 * 2);
  const ModelShape scout = shape_of(llama4_scout());
  auto scout_mla = with_mla(scout, 512, 64);
  ASSERT_TRUE(scout_mla.ok());
  EXPECT_EQ(kv_cache_bytes(*scout_mla, DType::kBF16, 32768, 1),
            (36.0 * 8192 + 12.0 * 32768) * 576 * 2);
}

TEST(LayerAnalysis, SpecWithUnequalAttentionSizesIsRefused) {
  ModelSpec s = gpt_oss_20b();
  s.layers[5].attention.num_kv_heads = 4;
  auto m = model_shape_from_spec(s);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model_shape_from_spec: layer 5"), std::string::npos)
      << m.status().message();
  ModelSpec huge = qwen3_next();
  huge.layers[0].linear = {1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 4, 1e-6};
  auto overflow = model_shape_from_spec(huge);
  ASSERT_FALSE(overflow.ok());
  EXPECT_NE(overflow.status().message().find("layer 0 (Gated DeltaNet)"), std::string::npos)
      << overflow.status().message();
  s.layers.pop_back();
  auto short_list = model_shape_from_spec(s);
  ASSERT_FALSE(short_list.ok());
  EXPECT_NE(short_list.status().message().find("layers.size() = 23"), std::string::npos);
}

TEST(LayerAnalysis, HandBuiltShapesWithoutLayersAreFullAttention) {
  ModelShape m;
  m.num_layers = 3;
  m.hidden_size = 64;
  m.num_heads = m.num_kv_heads = 4;
  m.head_dim = m.head_dim_v = 16;
  EXPECT_EQ(layer_mix(m), "3 layers: 3 full");
  EXPECT_EQ(kv_cache_bytes(m, DType::kF32, 10, 1), 3.0 * 10 * 4 * 32 * 4);
}

}  // namespace
}  // namespace attnkit

// The published configs (the presets carry them as released; sources in
// docs/ANALYSIS.md) read by the one reader: each layer's kind from the
// family's rule, and the bytes worked out here from the config's numbers.
namespace attnkit {
namespace {

struct Published {
  const char* preset;
  const char* mix;
  double kv_bytes_32k;  // bf16, one sequence of 32768 tokens
  double state_bytes;   // f32, one sequence
};

// bf16 K+V per token and layer: kv heads x 2 x head_dim x 2 B.
constexpr double kGptOss = 8 * 2 * 64 * 2, kGemma4b = 4 * 2 * 256 * 2, kGemma27b = 16 * 2 * 128 * 2,
                 kScout = 8 * 2 * 128 * 2, kQwenNext = 2 * 2 * 256 * 2;
// A Qwen3-Next Gated DeltaNet layer: 32 x 128 x 128 state values and 3
// conv inputs of 2 x 16 x 128 + 32 x 128 channels, f32.
constexpr double kDeltaNetState = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 4.0;

const Published kPublished[] = {
    // layer_types: sliding, full, ... (window 128).
    {"gpt-oss-20b", "24 layers: 12 sliding 128, 12 full", 12 * 128 * kGptOss + 12 * 32768 * kGptOss,
     0},
    {"gpt-oss-120b", "36 layers: 18 sliding 128, 18 full",
     18 * 128 * kGptOss + 18 * 32768 * kGptOss, 0},
    // No layer_types, no sliding_window_pattern: the default 6, so layers
    // 5, 11, 17, 23, 29 (and 35, ..., 59 in 27B) are global.
    {"Gemma-3-4B", "34 layers: 29 sliding 1024, 5 full",
     29 * 1024 * kGemma4b + 5 * 32768 * kGemma4b, 0},
    {"Gemma-3-27B", "62 layers: 52 sliding 1024, 10 full",
     52 * 1024 * kGemma27b + 10 * 32768 * kGemma27b, 0},
    // no_rope_layers: NoPE (global) every 4th layer, the others chunked.
    {"Llama-4-Scout", "48 layers: 36 chunked 8192, 12 full NoPE",
     36 * 8192 * kScout + 12 * 32768 * kScout, 0},
    // full_attention_interval 4: 12 gated full layers, 36 Gated DeltaNet.
    {"Qwen3-Next-80B-A3B", "48 layers: 36 Gated DeltaNet, 12 full (gated)", 12 * 32768 * kQwenNext,
     36 * kDeltaNetState},
};

TEST(PublishedConfigs, KvBytesLayerByLayer) {
  for (const Published& p : kPublished) {
    SCOPED_TRACE(p.preset);
    auto m = model_preset(p.preset);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(layer_mix(*m), p.mix);
    EXPECT_EQ(kv_cache_bytes(*m, DType::kBF16, 32768, 1), p.kv_bytes_32k);
    EXPECT_EQ(kv_cache_bytes(*m, DType::kBF16, 32768, 3), 3 * p.kv_bytes_32k);
    EXPECT_EQ(linear_state_bytes(*m, 1), p.state_bytes);
  }
  // Qwen3-Next at 32K: 768 MiB of K/V (not 3 GiB for 48 full layers).
  EXPECT_EQ(kPublished[5].kv_bytes_32k, 768.0 * (1 << 20));
}

// Qwen2 with use_sliding_window and no max_window_layers: the window
// starts at layer max_window_layers, whose default is 28, so none of the
// 28 layers slides (Qwen2Config).
TEST(PublishedConfigs, Qwen2SlidingWindowWithoutMaxWindowLayers) {
  auto m = model_shape_from_json(R"({"architectures": ["Qwen2ForCausalLM"],
      "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
      "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
      "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": 131072,
      "use_sliding_window": true, "vocab_size": 152064})");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(layer_mix(*m), "28 layers: 28 full");
  // 4 kv heads x 2 x 128 x 2 B = 2048 B per token and layer; past the
  // window (131072) every layer still holds every token.
  EXPECT_EQ(kv_cache_bytes(*m, DType::kBF16, 200000, 1), 28.0 * 200000 * 2048);
}

// The analysis, the layer config read for layer i and the layer shape
// agree on every layer's window and chunk (one reader behind both).
TEST(PublishedConfigs, AnalysisAndLayerConfigsAgreeLayerByLayer) {
  for (const Published& p : kPublished) {
    SCOPED_TRACE(p.preset);
    const std::string text = *preset_config_json(p.preset);
    auto m = model_preset(p.preset);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    for (int64_t i = 0; i < m->num_layers; ++i) {
      SCOPED_TRACE(i);
      const LayerShape l = layer_shape(*m, i);
      auto c = attention_config_from_json(text, i);
      if (l.kind == MixerKind::kGatedDeltaNet) {
        EXPECT_FALSE(c.ok());  // not a softmax-attention layer
        continue;
      }
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      EXPECT_EQ(c->sliding_window, l.sliding_window);
      EXPECT_EQ(c->chunk_size, l.chunk_size);
      EXPECT_EQ(c->use_rope, l.use_rope);
      EXPECT_EQ(c->sinks, l.sinks);
      EXPECT_EQ(c->output_gate, l.output_gate);
      EXPECT_EQ(c->num_kv_heads, m->num_kv_heads);
      EXPECT_EQ(c->head_dim, m->head_dim);
    }
  }
}

}  // namespace
}  // namespace attnkit
