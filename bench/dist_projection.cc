// dist_projection: the cost model of attnkit/parallel_cost.h for a model on
// a cluster this machine is not (the projections in docs/DISTRIBUTED.md).
// Pure arithmetic, no MPI, no timing; it also shows how a tool calls the
// model (the form `attnkit plan --ranks N --link-gbps X` will take).
//
//   dist_projection [--model llama-3-70b] [--ranks 1,2,4,8,16] [--link-gbps 100,400]
//                   [--latency-us 5] [--gflops 2000] [--read-gbps 200]
//                   [--context 32768] [--batch 1] [--kv bf16]
//
// Per strategy and rank count: weights and KV per rank (whole model), the
// bytes each rank sends per layer and token in prefill and per decode
// step, and whole-model prefill and decode step times with the share of
// them that is communication not hidden behind compute.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/analysis.h"
#include "attnkit/parallel_cost.h"

namespace {

std::vector<double> numbers(const std::string& csv) {
  std::vector<double> out;
  std::stringstream ss(csv);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::atof(item.c_str()));
  return out;
}

const char* gib(double bytes, char* buf, size_t n) {
  std::snprintf(buf, n, "%.2f", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama-3-70b", kv = "bf16";
  std::vector<double> ranks = {1, 2, 4, 8, 16}, links = {100, 400};
  attnkit::KernelRates rates{2000.0, 200.0};
  double latency_us = 5.0;
  attnkit::ParallelWorkload w;
  w.context = 32768;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--model")
      model = v;
    else if (a == "--ranks")
      ranks = numbers(v);
    else if (a == "--link-gbps")
      links = numbers(v);
    else if (a == "--latency-us")
      latency_us = std::atof(v.c_str());
    else if (a == "--gflops")
      rates.gflops = std::atof(v.c_str());
    else if (a == "--read-gbps")
      rates.read_gbps = std::atof(v.c_str());
    else if (a == "--context")
      w.context = std::atoll(v.c_str());
    else if (a == "--batch")
      w.batch = std::atoll(v.c_str());
    else if (a == "--kv")
      kv = v;
    else {
      std::fprintf(stderr, "dist_projection: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  w.kv_dtype = kv == "f32" ? attnkit::DType::kF32 : attnkit::DType::kBF16;
  attnkit::Result<attnkit::ModelShape> m = attnkit::model_preset(model);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().to_string().c_str());
    return 1;
  }
  const double layers = static_cast<double>(m->num_layers);
  std::printf(
      "%s, %ld layers; batch %ld, context %ld, KV %s, weights bf16, exchanges f32; per rank "
      "%.0f GFLOP/s, %.0f GB/s read; link latency %.1f us\n",
      model.c_str(), long(m->num_layers), long(w.batch), long(w.context), kv.c_str(), rates.gflops,
      rates.read_gbps, latency_us);
  // Bytes: sent per rank and layer, per prompt token (prefill) or per decode
  // step; times: the whole model.
  std::printf("%-17s %5s %6s | %8s %8s | %12s %12s | %10s %6s | %10s %6s\n", "strategy", "ranks",
              "Gb/s", "wts GiB", "KV GiB", "B/token/lyr", "B/step/lyr", "prefill s", "comm",
              "decode ms", "comm");
  for (double link : links)
    for (double n : ranks) {
      auto costs = attnkit::parallel_costs(*m, static_cast<int64_t>(n), w, rates,
                                           attnkit::LinkModel{link, latency_us});
      if (!costs.ok()) {
        std::fprintf(stderr, "%s\n", costs.status().to_string().c_str());
        return 1;
      }
      for (const attnkit::StrategyCost& c : *costs) {
        // One rank: the single-process row once; more: the two strategies.
        const bool single = c.strategy == attnkit::ParallelStrategy::kSingle;
        if (single != (n == 1) || (single && link != links.front())) continue;
        const char* name = attnkit::parallel_strategy_name(c.strategy);
        if (!c.feasible) {
          std::printf("%-17s %5.0f %6.0f | %s\n", name, n, link, c.infeasible_reason.c_str());
          continue;
        }
        char a[32], b[32];
        const double pre = c.prefill.step_s * layers, dec = c.decode.step_s * layers;
        std::printf(
            "%-17s %5.0f %6.0f | %8s %8s | %12.0f %12.0f | %10.3f %5.0f%% | %10.3f %5.0f%%\n", name,
            n, link, gib(c.weight_bytes_per_rank, a, sizeof a),
            gib(c.kv_bytes_per_rank, b, sizeof b), c.prefill.bytes_per_token, c.decode.bytes_sent,
            pre, 100.0 * c.prefill.exposed_comm_s / c.prefill.step_s, dec * 1e3,
            100.0 * c.decode.exposed_comm_s / c.decode.step_s);
      }
    }
  return 0;
}
