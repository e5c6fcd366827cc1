// attnkit analyze: exact arithmetic for one model (no timing), plus the
// seeds' "what if" sweeps over kv heads and MLA ranks.
#include <nlohmann/json.hpp>

#include <cstdio>

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

}  // namespace

int run_analyze(int argc, char** argv) {
  std::string model, config;
  int64_t context = 4096, batch = 1;
  std::string kv_name = "bf16", weight_name = "bf16";
  std::vector<int64_t> mla_ranks = {64, 128, 256, 512};
  double peak = 0, bw = 0;
  bool json_out = false, per_layer = false;
  Flags f("analyze",
          "Exact attention arithmetic for a model: parameters, KV-cache bytes (per token and at a\n"
          "context and batch, summed layer by layer: sliding windows, attention chunks and\n"
          "linear-attention state applied), prefill and decode FLOPs, arithmetic intensity and\n"
          "whether this machine is compute- or memory-bound for decoding; then the same model\n"
          "with every valid number of kv heads and with MLA at several latent ranks.",
          {"attnkit analyze --model llama-3-8b --context 32768",
           "attnkit analyze --config path/to/config.json --batch 16 --kv-dtype f32 --json",
           "attnkit analyze --model deepseek-v3 --context 131072",
           "attnkit analyze --model qwen3-next-80b-a3b --context 32768 --per-layer"});
  f.add_string("--model", &model, "a built-in preset (see attnkit presets)");
  f.add_string("--config", &config, "a Hugging Face config.json");
  f.add_int("--context", &context, "tokens per sequence (default 4096)", 1);
  f.add_int("--batch", &batch, "sequences (default 1)", 1);
  f.add_string("--kv-dtype", &kv_name,
               "bf16, f32, int8 or fp8_e4m3 for the decode figures (default bf16)");
  f.add_string("--weight-dtype", &weight_name,
               "bf16 or f32 weights for decode bytes (default bf16)");
  f.add_int_list("--mla-ranks", &mla_ranks, "kv_lora_rank values for the MLA sweep");
  f.add_double("--peak-gflops", &peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &bw, "use this read bandwidth instead of measuring");
  f.add_bool("--per-layer", &per_layer,
             "one row per layer kind: layers, tokens held, KV and state bytes, FLOPs");
  f.add_bool("--json", &json_out, "print JSON instead of tables (per-layer figures included)");
  if (!f.parse(argc, argv, 2)) return 0;
  auto dtype_of = [](const std::string& flag, const std::string& s) {
    if (s == "bf16") return DType::kBF16;
    if (s == "f32") return DType::kF32;
    throw UsageError{flag + " must be bf16 or f32, got '" + s + "'"};
  };
  const DType kv = kv_dtype_of(kv_name), wdt = dtype_of("--weight-dtype", weight_name);
  const ModelShape m = load_model(model, config);
  const MachineProfile mp = machine_profile(peak, bw);
  const double balance = mp.fp32_peak_gflops / mp.dram_read_gbps;  // FLOPs per byte

  const ModelTotals t = model_totals(m, context, batch, kv, wdt);
  const std::vector<LayerGroupFigures> groups = layer_group_figures(m, kv, context, batch);
  const double intensity = t.decode_flops / t.decode_bytes;
  const bool memory_bound = intensity < balance;
  const int64_t params = attention_params_per_layer(m);

  nlohmann::json j;
  j["model"] = {{"name", m.name},
                {"model_type", m.model_type},
                {"source", m.source},
                {"variant", variant_label(m)},
                {"num_layers", m.num_layers},
                {"hidden_size", m.hidden_size},
                {"num_heads", m.num_heads},
                {"num_kv_heads", m.num_kv_heads},
                {"head_dim", m.head_dim},
                {"head_dim_v", m.head_dim_v},
                {"layer_mix", layer_mix(m)}};
  if (m.mla)
    j["model"]["mla"] = {{"q_lora_rank", m.q_lora_rank},
                         {"kv_lora_rank", m.kv_lora_rank},
                         {"qk_nope_head_dim", m.qk_nope_head_dim},
                         {"qk_rope_head_dim", m.qk_rope_head_dim},
                         {"v_head_dim", m.v_head_dim},
                         {"rope_interleave", m.rope_interleave}};
  j["context"] = context;
  j["batch"] = batch;
  j["kv_dtype"] = kv_name;
  j["attention_params_per_layer"] = params;
  j["attention_params_total"] = attention_params_total(m);
  j["kv_values_per_token_per_layer"] = kv_values_per_token_per_layer(m);
  // int8 and fp8_e4m3 take the same bytes (codes and fp32 scales).
  j["kv_bytes_per_token"] = {{"bf16", kv_bytes_per_token(m, DType::kBF16)},
                             {"f32", kv_bytes_per_token(m, DType::kF32)},
                             {"int8", kv_bytes_per_token(m, DType::kI8)},
                             {"fp8_e4m3", kv_bytes_per_token(m, DType::kFp8E4M3)}};
  j["kv_cache_bytes"] = {{"bf16", kv_cache_bytes(m, DType::kBF16, context, batch)},
                         {"f32", kv_cache_bytes(m, DType::kF32, context, batch)},
                         {"int8", kv_cache_bytes(m, DType::kI8, context, batch)},
                         {"fp8_e4m3", kv_cache_bytes(m, DType::kFp8E4M3, context, batch)}};
  j["linear_state_bytes"] = linear_state_bytes(m, batch);
  j["cache_bytes"] = cache_bytes(m, kv, context, batch);
  j["per_layer"] = per_layer_json(groups);
  j["layer_kinds"] = layer_kind_labels(m);
  if (m.mla) {
    j["mla_naive_kv_bytes_per_token"] = {{"bf16", kv_bytes_per_token(m, DType::kBF16, false)},
                                         {"f32", kv_bytes_per_token(m, DType::kF32, false)}};
    j["mla_naive_kv_cache_bytes"] = {
        {"bf16", kv_cache_bytes(m, DType::kBF16, context, batch, false)},
        {"f32", kv_cache_bytes(m, DType::kF32, context, batch, false)}};
  }
  j["prefill_flops"] = t.prefill_flops;
  j["decode_flops_per_step"] = t.decode_flops;
  j["decode_bytes_per_step"] = t.decode_bytes;
  j["decode_arithmetic_intensity"] = intensity;
  j["machine"] = {{"simd", mp.simd},
                  {"fp32_peak_gflops", mp.fp32_peak_gflops},
                  {"dram_read_gbps", mp.dram_read_gbps},
                  {"balance_flops_per_byte", balance},
                  {"threads", mp.threads}};
  j["decode_bound"] = memory_bound ? "memory" : "compute";

  // Every byte figure in the sweep is in --kv-dtype, so the columns agree.
  Table sweep({"variant", "kv heads", "KV/token (" + kv_name + ")",
               "cache @ ctx x batch (" + kv_name + ")", "attn params/layer", "decode intensity"});
  nlohmann::json jsweep = nlohmann::json::array();
  auto sweep_row = [&](const ModelShape& v) {
    const ModelTotals tv = model_totals(v, context, batch, kv, wdt);
    const double bytes = kv_cache_bytes(v, kv, context, batch);
    sweep.add({variant_label(v) + (v.mla ? " r=" + std::to_string(v.kv_lora_rank) : ""),
               v.mla ? "latent" : std::to_string(v.num_kv_heads),
               format_bytes(static_cast<double>(kv_bytes_per_token(v, kv))), format_bytes(bytes),
               format_count(static_cast<double>(attention_params_per_layer(v))),
               intensity_str(tv.decode_flops / tv.decode_bytes)});
    jsweep.push_back({{"variant", variant_label(v)},
                      {"num_kv_heads", v.num_kv_heads},
                      {"kv_lora_rank", v.kv_lora_rank},
                      {"kv_bytes_per_token_bf16", kv_bytes_per_token(v, DType::kBF16)},
                      {"kv_bytes_per_token", kv_bytes_per_token(v, kv)},
                      {"kv_cache_bytes", bytes},
                      {"attention_params_per_layer", attention_params_per_layer(v)},
                      {"decode_arithmetic_intensity", tv.decode_flops / tv.decode_bytes}});
  };
  if (!m.mla)
    for (int64_t n : valid_kv_head_counts(m.num_heads)) sweep_row(*with_kv_heads(m, n));
  const int64_t rope_dim =
      m.mla ? m.qk_rope_head_dim : std::min<int64_t>(64, m.head_dim / 2) / 2 * 2;
  for (int64_t r : mla_ranks) {
    ModelShape base = m;
    if (m.mla) {
      base.kv_lora_rank = r;
      base.name = m.name + " [mla r=" + std::to_string(r) + "]";
      sweep_row(base);
    } else if (auto v = with_mla(m, r, rope_dim, 0); v.ok()) {
      sweep_row(*v);
    }
  }
  j["sweep"] = jsweep;

  if (json_out) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
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
  std::printf("\n");
  Table main({"quantity", "value"}, /*numbers_right=*/false);
  main.add({"attention params / layer", format_count(static_cast<double>(params))});
  main.add({linear_state_bytes(m, 1) > 0 ? "params, all layers (attention + Gated DeltaNet)"
                                         : "attention params, all layers",
            format_count(static_cast<double>(attention_params_total(m)))});
  main.add({"KV values / token / layer", std::to_string(kv_values_per_token_per_layer(m))});
  main.add({"KV / token, all layers (bf16 | f32 | 8-bit)",
            format_bytes(static_cast<double>(kv_bytes_per_token(m, DType::kBF16))) + " | " +
                format_bytes(static_cast<double>(kv_bytes_per_token(m, DType::kF32))) + " | " +
                format_bytes(static_cast<double>(kv_bytes_per_token(m, DType::kI8)))});
  if (m.mla)
    main.add({"naive MLA KV / token (bf16)",
              format_bytes(static_cast<double>(kv_bytes_per_token(m, DType::kBF16, false))) +
                  "  (" +
                  std::to_string(kv_values_per_token_per_layer(m, false) /
                                 kv_values_per_token_per_layer(m)) +
                  "x the latent)"});
  const std::string at = " @ " + std::to_string(context) + " tok x " + std::to_string(batch);
  main.add({"KV cache" + at + " (bf16 | f32 | 8-bit)",
            format_bytes(kv_cache_bytes(m, DType::kBF16, context, batch)) + " | " +
                format_bytes(kv_cache_bytes(m, DType::kF32, context, batch)) + " | " +
                format_bytes(kv_cache_bytes(m, DType::kI8, context, batch))});
  for (const LayerGroupFigures& g : groups)
    if (g.tokens_held > 0)
      main.add({"  KV cache in the " + std::to_string(g.count) + " " + g.label + " layers (" +
                    kv_name + ")",
                format_bytes(g.kv_bytes)});
  if (linear_state_bytes(m, batch) > 0)
    main.add({"linear-attention state x " + std::to_string(batch) + " (f32, any context)",
              format_bytes(linear_state_bytes(m, batch))});
  main.add({"prefill FLOPs" + at, format_flops(t.prefill_flops)});
  main.add({"decode FLOPs / step" + at, format_flops(t.decode_flops)});
  main.add({"decode bytes / step (" + kv_name + " KV, " + weight_name + " weights)",
            format_bytes(t.decode_bytes)});
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "%.2f FLOP/B vs machine balance %.2f (%.0f GFLOP/s / %.1f GB/s, %s)", intensity,
                balance, mp.fp32_peak_gflops, mp.dram_read_gbps, mp.simd.c_str());
  main.add({"decode arithmetic intensity", buf});
  main.add({"decode on this machine", memory_bound ? "memory-bound" : "compute-bound"});
  std::fputs(main.str().c_str(), stdout);
  if (per_layer) {
    std::printf("\nPer layer kind (context %lld, batch %lld):\n", (long long)context,
                (long long)batch);
    std::fputs(per_layer_table(groups, kv_name).str().c_str(), stdout);
  }
  std::printf("\nWhat if (same model, other attention; context %lld, batch %lld, %s KV):\n",
              (long long)context, (long long)batch, kv_name.c_str());
  std::fputs(sweep.str().c_str(), stdout);
  return 0;
}

}  // namespace attnkit::cli
