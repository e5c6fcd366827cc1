// attnkit analyze: exact arithmetic for one model (no timing), plus the
// seeds' "what if" sweeps over kv heads and MLA ranks.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>

#include "attnkit/report.h"

#include "cli.h"
#include "commands.h"

namespace attnkit::cli {
namespace {

std::string intensity_str(double flops_per_byte) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f FLOP/B", flops_per_byte);
  return buf;
}

// One row per layer kind: what each kind holds and costs at the context.
nlohmann::json per_layer_json(const std::vector<LayerGroupFigures>& groups) {
  nlohmann::json out = nlohmann::json::array();
  for (const LayerGroupFigures& g : groups)
    out.push_back({{"kind", g.label},
                   {"count", g.count},
                   {"tokens_held", g.tokens_held},
                   {"params_per_layer", g.params_per_layer},
                   {"kv_bytes", g.kv_bytes},
                   {"state_bytes", g.state_bytes},
                   {"prefill_flops", g.prefill_flops},
                   {"decode_flops", g.decode_flops}});
  return out;
}

// Each layer's kind, layer 0 first ("sliding 128", "full", ...).
std::vector<std::string> layer_kind_labels(const ModelShape& m) {
  std::vector<std::string> out(static_cast<size_t>(m.num_layers));
  for (const LayerGroup& g : layer_groups(m))
    for (int64_t l : g.layers) out[static_cast<size_t>(l)] = g.label;
  return out;
}

Table per_layer_table(const std::vector<LayerGroupFigures>& groups, const std::string& kv_name) {
  Table t({"layer kind", "layers", "tokens held", "KV (" + kv_name + ")", "state (f32)",
           "prefill FLOPs", "decode FLOPs / step"});
  for (const LayerGroupFigures& g : groups)
    t.add({g.label, std::to_string(g.count), std::to_string(g.tokens_held),
           g.kv_bytes > 0 ? format_bytes(g.kv_bytes) : "-",
           g.state_bytes > 0 ? format_bytes(g.state_bytes) : "-", format_flops(g.prefill_flops),
           format_flops(g.decode_flops)});
  return t;
}

// Contexts of the DSA table: powers of two from 1K to 128K, the model's
// index_topk and the asked context.
std::vector<int64_t> dsa_contexts(const ModelShape& m, int64_t context) {
  std::vector<int64_t> out = {m.index_topk, context};
  for (int64_t c = 1024; c <= 131072; c *= 2) out.push_back(c);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// DSA vs dense MLA over the whole model (every layer is a DSA layer).
DsaLayerFigures dsa_model_figures(const ModelShape& m, int64_t context, int64_t batch, DType kv,
                                  DType weights) {
  DsaLayerFigures f = dsa_layer_figures(m, context, batch, kv, weights);
  const double n = static_cast<double>(m.num_layers);
  for (double* v :
       {&f.dense_prefill_flops, &f.dsa_prefill_flops, &f.dense_decode_flops, &f.dsa_decode_flops,
        &f.dsa_indexer_decode_flops, &f.dense_decode_bytes, &f.dsa_decode_bytes})
    *v *= n;
  return f;
}

std::string ratio_str(double a, double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", a / b);
  return buf;
}

std::string crossover_str(int64_t c) {
  return c > 0 ? std::to_string(c) + " tokens" : "never (below 2^40 tokens)";
}

struct Options {
  std::string model, config;
  int64_t context = 4096, batch = 1;
  std::string kv_name = "bf16", weight_name = "bf16";
  std::vector<int64_t> mla_ranks = {64, 128, 256, 512};
  double peak = 0, bw = 0;
  bool json = false, per_layer = false;
};

// The model and the figures every part of the report reads.
struct Analysis {
  ModelShape m;
  DType kv = DType::kBF16, weights = DType::kBF16;
  MachineProfile mp;
  double balance = 0;  // the machine's FLOPs per byte
  ModelTotals totals;
  std::vector<LayerGroupFigures> groups;
  double intensity = 0;  // decode FLOPs per byte
  bool memory_bound = false;
  std::vector<ModelShape> sweep;  // what_if_variants
};

Analysis analyze(const Options& o) {
  auto dtype_of = [](const std::string& flag, const std::string& s) {
    if (s == "bf16") return DType::kBF16;
    if (s == "f32") return DType::kF32;
    throw UsageError{flag + " must be bf16 or f32, got '" + s + "'"};
  };
  Analysis a;
  a.kv = kv_dtype_of(o.kv_name);
  a.weights = dtype_of("--weight-dtype", o.weight_name);
  a.m = load_model(o.model, o.config);
  a.mp = machine_profile(o.peak, o.bw);
  a.balance = a.mp.fp32_peak_gflops / a.mp.dram_read_gbps;
  a.totals = model_totals(a.m, o.context, o.batch, a.kv, a.weights);
  a.groups = layer_group_figures(a.m, a.kv, o.context, o.batch);
  a.intensity = a.totals.decode_flops / a.totals.decode_bytes;
  a.memory_bound = a.intensity < a.balance;
  a.sweep = what_if_variants(a.m, o.mla_ranks);
  return a;
}

// A figure in every KV dtype the report lists.
template <typename F>
nlohmann::json per_dtype(const F& f, bool eight_bit = true) {
  nlohmann::json j = {{"bf16", f(DType::kBF16)}, {"f32", f(DType::kF32)}};
  if (eight_bit) {
    j["int8"] = f(DType::kI8);
    j["fp8_e4m3"] = f(DType::kFp8E4M3);
  }
  return j;
}

nlohmann::json model_json(const ModelShape& m) {
  nlohmann::json j = {{"name", m.name},
                      {"model_type", m.model_type},
                      {"source", m.source},
                      {"variant", variant_label(m)},
                      {"num_layers", m.num_layers},
                      {"hidden_size", m.hidden_size},
                      {"num_heads", m.num_heads},
                      {"num_kv_heads", m.num_kv_heads},
                      {"head_dim", m.head_dim},
                      {"head_dim_v", m.head_dim_v},
                      {"layer_mix", layer_mix(m)},
                      {"weight_quantization", m.weight_quantization},
                      {"index_topk", m.index_topk}};
  if (m.mla)
    j["mla"] = {{"q_lora_rank", m.q_lora_rank},
                {"kv_lora_rank", m.kv_lora_rank},
                {"qk_nope_head_dim", m.qk_nope_head_dim},
                {"qk_rope_head_dim", m.qk_rope_head_dim},
                {"v_head_dim", m.v_head_dim},
                {"rope_interleave", m.rope_interleave}};
  return j;
}

nlohmann::json sweep_json(const Analysis& a, const Options& o) {
  nlohmann::json out = nlohmann::json::array();
  for (const ModelShape& v : a.sweep) {
    const ModelTotals tv = model_totals(v, o.context, o.batch, a.kv, a.weights);
    out.push_back({{"variant", variant_label(v)},
                   {"num_kv_heads", v.num_kv_heads},
                   {"kv_lora_rank", v.kv_lora_rank},
                   {"kv_bytes_per_token_bf16", kv_bytes_per_token(v, DType::kBF16)},
                   {"kv_bytes_per_token", kv_bytes_per_token(v, a.kv)},
                   {"kv_cache_bytes", kv_cache_bytes(v, a.kv, o.context, o.batch)},
                   {"attention_params_per_layer", attention_params_per_layer(v)},
                   {"decode_arithmetic_intensity", tv.decode_flops / tv.decode_bytes}});
  }
  return out;
}

// DeepSeek sparse attention against dense MLA, whole model, per context.
nlohmann::json dsa_json(const Analysis& a, const Options& o) {
  const ModelShape& m = a.m;
  const DsaCrossover c = dsa_crossover(m, o.batch, a.kv, a.weights);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t ctx : dsa_contexts(m, o.context)) {
    const DsaLayerFigures f = dsa_model_figures(m, ctx, o.batch, a.kv, a.weights);
    rows.push_back({{"context", ctx},
                    {"dense_decode_flops", f.dense_decode_flops},
                    {"dsa_decode_flops", f.dsa_decode_flops},
                    {"dsa_indexer_decode_flops", f.dsa_indexer_decode_flops},
                    {"dense_decode_bytes", f.dense_decode_bytes},
                    {"dsa_decode_bytes", f.dsa_decode_bytes},
                    {"dense_prefill_flops", f.dense_prefill_flops},
                    {"dsa_prefill_flops", f.dsa_prefill_flops}});
  }
  return {{"index_topk", m.index_topk},
          {"index_n_heads", m.index_n_heads},
          {"index_head_dim", m.index_head_dim},
          {"indexer_params_per_layer", indexer_params(m)},
          {"indexer_key_bytes_per_token_per_layer", indexer_key_bytes_per_token(m)},
          {"rows", rows},
          {"pays_from",
           {{"decode_flops", c.decode_flops},
            {"decode_bytes", c.decode_bytes},
            {"prefill_flops", c.prefill_flops}}}};
}

nlohmann::json analysis_json(const Analysis& a, const Options& o) {
  const ModelShape& m = a.m;
  const int64_t c = o.context, b = o.batch;
  nlohmann::json j;
  j["model"] = model_json(m);
  j["context"] = c;
  j["batch"] = b;
  j["kv_dtype"] = o.kv_name;
  j["attention_params_per_layer"] = attention_params_per_layer(m);
  j["attention_params_total"] = attention_params_total(m);
  j["kv_values_per_token_per_layer"] = kv_values_per_token_per_layer(m);
  // int8 and fp8_e4m3 take the same bytes (codes and fp32 scales).
  j["kv_bytes_per_token"] = per_dtype([&](DType d) { return kv_bytes_per_token(m, d); });
  j["kv_cache_bytes"] = per_dtype([&](DType d) { return kv_cache_bytes(m, d, c, b); });
  j["linear_state_bytes"] = linear_state_bytes(m, b);
  j["cache_bytes"] = cache_bytes(m, a.kv, c, b);
  j["per_layer"] = per_layer_json(a.groups);
  j["layer_kinds"] = layer_kind_labels(m);
  if (m.mla) {
    j["mla_naive_kv_bytes_per_token"] =
        per_dtype([&](DType d) { return kv_bytes_per_token(m, d, false); }, false);
    j["mla_naive_kv_cache_bytes"] =
        per_dtype([&](DType d) { return kv_cache_bytes(m, d, c, b, false); }, false);
  }
  j["prefill_flops"] = a.totals.prefill_flops;
  j["decode_flops_per_step"] = a.totals.decode_flops;
  j["decode_bytes_per_step"] = a.totals.decode_bytes;
  j["decode_arithmetic_intensity"] = a.intensity;
  j["machine"] = {{"simd", a.mp.simd},
                  {"fp32_peak_gflops", a.mp.fp32_peak_gflops},
                  {"dram_read_gbps", a.mp.dram_read_gbps},
                  {"balance_flops_per_byte", a.balance},
                  {"threads", a.mp.threads}};
  j["decode_bound"] = a.memory_bound ? "memory" : "compute";
  j["sweep"] = sweep_json(a, o);
  if (m.index_topk > 0) j["dsa"] = dsa_json(a, o);
  return j;
}

// "x | y | z" of a byte figure in bf16, f32 and 8-bit.
template <typename F>
std::string three_dtypes(const F& f) {
  return format_bytes(static_cast<double>(f(DType::kBF16))) + " | " +
         format_bytes(static_cast<double>(f(DType::kF32))) + " | " +
         format_bytes(static_cast<double>(f(DType::kI8)));
}

Table main_table(const Analysis& a, const Options& o) {
  const ModelShape& m = a.m;
  const int64_t c = o.context, b = o.batch;
  Table t({"quantity", "value"}, /*numbers_right=*/false);
  t.add({"attention params / layer",
         format_count(static_cast<double>(attention_params_per_layer(m)))});
  t.add({linear_state_bytes(m, 1) > 0 ? "params, all layers (attention + Gated DeltaNet)"
                                      : "attention params, all layers",
         format_count(static_cast<double>(attention_params_total(m)))});
  t.add({"KV values / token / layer", std::to_string(kv_values_per_token_per_layer(m))});
  t.add({"KV / token, all layers (bf16 | f32 | 8-bit)",
         three_dtypes([&](DType d) { return kv_bytes_per_token(m, d); })});
  if (m.mla)
    t.add({"naive MLA KV / token (bf16)",
           format_bytes(static_cast<double>(kv_bytes_per_token(m, DType::kBF16, false))) + "  (" +
               std::to_string(kv_values_per_token_per_layer(m, false) /
                              kv_values_per_token_per_layer(m)) +
               "x the latent)"});
  const std::string at = " @ " + std::to_string(c) + " tok x " + std::to_string(b);
  t.add({"KV cache" + at + " (bf16 | f32 | 8-bit)",
         three_dtypes([&](DType d) { return kv_cache_bytes(m, d, c, b); })});
  for (const LayerGroupFigures& g : a.groups)
    if (g.tokens_held > 0)
      t.add({"  KV cache in the " + std::to_string(g.count) + " " + g.label + " layers (" +
                 o.kv_name + ")",
             format_bytes(g.kv_bytes)});
  if (linear_state_bytes(m, b) > 0)
    t.add({"linear-attention state x " + std::to_string(b) + " (f32, any context)",
           format_bytes(linear_state_bytes(m, b))});
  t.add({"prefill FLOPs" + at, format_flops(a.totals.prefill_flops)});
  t.add({"decode FLOPs / step" + at, format_flops(a.totals.decode_flops)});
  t.add({"decode bytes / step (" + o.kv_name + " KV, " + o.weight_name + " weights)",
         format_bytes(a.totals.decode_bytes)});
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "%.2f FLOP/B vs machine balance %.2f (%.0f GFLOP/s / %.1f GB/s, %s)", a.intensity,
                a.balance, a.mp.fp32_peak_gflops, a.mp.dram_read_gbps, a.mp.simd.c_str());
  t.add({"decode arithmetic intensity", buf});
  t.add({"decode on this machine", a.memory_bound ? "memory-bound" : "compute-bound"});
  return t;
}

