// attnkit plan: given a memory budget, the largest batch (at a context) or
// the longest context (at a batch) each attention variant and KV dtype
// fits, and the decode speed that implies on this machine.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "attnkit/parallel_cost.h"
#include "cli.h"
#include "commands.h"

namespace attnkit::cli {
namespace {

struct Step {
  double seconds, flops, bytes;
};

// One decode step for `batch` sequences at `context`: the slower of reading
// its bytes at the measured bandwidth and doing its FLOPs at the measured
// peak (a roofline estimate; `attnkit bench` measures the real thing).
Step decode_step(const ModelShape& m, int64_t context, int64_t batch, DType kv,
                 const MachineProfile& mp) {
  const ModelTotals t = model_totals(m, context, batch, kv, DType::kBF16);
  Step s{0, t.decode_flops, t.decode_bytes};
  s.seconds = std::max(s.bytes / (mp.dram_read_gbps * 1e9), s.flops / (mp.fp32_peak_gflops * 1e9));
  return s;
}

// Largest context whose cache (K/V and linear-attention state) fits; -1 =
// any context fits (every layer is window- or chunk-capped, or linear).
int64_t max_context(const ModelShape& m, DType kv, int64_t batch, int64_t budget) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  if (cache_bytes(m, kv, kHuge, batch) <= static_cast<double>(budget)) return -1;
  int64_t lo = 0, hi = kHuge;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (cache_bytes(m, kv, mid, batch) <= static_cast<double>(budget) ? lo : hi) = mid;
  }
  return lo;
}

// The parallel strategies' costs (parallel_cost.h) for the model as
// configured at `batch` x `context` over `ranks` ranks: what each rank
// holds, what it sends, and the step times the cost model projects from
// this machine's measured rates and the given link. Adds "parallel" to
// `j` and prints a table unless json_out.
void print_parallel(const ModelShape& m, int64_t ranks, int64_t batch, int64_t context, DType kv,
                    int64_t budget, const MachineProfile& mp, const LinkModel& link, bool json_out,
                    nlohmann::json* j) {
  ParallelWorkload w;
  w.batch = batch;
  w.context = context;
  w.kv_dtype = kv;
  auto costs =
      parallel_costs(m, ranks, w, KernelRates{mp.fp32_peak_gflops, mp.dram_read_gbps}, link);
  if (!costs.ok()) throw UsageError{costs.status().message()};
  const double layers = static_cast<double>(m.num_layers);
  Table table({"strategy", "weights/rank", "KV/rank", "fits budget", "prefill B/token/layer",
               "decode B/layer", "prefill", "decode step", "decode comm"});
  nlohmann::json rows = nlohmann::json::array();
  for (const StrategyCost& c : *costs) {
    const char* name = parallel_strategy_name(c.strategy);
    if (!c.feasible) {
      table.add({name, "-", "-", "-", "-", "-", "-", "-", c.infeasible_reason});
      rows.push_back({{"strategy", name}, {"feasible", false}, {"reason", c.infeasible_reason}});
      continue;
    }
    const bool fits = c.kv_bytes_per_rank <= static_cast<double>(budget);
    char comm[32];
    std::snprintf(comm, sizeof comm, "%.0f %%",
                  c.decode.step_s > 0 ? 100.0 * c.decode.exposed_comm_s / c.decode.step_s : 0.0);
    table.add({name, format_bytes(c.weight_bytes_per_rank), format_bytes(c.kv_bytes_per_rank),
               fits ? "yes" : "no", format_bytes(c.prefill.bytes_per_token),
               format_bytes(c.decode.bytes_sent), format_seconds(c.prefill.step_s * layers),
               format_seconds(c.decode.step_s * layers), comm});
    rows.push_back({{"strategy", name},
                    {"feasible", true},
                    {"weight_bytes_per_rank", c.weight_bytes_per_rank},
                    {"kv_bytes_per_rank", c.kv_bytes_per_rank},
                    {"kv_fits_budget", fits},
                    {"prefill_bytes_sent_per_layer", c.prefill.bytes_sent},
                    {"prefill_bytes_per_token_per_layer", c.prefill.bytes_per_token},
                    {"prefill_messages_per_layer", c.prefill.messages},
                    {"prefill_seconds", c.prefill.step_s * layers},
                    {"prefill_exposed_comm_seconds", c.prefill.exposed_comm_s * layers},
                    {"decode_bytes_sent_per_layer", c.decode.bytes_sent},
                    {"decode_messages_per_layer", c.decode.messages},
                    {"decode_step_seconds", c.decode.step_s * layers},
                    {"decode_exposed_comm_seconds", c.decode.exposed_comm_s * layers}});
  }
  (*j)["parallel"] = {{"ranks", ranks},         {"batch", batch},
                      {"context", context},     {"kv_dtype", kv_dtype_label(kv)},
                      {"link_gbps", link.gbps}, {"link_latency_us", link.latency_us},
                      {"strategies", rows}};
  if (json_out) return;
  std::printf(
      "\nacross %lld ranks (the model as configured, batch %lld x context %lld, %s KV; per rank "
      "the budget above; a cost model, docs/DISTRIBUTED.md: the rates above, a "
      "%.0f Gbit/s link with %.0f us latency):\n\n",
      (long long)ranks, (long long)batch, (long long)context, kv_dtype_label(kv), link.gbps,
      link.latency_us);
  std::fputs(table.str().c_str(), stdout);
}

}  // namespace

