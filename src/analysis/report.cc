// The figures of the tool's reports (include/attnkit/report.h), built on the
// counting rules of analysis.h; nothing here measures or formats.
#include "attnkit/report.h"

#include <algorithm>

namespace attnkit {

LayerFigures layer_figures(const ModelShape& s, DType kv, int64_t prompt, int64_t context,
                           int64_t batch) {
  LayerFigures f;
  f.params = static_cast<double>(attention_params_per_layer(s));
  f.kv_bytes_per_token = static_cast<double>(kv_bytes_per_token(s, kv));
  f.kv_cache_bytes = kv_cache_bytes(s, kv, context, batch);
  f.prefill_flops = prefill_flops_per_layer(s, prompt) * static_cast<double>(batch);
  f.decode_flops = decode_flops_per_layer(s, context) * static_cast<double>(batch);
  f.decode_bytes = decode_bytes_per_layer(s, context, batch, kv, DType::kF32);
  if (s.mla && s.index_topk > 0 && s.index_n_heads > 0) {
    // DeepSeek sparse attention: the indexer's weights, and the sparse path.
    f.params += static_cast<double>(indexer_params(s));
    f.prefill_flops = dsa_layer_figures(s, prompt, batch, kv, DType::kF32).dsa_prefill_flops;
    const DsaLayerFigures d = dsa_layer_figures(s, context, batch, kv, DType::kF32);
    f.decode_flops = d.dsa_decode_flops;
    f.decode_bytes = d.dsa_decode_bytes;
  }
  return f;
}

ModelFigures model_figures(const ModelShape& m, DType kv, int64_t prompt, int64_t context,
                           int64_t batch) {
  const ModelTotals t = model_totals(m, context, batch, kv, DType::kF32);
  ModelFigures f;
  f.params = attention_params_total(m);
  f.kv_bytes_per_token = kv_bytes_per_token(m, kv);
  f.kv_cache_bytes = kv_cache_bytes(m, kv, context, batch);
  f.linear_state_bytes = linear_state_bytes(m, batch);
  f.prefill_flops = model_totals(m, prompt, batch, kv, DType::kF32).prefill_flops;
  f.decode_flops = t.decode_flops;
  f.decode_bytes = t.decode_bytes;
  return f;
}

VariantRates variant_rates(const VariantTiming& t, DType kv, int64_t prompt, int64_t context,
                           int64_t batch, double peak_flops_per_s, double read_bytes_per_s) {
  VariantRates r;
  r.figures = layer_figures(t.shape, kv, prompt, context, batch);
  r.prefill_flops_per_s = r.figures.prefill_flops / t.prefill_seconds;
  r.decode_flops_per_s = r.figures.decode_flops / t.decode_seconds;
  r.decode_bytes_per_s = r.figures.decode_bytes / t.decode_seconds;
  r.above_roof =
      r.prefill_flops_per_s > peak_flops_per_s || r.decode_bytes_per_s > read_bytes_per_s;
  return r;
}

CompareConclusions conclude_comparison(const std::vector<VariantTiming>& rows, DType kv) {
  CompareConclusions c;
  if (rows.empty()) return c;
  const auto per_token = [kv](const VariantTiming& t) { return kv_bytes_per_token(t.shape, kv); };
  for (size_t i = 0; i < rows.size(); ++i) {
    const ModelShape& s = rows[i].shape;
    if (!s.mla && s.num_kv_heads == s.num_heads) c.mha = static_cast<int>(i);
  }
  // The first of equals wins, in the order the variants were asked for.
  c.fastest_decode =
      static_cast<int>(std::min_element(rows.begin(), rows.end(),
                                        [](const VariantTiming& a, const VariantTiming& b) {
                                          return a.decode_seconds < b.decode_seconds;
                                        }) -
                       rows.begin());
  c.smallest_cache =
      static_cast<int>(std::min_element(rows.begin(), rows.end(),
                                        [&](const VariantTiming& a, const VariantTiming& b) {
                                          return per_token(a) < per_token(b);
                                        }) -
                       rows.begin());
  for (size_t i = 0; i < rows.size() && c.mha >= 0; ++i)
    if (rows[i].shape.mla) c.mla.push_back(static_cast<int>(i));
  return c;
}

DecodeEstimate estimate_decode_step(const ModelShape& m, int64_t context, int64_t batch, DType kv,
                                    DType weights, double peak_gflops, double read_gbps) {
  const ModelTotals t = model_totals(m, context, batch, kv, weights);
  DecodeEstimate e;
  e.flops = t.decode_flops;
  e.bytes = t.decode_bytes;
  if (m.index_topk > 0 && m.index_n_heads > 0) {
    // DeepSeek sparse attention: every layer is an MLA layer on its sparse
    // path (dsa_layer_figures), not dense MLA.
    const DsaLayerFigures f = dsa_layer_figures(m, context, batch, kv, weights);
    e.flops = f.dsa_decode_flops * static_cast<double>(m.num_layers);
    e.bytes = f.dsa_decode_bytes * static_cast<double>(m.num_layers);
  }
  const double read_s = e.bytes / (read_gbps * 1e9), compute_s = e.flops / (peak_gflops * 1e9);
  e.seconds = std::max(read_s, compute_s);
  e.memory_bound = read_s >= compute_s;
  return e;
}

int64_t max_context_within(const ModelShape& m, DType kv, int64_t batch, double budget) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  if (cache_bytes(m, kv, kHuge, batch) <= budget) return -1;
  int64_t lo = 0, hi = kHuge;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (cache_bytes(m, kv, mid, batch) <= budget ? lo : hi) = mid;
  }
  return lo;
}