// Every byte figure in the sweep is in --kv-dtype, so the columns agree.
Table sweep_table(const Analysis& a, const Options& o) {
  Table t({"variant", "kv heads", "KV/token (" + o.kv_name + ")",
           "cache @ ctx x batch (" + o.kv_name + ")", "attn params/layer", "decode intensity"});
  for (const ModelShape& v : a.sweep) {
    const ModelTotals tv = model_totals(v, o.context, o.batch, a.kv, a.weights);
    t.add({variant_label(v) + (v.mla ? " r=" + std::to_string(v.kv_lora_rank) : ""),
           v.mla ? "latent" : std::to_string(v.num_kv_heads),
           format_bytes(static_cast<double>(kv_bytes_per_token(v, a.kv))),
           format_bytes(kv_cache_bytes(v, a.kv, o.context, o.batch)),
           format_count(static_cast<double>(attention_params_per_layer(v))),
           intensity_str(tv.decode_flops / tv.decode_bytes)});
  }
  return t;
}

// What the config asks for that the figures do not count.
void print_left_out(const ModelShape& m) {
  if (!m.weight_quantization.empty())
    std::printf(
        "weights: quantization_config %s is not applied here; weights are counted in the "
        "dtype each row names\n",
        m.weight_quantization.c_str());
  if (m.index_topk > 0)
    std::printf(
        "DeepSeek sparse attention (index_topk %lld): the figures below count dense MLA (the "
        "KV bytes include the indexer keys); the DSA table at the end counts the sparse path\n",
        (long long)m.index_topk);
}

