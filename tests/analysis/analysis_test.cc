// Analysis arithmetic against values computed by hand from the published
// configs (shared/reference/mla.md, Tables 1 and 2, which were computed
// independently of this code).
#include <gtest/gtest.h>

#include <string>

#include "attnkit/analysis.h"
#include "attnkit/latent_attention.h"

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