MemoryFit fit_memory(const ModelShape& v, DType kv, int64_t context, int64_t batch, double budget,
                     int64_t position_limit) {
  MemoryFit f;
  f.batch = batch;
  f.context = context;
  if (context > 0) {
    const double per_sequence = cache_bytes(v, kv, context, 1);
    f.batch =
        per_sequence > budget ? 0 : static_cast<int64_t>(budget / std::max(1.0, per_sequence));
    f.memory_max_context = 0;
  } else {
    f.context = f.memory_max_context = max_context_within(v, kv, batch, budget);
    f.context_unbounded = f.memory_max_context < 0;
    if (position_limit > 0 && (f.context < 0 || f.context > position_limit)) {
      f.capped_by_model = true;
      f.context = position_limit;
    } else if (f.context < 0) {
      f.context = kUnboundedEstimateContext;
    }
  }
  f.fits = f.batch >= 1 && f.context >= 1;
  return f;
}

int64_t mla_rope_dim_for(int64_t head_dim) { return std::min<int64_t>(64, head_dim / 2) / 2 * 2; }

std::vector<ModelShape> plan_variants(const ModelShape& m) {
  std::vector<ModelShape> out = {m};
  if (m.mla) return out;
  for (int64_t n : valid_kv_head_counts(m.num_heads))
    if (n != m.num_kv_heads) out.push_back(*with_kv_heads(m, n));
  if (auto v = with_mla(m, 512, mla_rope_dim_for(m.head_dim), 0); v.ok()) out.push_back(*v);
  return out;
}

std::vector<ModelShape> what_if_variants(const ModelShape& m,
                                         const std::vector<int64_t>& mla_ranks) {
  std::vector<ModelShape> out;
  if (!m.mla)
    for (int64_t n : valid_kv_head_counts(m.num_heads)) out.push_back(*with_kv_heads(m, n));
  for (int64_t r : mla_ranks) {
    if (m.mla) {
      ModelShape v = m;
      v.kv_lora_rank = r;
      v.name = m.name + " [mla r=" + std::to_string(r) + "]";
      out.push_back(v);
    } else if (auto v = with_mla(m, r, mla_rope_dim_for(m.head_dim), 0); v.ok()) {
      out.push_back(*v);
    }
  }
  return out;
}

}  // namespace attnkit