// Dense MLA vs DSA, whole model, against the context, and where DSA pays.
void print_dsa(const Analysis& a, const Options& o) {
  const ModelShape& m = a.m;
  std::printf(
      "\nDeepSeek sparse attention vs dense MLA (indexer %lld heads x %lld fp8, top %lld; "
      "%s params/layer, %lld B of indexer key / token / layer; batch %lld, %s KV, %s weights):\n",
      (long long)m.index_n_heads, (long long)m.index_head_dim, (long long)m.index_topk,
      format_count(static_cast<double>(indexer_params(m))).c_str(),
      (long long)indexer_key_bytes_per_token(m), (long long)o.batch, o.kv_name.c_str(),
      o.weight_name.c_str());
  Table t({"context", "decode FLOPs dense", "DSA", "DSA/dense", "decode bytes dense", "DSA",
           "DSA/dense", "prefill FLOPs dense", "DSA", "DSA/dense"});
  for (int64_t ctx : dsa_contexts(m, o.context)) {
    const DsaLayerFigures f = dsa_model_figures(m, ctx, o.batch, a.kv, a.weights);
    t.add({std::to_string(ctx), format_flops(f.dense_decode_flops),
           format_flops(f.dsa_decode_flops), ratio_str(f.dsa_decode_flops, f.dense_decode_flops),
           format_bytes(f.dense_decode_bytes), format_bytes(f.dsa_decode_bytes),
           ratio_str(f.dsa_decode_bytes, f.dense_decode_bytes), format_flops(f.dense_prefill_flops),
           format_flops(f.dsa_prefill_flops),
           ratio_str(f.dsa_prefill_flops, f.dense_prefill_flops)});
  }
  std::fputs(t.str().c_str(), stdout);
  const DsaCrossover c = dsa_crossover(m, o.batch, a.kv, a.weights);
  std::printf("DSA pays from: decode FLOPs %s, decode bytes %s, prefill FLOPs %s\n",
              crossover_str(c.decode_flops).c_str(), crossover_str(c.decode_bytes).c_str(),
              crossover_str(c.prefill_flops).c_str());
}

