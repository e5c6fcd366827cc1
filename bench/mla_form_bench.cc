// mla_form_bench: naive vs absorbed MLA, decode and prefill, at a real
// model's layer shape with random weights (public API only).
//
//   mla_form_bench [--model v3|v2|v2-lite|kimi-k2]
//                  [--cases 1@512,1@4096,64,256,64@4096] [--reps 3] [--threads 0]
//
// A case T@L times one forward of T new tokens over L cached tokens in each
// form: 1@L is decode, T (= T@0) prefill, T@L with both > 0 a chunked
// prefill. The cache is refilled with the same L random rows before every
// timed call (LatentCache::append, untimed). Runs are paired and alternate
// which form goes first; each cell is a median over --reps, in wall and in
// process-CPU seconds, and n/a is the median of the paired naive/absorbed
// ratios. On a shared machine trust the CPU column and the ratios. The auto
// column is the form LatentAttention::choose_form picks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/latent_attention.h"
#include "bench_stats.h"

namespace {

using attnkit::DType;
using attnkit::LatentAttention;
using attnkit::MlaConfig;
using attnkit::MlaForm;
using attnkit::bench::median;

struct Preset {
  const char* name;
  int64_t hidden, heads, q_lora;
};

// Every preset shares kv_lora 512, nope 128, rope 64, v 128.
constexpr Preset kPresets[] = {{"v3", 7168, 128, 1536},
                               {"v2", 5120, 128, 1536},
                               {"v2-lite", 2048, 16, 0},
                               {"kimi-k2", 7168, 64, 1536}};

// xorshift64*: fast, deterministic fill for hundreds of MB of weights.
struct Fill {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  float next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<float>(
        static_cast<double>((s * 2685821657736338717ull) >> 11) * 0x1p-53 * 2.0 - 1.0);
  }
  std::vector<float> vec(int64_t n, float scale) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& e : v) e = next() * scale;
    return v;
  }
};