int run_plan(int argc, char** argv) {
  std::string model, config;
  int64_t memory = 0, reserve = 0, context = 0, batch = 0;
  std::vector<std::string> dtypes = {"bf16", "f32"};
  double peak = 0, bw = 0, link_gbps = 100, link_latency_us = 5;
  int64_t ranks = 0;
  bool json_out = false;
  Flags f(
      "plan",
      "How far a memory budget goes for the KV cache of a model and of its variants (the model\n"
      "as configured, every GQA group size, MQA, and MLA): the largest batch at a context, or the\n"
      "longest context at a batch, per KV dtype, and the decode speed that implies on this\n"
      "machine (a roofline estimate from the measured peak and bandwidth). The budget is for\n"
      "the KV cache; use --reserve for what else must fit (weights, activations).",
      {"attnkit plan --model llama-3-8b --memory 24GiB --context 32768",
       "attnkit plan --model qwen2.5-7b --memory 80GiB --reserve 15GiB --batch 16",
       "attnkit plan --config config.json --memory 24GiB --context 8192 --json",
       "attnkit plan --model llama-3-70b --memory 80GiB --context 32768 --ranks 8 --link-gbps "
       "400"});
  f.add_string("--model", &model, "a built-in preset");
  f.add_string("--config", &config, "a Hugging Face config.json");
  f.add_bytes("--memory", &memory, "memory budget, e.g. 24GiB (required)");
  f.add_bytes("--reserve", &reserve, "part of the budget not available to the cache");
  f.add_int("--context", &context, "tokens per sequence: plan the largest batch", 1);
  f.add_int("--batch", &batch, "sequences: plan the longest context", 1);
  f.add_string_list("--kv-dtypes", &dtypes,
                    "KV dtypes to plan for: bf16, f32, int8, fp8_e4m3 (default bf16,f32)");
  f.add_double("--peak-gflops", &peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &bw, "use this read bandwidth instead of measuring");
  f.add_int("--ranks", &ranks,
            "also model the model as configured split across N ranks (head-parallel, "
            "context-parallel; docs/DISTRIBUTED.md)",
            1);
  f.add_double("--link-gbps", &link_gbps, "with --ranks: link bandwidth per rank, Gbit/s (100)");
  f.add_double("--link-latency-us", &link_latency_us,
               "with --ranks: per-message latency, microseconds (5)");
  f.add_bool("--json", &json_out, "print JSON instead of a table");
  if (!f.parse(argc, argv, 2)) return 0;
  if (!f.given("--memory")) throw UsageError{"--memory is required (e.g. --memory 24GiB)"};
  if (memory <= 0)
    throw UsageError{"--memory must be > 0, got " + std::to_string(memory) + " bytes"};
  if ((context > 0) == (batch > 0))
    throw UsageError{"give exactly one of --context N or --batch N"};
  if (reserve >= memory) throw UsageError{"--reserve must be smaller than --memory"};
  if (!(link_gbps > 0) || !std::isfinite(link_gbps))
    throw UsageError{"--link-gbps must be > 0, got " + format_sig3(link_gbps, "")};
  if (!(link_latency_us >= 0) || !std::isfinite(link_latency_us))
    throw UsageError{"--link-latency-us must be >= 0, got " + format_sig3(link_latency_us, "")};
  if (!f.given("--ranks") && (f.given("--link-gbps") || f.given("--link-latency-us")))
    throw UsageError{"--link-gbps and --link-latency-us need --ranks N"};
  std::vector<DType> kv_types;
  for (const std::string& d : dtypes) kv_types.push_back(kv_dtype_of(d, "--kv-dtypes entries"));
  const ModelShape m = load_model(model, config);
  const MachineProfile mp = machine_profile(peak, bw);
  const int64_t budget = memory - reserve;

  std::vector<ModelShape> variants = {m};
  if (!m.mla) {
    for (int64_t n : valid_kv_head_counts(m.num_heads))
      if (n != m.num_kv_heads) variants.push_back(*with_kv_heads(m, n));
    const int64_t rope_dim = std::min<int64_t>(64, m.head_dim / 2) / 2 * 2;
    if (auto v = with_mla(m, 512, rope_dim, 0); v.ok()) variants.push_back(*v);
  }

  const bool beyond_limit =
      context > 0 && m.max_position_embeddings > 0 && context > m.max_position_embeddings;
  int64_t parallel_batch = 0, parallel_context = 0;  // the as-configured row's first fit
  Table table({"variant", "KV dtype", context > 0 ? "max batch" : "max context", "cache used",
               "decode step", "tokens/s (all seqs)", "bound"});
  nlohmann::json rows = nlohmann::json::array();
  for (const ModelShape& v : variants) {
    for (DType kv : kv_types) {
      const std::string label = variant_label(v) + (&v == &variants[0] ? " (as configured)" : "");
      const char* kv_label = kv_dtype_label(kv);
      int64_t b = batch, c = context;
      std::string fit;
      // Past the model's position limit a context is not served, whatever
      // memory allows: cap the answer there and say so.
      const int64_t limit = m.max_position_embeddings;
      bool capped = false;
      int64_t memory_context = 0;  // the longest context memory allows; -1 = any
      if (context > 0) {
        const double per_sequence = cache_bytes(v, kv, context, 1);
        b = per_sequence > static_cast<double>(budget)
                ? 0
                : static_cast<int64_t>(static_cast<double>(budget) / std::max(1.0, per_sequence));
        fit = std::to_string(b);
      } else {
        c = memory_context = max_context(v, kv, batch, budget);
        if (limit > 0 && (c < 0 || c > limit)) {
          fit = std::to_string(limit) + " (model limit; memory allows " +
                (c < 0 ? std::string("any") : std::to_string(c)) + ")";
          capped = true;
          c = limit;
        } else {
          fit = c < 0 ? "any (every layer capped)" : std::to_string(c);
          if (c < 0) c = 4096;  // for the decode estimate only
        }
      }
      nlohmann::json row = {{"variant", variant_label(v)},
                            {"as_configured", &v == &variants[0]},
                            {"kv_dtype", kv_label},
                            {"num_kv_heads", v.num_kv_heads},
                            {"kv_lora_rank", v.kv_lora_rank}};
      if (b < 1 || c < 1) {
        table.add({label, kv_label, "0", "-", "-", "-", "does not fit"});
        row["fits"] = false;
        rows.push_back(row);
        continue;
      }
      if (&v == &variants[0] && parallel_batch == 0) {
        parallel_batch = b;
        parallel_context = c;
      }
      const Step s = decode_step(v, c, b, kv, mp);
      const bool mem = s.bytes / (mp.dram_read_gbps * 1e9) >= s.flops / (mp.fp32_peak_gflops * 1e9);
      const double cache = cache_bytes(v, kv, c, b);
      char tps[32];
      std::snprintf(tps, sizeof tps, "%.1f", static_cast<double>(b) / s.seconds);
      table.add({label, kv_label, fit, format_bytes(cache), format_seconds(s.seconds), tps,
                 mem ? "memory" : "compute"});
      row["fits"] = true;
      row["batch"] = b;
      row["context"] = c;
      row["context_unbounded"] = context == 0 && memory_context < 0;
      if (context == 0) {
        row["context_limited_by_model"] = capped;
        row["memory_max_context"] =
            memory_context < 0 ? nlohmann::json(nullptr) : nlohmann::json(memory_context);
      }
      row["kv_cache_bytes"] = kv_cache_bytes(v, kv, c, b);
      row["linear_state_bytes"] = linear_state_bytes(v, b);
      row["cache_bytes"] = cache;
      row["decode_step_seconds"] = s.seconds;
      row["decode_tokens_per_second"] = static_cast<double>(b) / s.seconds;
      row["bound"] = mem ? "memory" : "compute";
      rows.push_back(row);
    }
  }
  nlohmann::json parallel;
  if (ranks > 0) {
    // The workload of the as-configured row (at least one sequence of the
    // asked context, even if it does not fit one rank).
    const int64_t pb = parallel_batch > 0 ? parallel_batch : std::max<int64_t>(batch, 1);
    const int64_t pc = parallel_context > 0 ? parallel_context : std::max<int64_t>(context, 1);
    print_parallel(m, ranks, pb, pc, kv_types[0], budget, mp, LinkModel{link_gbps, link_latency_us},
                   true, &parallel);
  }
  if (json_out) {
    nlohmann::json j = {{"model", m.name},
                        {"memory_bytes", memory},
                        {"reserve_bytes", reserve},
                        {"budget_bytes", budget},
                        {"rows", rows},
                        {"machine",
                         {{"simd", mp.simd},
                          {"fp32_peak_gflops", mp.fp32_peak_gflops},
                          {"dram_read_gbps", mp.dram_read_gbps}}}};
    if (context > 0)
      j["context"] = context;
    else
      j["batch"] = batch;
    j["max_position_embeddings"] = m.max_position_embeddings;
    if (context > 0) j["context_beyond_model_limit"] = beyond_limit;
    if (ranks > 0) j["parallel"] = parallel["parallel"];
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s: KV budget %s (%s minus %s reserved), %s\n", m.name.c_str(),
              format_bytes(static_cast<double>(budget)).c_str(),
              format_bytes(static_cast<double>(memory)).c_str(),
              format_bytes(static_cast<double>(reserve)).c_str(),
              context > 0 ? ("context " + std::to_string(context)).c_str()
                          : ("batch " + std::to_string(batch)).c_str());
  std::printf(
      "decode estimate (attention layers only) from this machine: %.0f GFLOP/s fp32 peak, %.1f "
      "GB/s read (%s); "
      "attention weights in bf16\n\n",
      mp.fp32_peak_gflops, mp.dram_read_gbps, mp.simd.c_str());
  std::fputs(table.str().c_str(), stdout);
  if (beyond_limit)
    std::printf(
        "\nnote: --context %lld is past the model's max_position_embeddings (%lld); it was not "
        "trained for such positions.\n",
        (long long)context, (long long)m.max_position_embeddings);
  if (context == 0 && m.max_position_embeddings > 0)
    std::printf("\nmax context stops at the model's max_position_embeddings (%lld).\n",
                (long long)m.max_position_embeddings);
  if (ranks > 0) {
    const auto& p = parallel["parallel"];
    print_parallel(m, ranks, p["batch"].get<int64_t>(), p["context"].get<int64_t>(), kv_types[0],
                   budget, mp, LinkModel{link_gbps, link_latency_us}, false, &parallel);
  }
  return 0;
}

}  // namespace attnkit::cli
