// attnkit plan: given a memory budget, the largest batch (at a context) or
// the longest context (at a batch) each attention variant and KV dtype
// fits, and the decode speed that implies on this machine.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "attnkit/parallel_cost.h"
#include "attnkit/report.h"
#include "cli.h"
#include "commands.h"

namespace attnkit::cli {
namespace {

struct Options {
  std::string model, config;
  int64_t memory = 0, reserve = 0, context = 0, batch = 0;
  std::vector<std::string> dtypes = {"bf16", "f32"};
  double peak = 0, bw = 0, link_gbps = 100, link_latency_us = 5;
  int64_t ranks = 0;
  bool json = false;
};

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

// The plan: the model, its budget, and one row per variant and KV dtype.
struct Planned {
  ModelShape model;
  MachineProfile machine;
  int64_t budget = 0;
  std::vector<DType> kv_types;
  struct Row {
    ModelShape variant;
    bool as_configured = false;
    DType kv = DType::kBF16;
    MemoryFit fit;
    DecodeEstimate step;  // when fit.fits
  };
  std::vector<Row> rows;
  int64_t parallel_batch = 0, parallel_context = 0;  // the as-configured row's first fit
};

Planned make_plan(const Options& o) {
  Planned p;
  for (const std::string& d : o.dtypes) p.kv_types.push_back(kv_dtype_of(d, "--kv-dtypes entries"));
  p.model = load_model(o.model, o.config);
  p.machine = machine_profile(o.peak, o.bw);
  p.budget = o.memory - o.reserve;
  const std::vector<ModelShape> variants = plan_variants(p.model);
  for (size_t i = 0; i < variants.size(); ++i)
    for (DType kv : p.kv_types) {
      Planned::Row r{variants[i], i == 0, kv, {}, {}};
      r.fit = fit_memory(r.variant, kv, o.context, o.batch, static_cast<double>(p.budget),
                         p.model.max_position_embeddings);
      if (r.fit.fits) {
        r.step = estimate_decode_step(r.variant, r.fit.context, r.fit.batch, kv, DType::kBF16,
                                      p.machine.fp32_peak_gflops, p.machine.dram_read_gbps);
        if (r.as_configured && p.parallel_batch == 0) {
          p.parallel_batch = r.fit.batch;
          p.parallel_context = r.fit.context;
        }
      }
      p.rows.push_back(r);
    }
  return p;
}

// The "max batch" / "max context" cell.
std::string fit_cell(const Planned::Row& r, const Options& o, int64_t limit) {
  if (o.context > 0) return std::to_string(r.fit.batch);
  const int64_t c = r.fit.memory_max_context;
  if (r.fit.capped_by_model)
    return std::to_string(limit) + " (model limit; memory allows " +
           (c < 0 ? std::string("any") : std::to_string(c)) + ")";
  return c < 0 ? "any (every layer capped)" : std::to_string(c);
}

nlohmann::json row_json(const Planned::Row& r, const Options& o) {
  const ModelShape& v = r.variant;
  nlohmann::json row = {{"variant", variant_label(v)},
                        {"as_configured", r.as_configured},
                        {"kv_dtype", kv_dtype_label(r.kv)},
                        {"num_kv_heads", v.num_kv_heads},
                        {"kv_lora_rank", v.kv_lora_rank}};
  row["fits"] = r.fit.fits;
  if (!r.fit.fits) return row;
  const int64_t b = r.fit.batch, c = r.fit.context;
  row["batch"] = b;
  row["context"] = c;
  row["context_unbounded"] = o.context == 0 && r.fit.context_unbounded;
  if (o.context == 0) {
    row["context_limited_by_model"] = r.fit.capped_by_model;
    row["memory_max_context"] = r.fit.memory_max_context < 0
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(r.fit.memory_max_context);
  }
  row["kv_cache_bytes"] = kv_cache_bytes(v, r.kv, c, b);
  row["linear_state_bytes"] = linear_state_bytes(v, b);
  row["cache_bytes"] = cache_bytes(v, r.kv, c, b);
  row["decode_step_seconds"] = r.step.seconds;
  row["decode_tokens_per_second"] = static_cast<double>(b) / r.step.seconds;
  row["bound"] = r.step.memory_bound ? "memory" : "compute";
  return row;
}

Table plan_table(const Planned& p, const Options& o) {
  Table table({"variant", "KV dtype", o.context > 0 ? "max batch" : "max context", "cache used",
               "decode step", "tokens/s (all seqs)", "bound"});
  for (const Planned::Row& r : p.rows) {
    const std::string label =
        variant_label(r.variant) + (r.as_configured ? " (as configured)" : "");
    const char* kv_label = kv_dtype_label(r.kv);
    if (!r.fit.fits) {
      table.add({label, kv_label, "0", "-", "-", "-", "does not fit"});
      continue;
    }
    const double cache = cache_bytes(r.variant, r.kv, r.fit.context, r.fit.batch);
    char tps[32];
    std::snprintf(tps, sizeof tps, "%.1f", static_cast<double>(r.fit.batch) / r.step.seconds);
    table.add({label, kv_label, fit_cell(r, o, p.model.max_position_embeddings),
               format_bytes(cache), format_seconds(r.step.seconds), tps,
               r.step.memory_bound ? "memory" : "compute"});
  }
  return table;
}

bool beyond_limit(const Planned& p, const Options& o) {
  return o.context > 0 && p.model.max_position_embeddings > 0 &&
         o.context > p.model.max_position_embeddings;
}

void print_plan_json(const Planned& p, const Options& o, const nlohmann::json& parallel) {
  const MachineProfile& mp = p.machine;
  nlohmann::json rows = nlohmann::json::array();
  for (const Planned::Row& r : p.rows) rows.push_back(row_json(r, o));
  nlohmann::json j = {{"model", p.model.name},
                      {"memory_bytes", o.memory},
                      {"reserve_bytes", o.reserve},
                      {"budget_bytes", p.budget},
                      {"rows", rows},
                      {"machine",
                       {{"simd", mp.simd},
                        {"fp32_peak_gflops", mp.fp32_peak_gflops},
                        {"dram_read_gbps", mp.dram_read_gbps}}}};
  if (o.context > 0)
    j["context"] = o.context;
  else
    j["batch"] = o.batch;
  j["max_position_embeddings"] = p.model.max_position_embeddings;
  if (o.context > 0) j["context_beyond_model_limit"] = beyond_limit(p, o);
  if (o.ranks > 0) j["parallel"] = parallel["parallel"];
  std::printf("%s\n", j.dump(2).c_str());
}

void print_plan_text(const Planned& p, const Options& o) {
  const MachineProfile& mp = p.machine;
  const ModelShape& m = p.model;
  std::printf("%s: KV budget %s (%s minus %s reserved), %s\n", m.name.c_str(),
              format_bytes(static_cast<double>(p.budget)).c_str(),
              format_bytes(static_cast<double>(o.memory)).c_str(),
              format_bytes(static_cast<double>(o.reserve)).c_str(),
              o.context > 0 ? ("context " + std::to_string(o.context)).c_str()
                            : ("batch " + std::to_string(o.batch)).c_str());
  std::printf(
      "decode estimate (attention layers only) from this machine: %.0f GFLOP/s fp32 peak, %.1f "
      "GB/s read (%s); "
      "attention weights in bf16\n\n",
      mp.fp32_peak_gflops, mp.dram_read_gbps, mp.simd.c_str());
  std::fputs(plan_table(p, o).str().c_str(), stdout);
  if (beyond_limit(p, o))
    std::printf(
        "\nnote: --context %lld is past the model's max_position_embeddings (%lld); it was not "
        "trained for such positions.\n",
        (long long)o.context, (long long)m.max_position_embeddings);
  if (o.context == 0 && m.max_position_embeddings > 0)
    std::printf("\nmax context stops at the model's max_position_embeddings (%lld).\n",
                (long long)m.max_position_embeddings);
}

// The flags, described and checked; false when --help was given.
bool parse_options(int argc, char** argv, Options* po) {
  Options& o = *po;
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
  f.add_string("--model", &o.model, "a built-in preset");
  f.add_string("--config", &o.config, "a Hugging Face config.json");
  f.add_bytes("--memory", &o.memory, "memory budget, e.g. 24GiB (required)");
  f.add_bytes("--reserve", &o.reserve, "part of the budget not available to the cache");
  f.add_int("--context", &o.context, "tokens per sequence: plan the largest batch", 1);
  f.add_int("--batch", &o.batch, "sequences: plan the longest context", 1);
  f.add_string_list("--kv-dtypes", &o.dtypes,
                    "KV dtypes to plan for: bf16, f32, int8, fp8_e4m3 (default bf16,f32)");
  f.add_double("--peak-gflops", &o.peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &o.bw, "use this read bandwidth instead of measuring");
  f.add_int("--ranks", &o.ranks,
            "also model the model as configured split across N ranks (head-parallel, "
            "context-parallel; docs/DISTRIBUTED.md)",
            1);
  f.add_double("--link-gbps", &o.link_gbps, "with --ranks: link bandwidth per rank, Gbit/s (100)");
  f.add_double("--link-latency-us", &o.link_latency_us,
               "with --ranks: per-message latency, microseconds (5)");
  f.add_bool("--json", &o.json, "print JSON instead of a table");
  if (!f.parse(argc, argv, 2)) return false;
  if (!f.given("--memory")) throw UsageError{"--memory is required (e.g. --memory 24GiB)"};
  if (o.memory <= 0)
    throw UsageError{"--memory must be > 0, got " + std::to_string(o.memory) + " bytes"};
  if ((o.context > 0) == (o.batch > 0))
    throw UsageError{"give exactly one of --context N or --batch N"};
  if (o.reserve >= o.memory) throw UsageError{"--reserve must be smaller than --memory"};
  if (!(o.link_gbps > 0) || !std::isfinite(o.link_gbps))
    throw UsageError{"--link-gbps must be > 0, got " + format_sig3(o.link_gbps, "")};
  if (!(o.link_latency_us >= 0) || !std::isfinite(o.link_latency_us))
    throw UsageError{"--link-latency-us must be >= 0, got " + format_sig3(o.link_latency_us, "")};
  if (!f.given("--ranks") && (f.given("--link-gbps") || f.given("--link-latency-us")))
    throw UsageError{"--link-gbps and --link-latency-us need --ranks N"};
  return true;
}

}  // namespace

int run_plan(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, &o)) return 0;
  const Planned p = make_plan(o);
  const LinkModel link{o.link_gbps, o.link_latency_us};
  nlohmann::json parallel;
  if (o.ranks > 0) {
    // The workload of the as-configured row (at least one sequence of the
    // asked context, even if it does not fit one rank).
    const int64_t pb = p.parallel_batch > 0 ? p.parallel_batch : std::max<int64_t>(o.batch, 1);
    const int64_t pc =
        p.parallel_context > 0 ? p.parallel_context : std::max<int64_t>(o.context, 1);
    print_parallel(p.model, o.ranks, pb, pc, p.kv_types[0], p.budget, p.machine, link, true,
                   &parallel);
  }
  if (o.json) {
    print_plan_json(p, o, parallel);
    return 0;
  }
  print_plan_text(p, o);
  if (o.ranks > 0) {
    const auto& q = parallel["parallel"];
    print_parallel(p.model, o.ranks, q["batch"].get<int64_t>(), q["context"].get<int64_t>(),
                   p.kv_types[0], p.budget, p.machine, link, false, &parallel);
  }
  return 0;
}

}  // namespace attnkit::cli
