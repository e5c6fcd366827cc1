// The report figures (attnkit/report.h) against values worked out by hand
// for a small layer: d_model 64, 4 query heads of 16, no biases.
//   params: q, k, v, o of 64 x 64 = 4 * 4096 = 16384
//   K/V per token: 4 kv heads x (16 + 16) values = 128 values (512 B in f32)
//   prefill of 16 causal tokens: 2 * 16 * 16384 + 2 * 4 * 32 * (16 * 17 / 2)
//     = 524288 + 34816 = 559104 FLOPs
//   decode over 64 tokens: 2 * 16384 + 2 * 4 * 32 * 64 = 49152 FLOPs
#include <gtest/gtest.h>

#include <vector>

#include "attnkit/report.h"

namespace attnkit {
namespace {

ModelShape small_mha(int64_t layers = 1) {
  ModelShape m;
  m.name = "small";
  m.num_layers = layers;
  m.hidden_size = 64;
  m.num_heads = m.num_kv_heads = 4;
  m.head_dim = m.head_dim_v = 16;
  return m;
}

TEST(Report, LayerFiguresMatchTheHandCount) {
  const LayerFigures f = layer_figures(small_mha(), DType::kF32, 16, 64, 2);
  EXPECT_DOUBLE_EQ(f.params, 16384);
  EXPECT_DOUBLE_EQ(f.kv_bytes_per_token, 512);
  EXPECT_DOUBLE_EQ(f.kv_cache_bytes, 512.0 * 64 * 2);
  EXPECT_DOUBLE_EQ(f.prefill_flops, 559104.0 * 2);
  EXPECT_DOUBLE_EQ(f.decode_flops, 49152.0 * 2);
  // f32 weights once, then each sequence's 64 tokens of K/V.
  EXPECT_DOUBLE_EQ(f.decode_bytes, 16384.0 * 4 + 2 * 512.0 * 64);
}

// A DSA layer (64 indexer heads of 128, top 8) is counted with its
// indexer's weights and on its sparse path; dense MLA of the same sizes is
// not. Hand count: d_model 64, 4 heads, kv_lora_rank 64, rope 8,
// q_lora_rank 192 (as `compare --variants mla,mla-dsa` builds them).
TEST(Report, LayerFiguresOfADsaLayerCountTheIndexerAndTheSparsePath) {
  ModelShape m = small_mha();
  m = *with_mla(m, 64, 8, 192);
  const LayerFigures dense = layer_figures(m, DType::kF32, 16, 64, 1);
  m.index_n_heads = 64;
  m.index_head_dim = 128;
  m.index_topk = 8;
  const LayerFigures f = layer_figures(m, DType::kF32, 16, 64, 1);
  const double indexer = 64.0 * 128 * 192 + 128 * 64 + 2 * 128 + 64 * 64;
  EXPECT_DOUBLE_EQ(f.params, dense.params + indexer);
  // f32 weights, every cached token's indexer key (128 codes + a scale),
  // and the 8 chosen latent rows of (64 + 8) f32 values.
  EXPECT_DOUBLE_EQ(f.decode_bytes, f.params * 4 + 64.0 * 132 + 8.0 * 72 * 4);
  const DsaLayerFigures d = dsa_layer_figures(m, 64, 1, DType::kF32, DType::kF32);
  EXPECT_DOUBLE_EQ(f.decode_flops, d.dsa_decode_flops);
  EXPECT_DOUBLE_EQ(f.prefill_flops,
                   dsa_layer_figures(m, 16, 1, DType::kF32, DType::kF32).dsa_prefill_flops);
  EXPECT_GT(f.prefill_flops, dense.prefill_flops);  // 16 <= top-k: dense plus the keys
}

TEST(Report, ModelFiguresSumLayersWithTheirWindows) {
  ModelShape m = small_mha(2);
  m.layers.resize(2);
  m.layers[1].sliding_window = 8;  // holds 8 of the 64 tokens
  const ModelFigures f = model_figures(m, DType::kF32, 16, 64, 1);
  EXPECT_EQ(f.params, 2 * 16384);
  EXPECT_EQ(f.kv_bytes_per_token, 2 * 512);
  EXPECT_DOUBLE_EQ(f.kv_cache_bytes, 512.0 * (64 + 8));
  EXPECT_DOUBLE_EQ(f.linear_state_bytes, 0);
  // Decode: weights twice, the window layer attends to 8 tokens only.
  EXPECT_DOUBLE_EQ(f.decode_flops, 49152.0 + (2 * 16384 + 2 * 4 * 32 * 8));
  EXPECT_DOUBLE_EQ(f.decode_bytes, 2 * 16384.0 * 4 + 512.0 * (64 + 8));
}

TEST(Report, VariantRatesAndTheRoof) {
  VariantTiming t{"mha", small_mha(), /*prefill_seconds=*/1e-3, /*decode_seconds=*/1e-4};
  VariantRates r = variant_rates(t, DType::kF32, 16, 64, 1, /*peak=*/1e9, /*bw=*/1e9);
  EXPECT_DOUBLE_EQ(r.prefill_flops_per_s, 559104.0 / 1e-3);
  EXPECT_DOUBLE_EQ(r.decode_flops_per_s, 49152.0 / 1e-4);
  const double decode_bytes = 16384.0 * 4 + 512.0 * 64;
  EXPECT_DOUBLE_EQ(r.decode_bytes_per_s, decode_bytes / 1e-4);
  // 5.6e8 FLOP/s under a 1e9 peak, 9.8e8 B/s under 1e9: below both roofs.
  EXPECT_FALSE(r.above_roof);
  // A decode read faster than the bandwidth is above the roof; decode
  // FLOP/s is not judged against the peak (a decode step is memory-bound).
  r = variant_rates(t, DType::kF32, 16, 64, 1, 1e9, 0.5e9);
  EXPECT_TRUE(r.above_roof);
  r = variant_rates(t, DType::kF32, 16, 64, 1, 0.5e9, 1e9);
  EXPECT_TRUE(r.above_roof);  // prefill 5.6e8 > 5e8
  r = variant_rates(t, DType::kF32, 16, 64, 1, 0.6e9, 1e9);
  EXPECT_FALSE(r.above_roof);  // decode's 4.9e8 FLOP/s would be under anyway
}

TEST(Report, ConclusionsPickRowsByTheirFigures) {
  const ModelShape mha = small_mha();
  const ModelShape gqa = *with_kv_heads(mha, 2), mqa = *with_kv_heads(mha, 1);
  const ModelShape mla = *with_mla(mha, 32, 8, 0);  // 32 + 8 values per token
  std::vector<VariantTiming> rows = {
      {"mha", mha, 1, 4e-6}, {"gqa-2", gqa, 1, 3e-6}, {"mqa", mqa, 1, 3e-6}, {"mla", mla, 1, 5e-6}};
  CompareConclusions c = conclude_comparison(rows, DType::kBF16);
  EXPECT_EQ(c.mha, 0);
  EXPECT_EQ(c.fastest_decode, 1);  // gqa-2 and mqa tie: the first asked for
  EXPECT_EQ(c.smallest_cache, 2);  // mqa: 32 values per token, mla 40, gqa 64
  EXPECT_EQ(c.mla, std::vector<int>{3});
  // Without an MHA row there is nothing to state MLA's trade against.
  rows.erase(rows.begin());
  c = conclude_comparison(rows, DType::kBF16);
  EXPECT_EQ(c.mha, -1);
  EXPECT_TRUE(c.mla.empty());
  EXPECT_EQ(c.fastest_decode, 0);
  EXPECT_EQ(conclude_comparison({}, DType::kBF16).fastest_decode, -1);
}

TEST(Report, DecodeEstimateIsTheSlowerOfReadingAndComputing) {
  // bf16 weights 16384 x 2 B + bf16 K/V 64 tokens x 256 B = 49152 B, and
  // 49152 FLOPs: at 1 GFLOP/s and 1 GB/s the two take equally long.
  DecodeEstimate e = estimate_decode_step(small_mha(), 64, 1, DType::kBF16, DType::kBF16, 1, 1);
  EXPECT_DOUBLE_EQ(e.flops, 49152);
  EXPECT_DOUBLE_EQ(e.bytes, 49152);
  EXPECT_DOUBLE_EQ(e.seconds, 49152e-9);
  EXPECT_TRUE(e.memory_bound);  // a tie counts as memory-bound
  e = estimate_decode_step(small_mha(), 64, 1, DType::kBF16, DType::kBF16, 1, 2);
  EXPECT_FALSE(e.memory_bound);
  EXPECT_DOUBLE_EQ(e.seconds, 49152e-9);
  e = estimate_decode_step(small_mha(), 64, 1, DType::kBF16, DType::kBF16, 4, 1);
  EXPECT_TRUE(e.memory_bound);
  EXPECT_DOUBLE_EQ(e.seconds, 49152e-9);
}

TEST(Report, MaxContextWithinABudget) {
  // bf16: 256 B per token; 1000 B hold 3 tokens (768), not 4 (1024).
  EXPECT_EQ(max_context_within(small_mha(), DType::kBF16, 1, 1000), 3);
  EXPECT_EQ(max_context_within(small_mha(), DType::kBF16, 2, 1024), 2);
  EXPECT_EQ(max_context_within(small_mha(), DType::kBF16, 1, 100), 0);
  ModelShape windowed = small_mha();
  windowed.layers.resize(1);
  windowed.layers[0].sliding_window = 8;  // 2 KiB at most, whatever the context
  EXPECT_EQ(max_context_within(windowed, DType::kBF16, 1, 4096), -1);
  EXPECT_EQ(max_context_within(windowed, DType::kBF16, 1, 1000), 3);
}

TEST(Report, FitMemoryAtAContext) {
  // 64 tokens of bf16 K/V: 16384 B per sequence.
  MemoryFit f = fit_memory(small_mha(), DType::kBF16, 64, 0, 65536 + 100, 0);
  EXPECT_TRUE(f.fits);
  EXPECT_EQ(f.batch, 4);
  EXPECT_EQ(f.context, 64);
  EXPECT_FALSE(f.capped_by_model);
  EXPECT_FALSE(f.context_unbounded);
  f = fit_memory(small_mha(), DType::kBF16, 64, 0, 16000, 0);
  EXPECT_FALSE(f.fits);
  EXPECT_EQ(f.batch, 0);
}

TEST(Report, FitMemoryAtABatch) {
  // 1e6 B at 256 B per token: 3906 tokens.
  MemoryFit f = fit_memory(small_mha(), DType::kBF16, 0, 1, 1e6, 0);
  EXPECT_TRUE(f.fits);
  EXPECT_EQ(f.context, 3906);
  EXPECT_EQ(f.memory_max_context, 3906);
  EXPECT_FALSE(f.capped_by_model);
  // The model's position limit caps it, and says what memory allowed.
  f = fit_memory(small_mha(), DType::kBF16, 0, 1, 1e6, 2048);
  EXPECT_EQ(f.context, 2048);
  EXPECT_TRUE(f.capped_by_model);
  EXPECT_EQ(f.memory_max_context, 3906);
  // Nothing fits: not even one token.
  f = fit_memory(small_mha(), DType::kBF16, 0, 1, 100, 0);
  EXPECT_FALSE(f.fits);
  // Every layer window-capped: any context fits; the estimate uses 4096
  // tokens unless the model stops earlier.
  ModelShape windowed = small_mha();
  windowed.layers.resize(1);
  windowed.layers[0].sliding_window = 8;
  f = fit_memory(windowed, DType::kBF16, 0, 1, 1e6, 0);
  EXPECT_TRUE(f.fits && f.context_unbounded);
  EXPECT_EQ(f.memory_max_context, -1);
  EXPECT_EQ(f.context, kUnboundedEstimateContext);
  f = fit_memory(windowed, DType::kBF16, 0, 1, 1e6, 1000);
  EXPECT_TRUE(f.capped_by_model && f.context_unbounded);
  EXPECT_EQ(f.context, 1000);
}

TEST(Report, PlanAndWhatIfVariants) {
  const ModelShape m = small_mha();
  const std::vector<ModelShape> plan = plan_variants(m);
  ASSERT_EQ(plan.size(), 4u);  // as configured, 1 and 2 kv heads, MLA
  EXPECT_EQ(plan[0].num_kv_heads, 4);
  EXPECT_EQ(plan[1].num_kv_heads, 1);
  EXPECT_EQ(plan[2].num_kv_heads, 2);
  EXPECT_TRUE(plan[3].mla);
  EXPECT_EQ(plan[3].kv_lora_rank, 512);
  EXPECT_EQ(plan[3].qk_rope_head_dim, 8);  // min(64, 16 / 2), even
  EXPECT_EQ(mla_rope_dim_for(128), 64);
  EXPECT_EQ(mla_rope_dim_for(20), 10);
  EXPECT_EQ(mla_rope_dim_for(12), 6);
  EXPECT_EQ(mla_rope_dim_for(10), 4);  // 5 rounded down to even

  const std::vector<ModelShape> sweep = what_if_variants(m, {32, 64});
  ASSERT_EQ(sweep.size(), 5u);  // 1, 2, 4 kv heads, then two MLA ranks
  EXPECT_EQ(sweep[2].num_kv_heads, 4);
  EXPECT_EQ(sweep[3].kv_lora_rank, 32);
  EXPECT_EQ(sweep[4].kv_lora_rank, 64);

  // An MLA model stays MLA: only its kv_lora_rank moves.
  const ModelShape lite = *model_preset("deepseek-v2-lite");
  EXPECT_EQ(plan_variants(lite).size(), 1u);
  const std::vector<ModelShape> mla_sweep = what_if_variants(lite, {64, 1024});
  ASSERT_EQ(mla_sweep.size(), 2u);
  EXPECT_EQ(mla_sweep[1].kv_lora_rank, 1024);
  EXPECT_EQ(mla_sweep[1].qk_rope_head_dim, lite.qk_rope_head_dim);
  EXPECT_EQ(mla_sweep[1].name, lite.name + " [mla r=1024]");
}

}  // namespace
}  // namespace attnkit