// "T@L,T@L,..." -> (T new tokens, L cached tokens) pairs; "T" alone = T@0.
std::vector<std::pair<int64_t, int64_t>> parse_cases(const char* text) {
  std::vector<std::pair<int64_t, int64_t>> out;
  std::string s = text;
  size_t at = 0;
  while (at < s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    const std::string item = s.substr(at, comma - at);
    const size_t sep = item.find('@');
    const int64_t T = std::atoll(item.substr(0, sep).c_str());
    const int64_t L = sep == std::string::npos ? 0 : std::atoll(item.substr(sep + 1).c_str());
    if (T < 1 || L < 0) {
      std::fprintf(stderr, "mla_form_bench: bad case '%s' (want T@L, T >= 1, L >= 0)\n",
                   item.c_str());
      std::exit(2);
    }
    out.emplace_back(T, L);
    at = comma + 1;
  }
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Process CPU time (all threads): far less sensitive than wall time to
// other jobs on a shared machine.
double cpu_s() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

void die(const attnkit::Status& st) {
  if (st.ok()) return;
  std::fprintf(stderr, "mla_form_bench: %s\n", st.to_string().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "v3";
  std::vector<std::pair<int64_t, int64_t>> cases = parse_cases("1@512,1@4096,64,256,64@4096");
  int reps = 3, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--model" && v)
      model = v, ++i;
    else if (a == "--cases" && v)
      cases = parse_cases(v), ++i;
    else if (a == "--reps" && v)
      reps = std::max(1, std::atoi(v)), ++i;
    else if (a == "--threads" && v)
      threads = std::atoi(v), ++i;
    else {
      std::fprintf(stderr,
                   "usage: mla_form_bench [--model v3|v2|v2-lite|kimi-k2] [--cases T@L,..] "
                   "[--reps N] [--threads N]\n");
      return 2;
    }
  }
  const Preset* p = nullptr;
  for (const Preset& q : kPresets)
    if (model == q.name) p = &q;
  if (!p) {
    std::fprintf(stderr, "mla_form_bench: unknown --model %s\n", model.c_str());
    return 2;
  }

  MlaConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = p->hidden;
  c.num_attention_heads = p->heads;
  c.q_lora_rank = p->q_lora;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  auto made = LatentAttention::create(c);
  die(made.status());
  LatentAttention layer = std::move(made).value();

  // Random weights, U(-1, 1)/sqrt(fan_in), gains 1; freed after loading.
  {
    Fill fill;
    attnkit::WeightMap map;
    std::vector<std::vector<float>> keep;
    const auto add = [&](const std::string& name, int64_t out, int64_t in) {
      keep.push_back(in == 0 ? std::vector<float>(static_cast<size_t>(out), 1.0f)
                             : fill.vec(out * in, static_cast<float>(1.0 / std::sqrt(double(in)))));
      map[name] = in == 0 ? attnkit::make_view(keep.back().data(), DType::kF32, {out})
                          : attnkit::make_view(keep.back().data(), DType::kF32, {out, in});
    };
    keep.reserve(8);
    const int64_t H = c.num_attention_heads, d = c.hidden_size, dqk = c.qk_head_dim();
    if (c.q_lora_rank > 0) {
      add("q_a_proj.weight", c.q_lora_rank, d);
      add("q_a_layernorm.weight", c.q_lora_rank, 0);
      add("q_b_proj.weight", H * dqk, c.q_lora_rank);
    } else {
      add("q_proj.weight", H * dqk, d);
    }
    add("kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d);
    add("kv_a_layernorm.weight", c.kv_lora_rank, 0);
    add("kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
    add("o_proj.weight", d, H * c.v_head_dim);
    die(layer.load_weights(map));
  }

  attnkit::RunOptions run;
  run.num_threads = threads;
  Fill fill;
  const int64_t d = c.hidden_size, row = c.cache_values_per_token();
  std::printf(
      "model %s: hidden %lld, heads %lld, q_lora %lld, kv_lora 512, d_qk 192, d_v 128\n"
      "median of %d paired runs (forms alternate first); wall and process-CPU seconds\n",
      p->name, static_cast<long long>(d), static_cast<long long>(c.num_attention_heads),
      static_cast<long long>(c.q_lora_rank), reps);
  std::printf("\n%6s %6s | %10s %10s %7s | %10s %10s %7s | %8s\n", "T", "L", "naive_wall",
              "abs_wall", "n/a", "naive_cpu", "abs_cpu", "n/a", "auto");

  // One row per (T new tokens, L cached tokens): decode is T = 1, prefill
  // L = 0, chunked prefill both > 0.
  for (const auto& [T, L] : cases) {
    // Cached rows: latent ~ U(-1, 1) (RMS-normed scale), rope key likewise.
    const std::vector<float> rows = fill.vec(L * row, 1.0f);
    const std::vector<float> x = fill.vec(T * d, 1.0f);
    std::vector<float> out(static_cast<size_t>(T * d));
    auto cache = layer.new_cache(1, L + T);
    die(cache.status());
    std::vector<double> wall[2], cpu[2], wall_ratio, cpu_ratio;
    const MlaForm forms[2] = {MlaForm::kNaive, MlaForm::kAbsorbed};
    for (int r = 0; r < reps; ++r) {
      double w[2], u[2];
      for (int k = 0; k < 2; ++k) {
        const int f = (r + k) % 2;  // alternate which form goes first
        cache->reset();
        if (L > 0) die(cache->append(attnkit::make_view(rows.data(), DType::kF32, {1, L, row})));
        const double w0 = now_s(), c0 = cpu_s();
        die(layer.forward(attnkit::make_view(x.data(), DType::kF32, {1, T, d}),
                          attnkit::make_view(out.data(), DType::kF32, {1, T, d}), {},
                          &cache.value(), run, forms[f]));
        w[f] = now_s() - w0;
        u[f] = cpu_s() - c0;
        wall[f].push_back(w[f]);
        cpu[f].push_back(u[f]);
      }
      wall_ratio.push_back(w[0] / w[1]);
      cpu_ratio.push_back(u[0] / u[1]);
    }
    std::printf("%6lld %6lld | %10.4f %10.4f %7.2f | %10.4f %10.4f %7.2f | %8s\n",
                static_cast<long long>(T), static_cast<long long>(L), median(wall[0]),
                median(wall[1]), median(wall_ratio), median(cpu[0]), median(cpu[1]),
                median(cpu_ratio), attnkit::mla_form_name(layer.choose_form(T, L)));
    std::fflush(stdout);
  }
  return 0;
}