void print_text(const Analysis& a, const Options& o) {
  const ModelShape& m = a.m;
  std::printf("%s (%s, %s) — %s\n", m.name.c_str(), m.model_type.c_str(), variant_label(m).c_str(),
              m.source.c_str());
  std::printf("%s\nhidden %lld, heads %lld, kv heads %lld, head_dim %lld/%lld (q·k / v)\n",
              layer_mix(m).c_str(), (long long)m.hidden_size, (long long)m.num_heads,
              (long long)m.num_kv_heads, (long long)m.head_dim, (long long)m.head_dim_v);
  if (m.mla)
    std::printf(
        "MLA: q_lora_rank %lld, kv_lora_rank %lld, qk_nope %lld, qk_rope %lld (%s RoPE), v %lld "
        "(latent cache = kv_lora_rank + qk_rope per token per layer)\n",
        (long long)m.q_lora_rank, (long long)m.kv_lora_rank, (long long)m.qk_nope_head_dim,
        (long long)m.qk_rope_head_dim, m.rope_interleave ? "interleaved" : "half-split",
        (long long)m.v_head_dim);
  print_left_out(m);
  std::printf("\n");
  std::fputs(main_table(a, o).str().c_str(), stdout);
  if (o.per_layer) {
    std::printf("\nPer layer kind (context %lld, batch %lld):\n", (long long)o.context,
                (long long)o.batch);
    std::fputs(per_layer_table(a.groups, o.kv_name).str().c_str(), stdout);
  }
  std::printf("\nWhat if (same model, other attention; context %lld, batch %lld, %s KV):\n",
              (long long)o.context, (long long)o.batch, o.kv_name.c_str());
  std::fputs(sweep_table(a, o).str().c_str(), stdout);
  if (m.index_topk > 0) print_dsa(a, o);
}

// The flags, described; false when --help was given.
bool parse_options(int argc, char** argv, Options* po) {
  Options& o = *po;
  Flags f("analyze",
          "Exact attention arithmetic for a model: parameters, KV-cache bytes (per token and at a\n"
          "context and batch, summed layer by layer: sliding windows, attention chunks and\n"
          "linear-attention state applied), prefill and decode FLOPs, arithmetic intensity and\n"
          "whether this machine is compute- or memory-bound for decoding; then the same model\n"
          "with every valid number of kv heads and with MLA at several latent ranks.",
          {"attnkit analyze --model llama-3-8b --context 32768",
           "attnkit analyze --config path/to/config.json --batch 16 --kv-dtype f32 --json",
           "attnkit analyze --model deepseek-v3 --context 131072",
           "attnkit analyze --model deepseek-v3.2 --context 131072  (dense MLA vs DSA)",
           "attnkit analyze --model qwen3-next-80b-a3b --context 32768 --per-layer"});
  f.add_string("--model", &o.model, "a built-in preset (see attnkit presets)");
  f.add_string("--config", &o.config, "a Hugging Face config.json");
  f.add_int("--context", &o.context, "tokens per sequence (default 4096)", 1);
  f.add_int("--batch", &o.batch, "sequences (default 1)", 1);
  f.add_string("--kv-dtype", &o.kv_name,
               "bf16, f32, int8 or fp8_e4m3 for the decode figures (default bf16)");
  f.add_string("--weight-dtype", &o.weight_name,
               "bf16 or f32 weights for decode bytes (default bf16)");
  f.add_int_list("--mla-ranks", &o.mla_ranks, "kv_lora_rank values for the MLA sweep");
  f.add_double("--peak-gflops", &o.peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &o.bw, "use this read bandwidth instead of measuring");
  f.add_bool("--per-layer", &o.per_layer,
             "one row per layer kind: layers, tokens held, KV and state bytes, FLOPs");
  f.add_bool("--json", &o.json, "print JSON instead of tables (per-layer figures included)");
  return f.parse(argc, argv, 2);
}

}  // namespace

int run_analyze(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, &o)) return 0;
  const Analysis a = analyze(o);
  if (o.json)
    std::printf("%s\n", analysis_json(a, o).dump(2).c_str());
  else
    print_text(a, o);
  return 0;
}

}  // namespace attnkit::cli
