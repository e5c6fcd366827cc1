// Benchmarks of the gated delta rule kernels (Gated DeltaNet's recurrence,
// src/kernels/gated_delta_rule_params.h) at one linear-attention layer of
// Qwen3-Next-80B-A3B: 16 key heads, 32 value heads, key and value head dims
// 128 (a 2 MiB f32 state per sequence). Against this machine's own limits,
// measured in-process (attnkit::measure_machine):
//   decode   one token per sequence, the recurrent form. Calls rotate over
//            copies of the states totalling >= 512 MiB, so every call finds
//            its state in DRAM; each call alternates with a plain read of
//            another copy of the same bytes, and `frac_paired_read` is the
//            median of read time / call time over the pairs (the call also
//            writes the state back, which the read does not).
//   prefill  one sequence of 2K / 8K / 32K tokens, the chunked form: time
//            per token (linear in length: 32K / 8K near 4) and the rate of
//            its matrix products' FMAs (as executed: the key-only products
//            once per key head, the triangular ones halved) as
//            `frac_fma_peak`; on a shared machine also per second of CPU
//            time the process got (`frac_fma_peak_cpu`: FMAs / process CPU
//            seconds, against the peak / threads, so time lost to other
//            processes does not count, and pool threads that spin do).
//            The peak is the active SIMD target's: with ATTNKIT_SIMD=avx2
//            on an AVX-512 machine, a 256-bit FMA peak measured here.
//            `prefill/.../chunked/N` reads q, k, v token-major (the public
//            API's layout); `prefill/.../chunked_head_major/N` the same rows
//            head-major, as the GatedDeltaNet layer passes them.
//   layouts  the chunked prefill of 8K / 32K tokens on token-major q, k, v
//            (every head of a token in one row) and on a head-major copy
//            (the layer's layout), alternated: `speedup_head_major`.
//   phases   the chunked prefill of 8K / 32K tokens on one thread with a
//            clock read between its phases
//            (kernels::cpu::gated_delta_rule_chunked_timed): each phase's
//            share of the time, and each product phase's FMA rate against
//            the peak measured for ATTNKIT_BENCH_THREADS threads (run it
//            with 1).
//   layer    one GatedDeltaNet layer's forward (random f32 weights,
//            hidden 2048) over one sequence of 8K / 32K tokens: time per
//            token, with the recurrence's share measured beside it; the
//            split of the rest (projections, conv, norms, gates) comes from
//            a profile (docs/LINEAR_ATTENTION.md).
// The summary at the end prints the ratios.
//
//   build/bench/gated_delta_rule_bench                     # everything
//   build/bench/gated_delta_rule_bench --benchmark_filter=decode
// ATTNKIT_BENCH_THREADS sets the thread count (default 2).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "attnkit/gated_deltanet.h"
#include "attnkit/machine.h"
#include "bench_stats.h"
#include "core/cpu_features.h"
#include "kernels/cpu/gated_delta_rule_cpu.h"
#include "kernels/dispatch.h"
#include "kernels/gated_delta_rule_params.h"

namespace attnkit {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::GatedDeltaRuleParams;
using kernels::GdrForm;

constexpr int64_t kHk = 16, kHv = 32, kDk = 128, kDv = 128;
constexpr int64_t kWidth = 2 * kHk * kDk + kHv * kDv;  // floats per token row: q | k | v
constexpr int64_t kStateFloats = kHv * kDk * kDv;      // per sequence
// The decode rotation: as large as measure_machine's DRAM probe, since this
// VM reports a 480 MiB L3 and a 128 MiB rotation left the paired reads of
// the larger batches partly in it (they ran faster than the DRAM probe).
constexpr size_t kRotateBytes = size_t{512} << 20;

int threads() {
  static const int n = [] {
    const char* env = std::getenv("ATTNKIT_BENCH_THREADS");
    return env ? std::max(1, std::atoi(env)) : 2;
  }();
  return n;
}

const MachineProfile& machine() {
  static const MachineProfile m = measure_machine(threads());
  return m;
}

// CPU seconds of every thread of this process so far.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// 12 independent chains of 256-bit FMAs (as measure_machine's AVX2 probe:
// enough to cover the latency on two pipes, few enough to stay in AVX2's 16
// registers); returns the sum so the work is kept.
__attribute__((target("avx2,fma"))) float fma_chains_avx2(int64_t iters) {
  typedef float V8 __attribute__((vector_size(32)));
  V8 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = V8{} + static_cast<float>(i) * 1e-3f;
  const V8 a = V8{} + 0.999999f, b = V8{} + 1e-7f;
  for (int64_t n = 0; n < iters; ++n)
    for (V8& x : acc) x = x * a + b;
  float s = 0;
  for (const V8& x : acc) s += x[0] + x[7];
  return s;
}

// The fp32 FMA peak the prefill's fractions are taken of, all threads: for
// the AVX2 target (ATTNKIT_SIMD=avx2 on an AVX-512 machine) 256-bit FMAs
// measured here the same way (best of repeated runs on threads() threads),
// since a kernel limited to 8 lanes is judged against what 8 lanes can do
// (about half the AVX-512 peak on this machine's cores); otherwise
// measure_machine's, the widest the CPU has.
double peak_gflops() {
  static const double peak = [] {
    if (simd_target() != SimdTarget::kAvx2 || machine().simd == "avx2")
      return machine().fp32_peak_gflops;
    constexpr int64_t kIters = 6'000'000;
    double best = 1e30;
    for (int run = 0; run < 7; ++run) {
      std::vector<std::thread> pool;
      std::vector<float> sink(threads());
      const auto t0 = Clock::now();
      for (int i = 0; i < threads(); ++i)
        pool.emplace_back([&sink, i] { sink[i] = fma_chains_avx2(kIters); });
      for (std::thread& th : pool) th.join();
      best = std::min(best, seconds_since(t0));
      benchmark::DoNotOptimize(sink.data());
    }
    return 2.0 * 12 * 8 * static_cast<double>(kIters) * threads() / best / 1e9;
  }();
  return peak;
}

// 64-byte aligned floats (the layer's Tensors are aligned the same way).
struct Floats {
  explicit Floats(size_t n)
      : p(static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64))), size(n) {}
  struct Free {
    void operator()(float* f) const { std::free(f); }
  };
  std::unique_ptr<float, Free> p;
  size_t size;
  float* data() const { return p.get(); }
};

// Values in [lo, hi) from a 32-bit LCG (fast enough for the 512 MiB of
// decode states; any values do, the kernels' time does not depend on them).
void fill(Floats& f, float lo, float hi, uint32_t seed) {
  uint32_t x = seed;
  for (size_t i = 0; i < f.size; ++i) {
    x = x * 1664525u + 1013904223u;
    f.data()[i] = lo + (hi - lo) * static_cast<float>(x >> 8) * 0x1p-24f;
  }
}

// A sequential read of n floats (the paired read), summed so it is not elided.
float read_all(const float* p, size_t n) {
  float s[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) s[j] += p[i + j];
  return s[0] + s[15];
}

GatedDeltaRuleParams params(int64_t batch, int64_t seq, const Floats& rows, const Floats& g,
                            const Floats& beta, float* state, Floats& out, GdrForm form) {
  GatedDeltaRuleParams p;
  p.batch = batch;
  p.seq = seq;
  p.num_k_heads = kHk;
  p.num_v_heads = kHv;
  p.key_head_dim = kDk;
  p.value_head_dim = kDv;
  p.q = rows.data();
  p.k = p.q + kHk * kDk;
  p.v = p.q + 2 * kHk * kDk;
  p.q_stride = p.k_stride = p.v_stride = kWidth;
  p.g = g.data();
  p.beta = beta.data();
  p.state = state;
  p.out = out.data();
  p.out_stride = kHv * kDv;
  p.num_threads = threads();
  p.form = form;
  return p;
}

struct Summary {
  std::map<int64_t, double> decode_paired, decode_gbs;  // by batch
  struct Prefill {
    double s = 0, frac = 0, frac_cpu = 0;  // best repetition
  };
  std::map<int64_t, Prefill> prefill[2];          // [head-major][seq]
  std::map<int64_t, std::vector<double>> phases;  // by seq: seconds per phase
  std::map<int64_t, double> layer_s;              // by seq
};
Summary& summary() {
  static Summary s;
  return s;
}

void BM_Decode(benchmark::State& st) {
  const int64_t batch = st.range(0);
  const size_t set_floats = static_cast<size_t>(batch * kStateFloats);
  const size_t sets = std::max<size_t>(2, (kRotateBytes + set_floats * 4 - 1) / (set_floats * 4));
  Floats states(set_floats * sets), rows(batch * kWidth), g(batch * kHv), beta(batch * kHv),
      out(batch * kHv * kDv);
  fill(states, -0.5f, 0.5f, 1);
  fill(rows, -0.1f, 0.1f, 2);
  fill(g, -0.1f, 0.0f, 3);
  fill(beta, 0.0f, 1.0f, 4);
  (void)machine();
  std::vector<double> paired;
  double step_total = 0;
  size_t i = 0;
  float sink = 0;
  for (auto _ : st) {
    const size_t s = i++ % sets;
    const GatedDeltaRuleParams p =
        params(batch, 1, rows, g, beta, states.data() + s * set_floats, out, GdrForm::kRecurrent);
    const auto t0 = Clock::now();
    const Status ok = kernels::run_gated_delta_rule(p, Backend::kFast);
    const double step = seconds_since(t0);
    if (!ok.ok()) st.SkipWithError(ok.message().c_str());
    st.SetIterationTime(step);
    step_total += step;
    // The paired read: another copy, as cold as the one the call read.
    const auto t1 = Clock::now();
    sink += read_all(states.data() + ((s + sets / 2) % sets) * set_floats, set_floats);
    paired.push_back(seconds_since(t1) / step);
  }
  benchmark::DoNotOptimize(sink);
  const double bytes = static_cast<double>(set_floats) * 4;
  const double gbs = bytes * static_cast<double>(st.iterations()) / step_total / 1e9;
  st.counters["state_MiB"] = bytes / (1 << 20);
  st.counters["state_GBps"] = gbs;
  st.counters["frac_dram_bw"] = gbs / machine().dram_read_gbps;
  st.counters["frac_paired_read"] = bench::median(paired);
  summary().decode_paired[batch] = bench::median(paired);
  summary().decode_gbs[batch] = gbs;
}
BENCHMARK(BM_Decode)
    ->Name("decode/qwen3next80b/recurrent")
    ->Arg(1)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.3);

// FMAs of the chunked form's products for one sequence of `seq` tokens
// (kernels/cpu/gated_delta_rule_cpu.h), as they execute: per chunk of n,
// K K^T and Q K^T (n n dk each) once per key head; per value head K S0,
// Q S0 and the state update (n dk dv each), and the triangular solve and
// lower-triangular (D * Q K^T) U, about n n dv / 2 each.
double chunked_fmas(int64_t seq) {
  double f = 0;
  for (int64_t c0 = 0; c0 < seq; c0 += kernels::kGdrChunk) {
    const double n = static_cast<double>(std::min(kernels::kGdrChunk, seq - c0));
    f += kHk * 2 * n * n * kDk + kHv * (3 * n * kDk * kDv + n * n * kDv);
  }
  return f;
}

// The layer's layout of the same rows: q heads, k heads, v heads, each
// head's rows one run ([head][token][dim]), as GatedDeltaNet writes its
// 256-row blocks; `tm` the token-major params, `heads` seq * kWidth floats.
GatedDeltaRuleParams head_major(const GatedDeltaRuleParams& tm, const Floats& rows, Floats& heads) {
  const int64_t seq = tm.seq, kd = kHk * kDk;
  for (int64_t t = 0; t < seq; ++t) {
    const float* row = rows.data() + t * kWidth;
    for (int64_t h = 0; h < 2 * kHk; ++h)  // q heads, then k heads
      std::copy(row + h * kDk, row + (h + 1) * kDk, heads.data() + (h * seq + t) * kDk);
    for (int64_t h = 0; h < kHv; ++h)
      std::copy(row + 2 * kd + h * kDv, row + 2 * kd + (h + 1) * kDv,
                heads.data() + 2 * kd * seq + (h * seq + t) * kDv);
  }
  GatedDeltaRuleParams hm = tm;
  hm.q = heads.data();
  hm.k = hm.q + kd * seq;
  hm.v = hm.q + 2 * kd * seq;
  hm.q_stride = hm.k_stride = kDk;
  hm.v_stride = kDv;
  hm.q_head_stride = hm.k_head_stride = seq * kDk;
  hm.v_head_stride = seq * kDv;
  return hm;
}

// One chunked prefill per iteration; `by_head`: q, k, v head-major (the
// layer's layout, head_major()), else token-major (the public API's, every
// head of a token in one row).
void prefill(benchmark::State& st, bool by_head) {
  const int64_t seq = st.range(0);
  Floats rows(seq * kWidth), heads(by_head ? seq * kWidth : 0), g(seq * kHv), beta(seq * kHv),
      out(seq * kHv * kDv), state(kStateFloats);
  fill(rows, -0.1f, 0.1f, 5);
  fill(g, -0.1f, 0.0f, 6);
  fill(beta, 0.0f, 1.0f, 7);
  (void)peak_gflops();
  GatedDeltaRuleParams p = params(1, seq, rows, g, beta, state.data(), out, GdrForm::kChunked);
  if (by_head) p = head_major(p, rows, heads);
  double best = 1e30, best_cpu = 1e30;
  for (auto _ : st) {
    std::fill_n(state.data(), kStateFloats, 0.0f);
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    const Status ok = kernels::run_gated_delta_rule(p, Backend::kFast);
    const double s = seconds_since(t0);
    best_cpu = std::min(best_cpu, process_cpu_seconds() - c0);
    if (!ok.ok()) st.SkipWithError(ok.message().c_str());
    st.SetIterationTime(s);
    best = std::min(best, s);
  }
  const double gflops = 2 * chunked_fmas(seq) / best / 1e9;
  const double frac_cpu = 2 * chunked_fmas(seq) / best_cpu / 1e9 / (peak_gflops() / threads());
  st.counters["best_ms"] = best * 1e3;
  st.counters["us_per_token"] = best / static_cast<double>(seq) * 1e6;
  st.counters["GFLOPs"] = gflops;
  st.counters["frac_fma_peak"] = gflops / peak_gflops();
  st.counters["frac_fma_peak_cpu"] = frac_cpu;
  Summary::Prefill& row = summary().prefill[by_head][seq];
  row.s = best;
  row.frac = gflops / peak_gflops();
  row.frac_cpu = frac_cpu;
}
void BM_Prefill(benchmark::State& st) { prefill(st, false); }
void BM_PrefillHeadMajor(benchmark::State& st) { prefill(st, true); }
BENCHMARK(BM_Prefill)
    ->Name("prefill/qwen3next80b/chunked")
    ->Arg(2048)
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(BM_PrefillHeadMajor)
    ->Name("prefill/qwen3next80b/chunked_head_major")
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

// The chunked prefill of one sequence on two layouts of the same q, k, v,
// alternated in each iteration (the order swapped every other one):
// token-major (every head of a token in one row, as the public API passes
// them) and head-major (each head's rows one run, [head][token][dim], as
// the GatedDeltaNet layer writes its blocks). Medians of the repeats.
void BM_PrefillLayouts(benchmark::State& st) {
  const int64_t seq = st.range(0);
  Floats rows(seq * kWidth), heads(seq * kWidth), g(seq * kHv), beta(seq * kHv),
      out(seq * kHv * kDv), state(kStateFloats);
  fill(rows, -0.1f, 0.1f, 5);
  fill(g, -0.1f, 0.0f, 6);
  fill(beta, 0.0f, 1.0f, 7);
  (void)peak_gflops();
  const GatedDeltaRuleParams tm =
      params(1, seq, rows, g, beta, state.data(), out, GdrForm::kChunked);
  const GatedDeltaRuleParams hm = head_major(tm, rows, heads);
  std::vector<double> t_tm, t_hm, ratio;
  int64_t i = 0;
  for (auto _ : st) {
    double sec[2];
    for (int k = 0; k < 2; ++k) {
      const bool head_major = (k + i) % 2 == 1;
      std::fill_n(state.data(), kStateFloats, 0.0f);
      const auto t0 = Clock::now();
      const Status ok = kernels::run_gated_delta_rule(head_major ? hm : tm, Backend::kFast);
      sec[head_major] = seconds_since(t0);
      if (!ok.ok()) st.SkipWithError(ok.message().c_str());
    }
    ++i;
    st.SetIterationTime(sec[0] + sec[1]);
    t_tm.push_back(sec[0]);
    t_hm.push_back(sec[1]);
    ratio.push_back(sec[0] / sec[1]);
  }
  const double flops = 2 * chunked_fmas(seq) / 1e9;
  st.counters["frac_fma_peak_token_major"] = flops / bench::median(t_tm) / peak_gflops();
  st.counters["frac_fma_peak_head_major"] = flops / bench::median(t_hm) / peak_gflops();
  st.counters["speedup_head_major"] = bench::median(ratio);
}
BENCHMARK(BM_PrefillLayouts)
    ->Name("layouts/qwen3next80b/chunked")
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(5);

// FMAs of each phase of the chunked form (kernels::cpu::GdrPhase) for one
// sequence of `seq` tokens, as they execute (see chunked_fmas); 0 for the
// phases that are no products.
std::vector<double> phase_fmas(int64_t seq) {
  using namespace kernels::cpu;
  std::vector<double> f(kGdrNumPhases, 0.0);
  for (int64_t c0 = 0; c0 < seq; c0 += kernels::kGdrChunk) {
    const double n = static_cast<double>(std::min(kernels::kGdrChunk, seq - c0));
    f[kGdrPhaseKeyProducts] += kHk * 2 * n * n * kDk;
    f[kGdrPhaseKS0] += kHv * n * kDk * kDv;
    f[kGdrPhaseSolve] += kHv * n * (n - 1) / 2 * kDv;
    f[kGdrPhaseOutput] += kHv * (n * kDk * kDv + n * (n + 1) / 2 * kDv);
    f[kGdrPhaseState] += kHv * n * kDk * kDv;
  }
  return f;
}

void BM_PrefillPhases(benchmark::State& st) {
  const int64_t seq = st.range(0);
  Floats rows(seq * kWidth), g(seq * kHv), beta(seq * kHv), out(seq * kHv * kDv),
      state(kStateFloats);
  fill(rows, -0.1f, 0.1f, 5);
  fill(g, -0.1f, 0.0f, 6);
  fill(beta, 0.0f, 1.0f, 7);
  GatedDeltaRuleParams p = params(1, seq, rows, g, beta, state.data(), out, GdrForm::kChunked);
  p.num_threads = 1;
  Floats scratch(kernels::cpu::gated_delta_rule_chunked_scratch(p));
  (void)peak_gflops();
  std::vector<double> best;
  double best_total = 1e30;
  for (auto _ : st) {
    std::fill_n(state.data(), kStateFloats, 0.0f);
    std::vector<double> sec(kernels::cpu::kGdrNumPhases);
    const auto t0 = Clock::now();
    kernels::cpu::gated_delta_rule_chunked_timed(p, simd_target(), scratch.data(), sec.data());
    const double total = seconds_since(t0);
    st.SetIterationTime(total);
    if (total < best_total) {
      best_total = total;
      best = sec;
    }
  }
  const std::vector<double> fmas = phase_fmas(seq);
  for (int i = 0; i < kernels::cpu::kGdrNumPhases; ++i)
    st.counters["ms_phase" + std::to_string(i)] = best[i] * 1e3;
  st.counters["frac_fma_peak"] = 2 * chunked_fmas(seq) / best_total / 1e9 / peak_gflops();
  summary().phases[seq] = best;
}
BENCHMARK(BM_PrefillPhases)
    ->Name("phases/qwen3next80b/chunked")
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

// One layer at Qwen3-Next-80B-A3B's linear shape, f32 weights drawn at the
// scale of the layer tests (any values do for time).
void BM_Layer(benchmark::State& st) {
  const int64_t seq = st.range(0), hidden = 2048;
  const int64_t kd = kHk * kDk, vd = kHv * kDv, channels = 2 * kd + vd;
  GatedDeltaNetConfig c{.hidden_size = hidden,
                        .num_k_heads = kHk,
                        .num_v_heads = kHv,
                        .key_head_dim = kDk,
                        .value_head_dim = kDv,
                        .conv_kernel = 4};
  Floats qkvz((2 * kd + 2 * vd) * hidden), ba(2 * kHv * hidden), conv(channels * 4), a_log(kHv),
      dt_bias(kHv), norm(kDv), wout(hidden * vd), x(seq * hidden), y(seq * hidden);
  fill(qkvz, -0.02f, 0.02f, 11);
  fill(ba, -0.02f, 0.02f, 12);
  fill(conv, -0.5f, 0.5f, 13);
  fill(a_log, -1.0f, 1.0f, 14);
  fill(dt_bias, -4.0f, 1.0f, 15);
  fill(norm, 0.5f, 1.5f, 16);
  fill(wout, -0.015f, 0.015f, 17);
  fill(x, -1.0f, 1.0f, 18);
  WeightMap m;
  m["in_proj_qkvz.weight"] = make_view(qkvz.data(), DType::kF32, {2 * kd + 2 * vd, hidden});
  m["in_proj_ba.weight"] = make_view(ba.data(), DType::kF32, {2 * kHv, hidden});
  m["conv1d.weight"] = make_view(conv.data(), DType::kF32, {channels, 1, 4});
  m["A_log"] = make_view(a_log.data(), DType::kF32, {kHv});
  m["dt_bias"] = make_view(dt_bias.data(), DType::kF32, {kHv});
  m["norm.weight"] = make_view(norm.data(), DType::kF32, {kDv});
  m["out_proj.weight"] = make_view(wout.data(), DType::kF32, {hidden, vd});
  auto layer = GatedDeltaNet::create(c);
  if (!layer.ok()) return st.SkipWithError(layer.status().message().c_str());
  if (Status s = layer->load_weights(m); !s.ok()) return st.SkipWithError(s.message().c_str());
  const TensorView xv = make_view(x.data(), DType::kF32, {1, seq, hidden});
  const TensorView yv = make_view(y.data(), DType::kF32, {1, seq, hidden});
  RunOptions run;
  run.num_threads = threads();
  double best = 1e30;
  for (auto _ : st) {
    const auto t0 = Clock::now();
    const Status ok = layer->forward(xv, yv, nullptr, run);
    const double s = seconds_since(t0);
    if (!ok.ok()) st.SkipWithError(ok.message().c_str());
    st.SetIterationTime(s);
    best = std::min(best, s);
  }
  st.counters["best_ms"] = best * 1e3;
  st.counters["us_per_token"] = best / static_cast<double>(seq) * 1e6;
  summary().layer_s[seq] = best;
}
BENCHMARK(BM_Layer)
    ->Name("layer/qwen3next80b")
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

void print_summary() {
  const Summary& s = summary();
  const MachineProfile& m = machine();
  std::printf("\n%s, %d threads: fp32 FMA peak %.0f GFLOP/s (%s), DRAM read %.1f GB/s\n",
              bench::cpu_name().c_str(), threads(), m.fp32_peak_gflops, m.simd.c_str(),
              m.dram_read_gbps);
  if (!s.prefill[0].empty() || !s.prefill[1].empty() || !s.phases.empty())
    std::printf("kernels' SIMD target %s: fractions of an FMA peak of %.0f GFLOP/s\n",
                simd_target_name(simd_target()), peak_gflops());
  for (auto [batch, frac] : s.decode_paired)
    std::printf("decode, batch %lld: state %.1f GB/s, %.2f of the paired read\n",
                static_cast<long long>(batch), s.decode_gbs.at(batch), frac);
  for (int by_head = 0; by_head < 2; ++by_head) {
    const auto& rows = s.prefill[by_head];
    const char* layout = by_head ? "head-major" : "token-major";
    for (const auto& [seq, r] : rows)
      std::printf(
          "prefill %lld tokens, %s: %.3f s, %.2f us/token, %.2f of FMA peak (%.2f per CPU "
          "second)\n",
          static_cast<long long>(seq), layout, r.s, r.s / static_cast<double>(seq) * 1e6, r.frac,
          r.frac_cpu);
    if (rows.count(8192) && rows.count(32768))
      std::printf("prefill 32K / 8K time, %s: %.2f (linear: 4)\n", layout,
                  rows.at(32768).s / rows.at(8192).s);
    if (rows.count(2048) && rows.count(8192))
      std::printf("prefill 8K / 2K time, %s: %.2f (linear: 4)\n", layout,
                  rows.at(8192).s / rows.at(2048).s);
  }
  for (const auto& [seq, sec] : s.phases) {
    double total = 0;
    for (double x : sec) total += x;
    const std::vector<double> fmas = phase_fmas(seq);
    std::printf("phases of the chunked prefill, %lld tokens, 1 thread (%s): %.3f s\n",
                static_cast<long long>(seq), simd_target_name(simd_target()), total);
    for (int i = 0; i < kernels::cpu::kGdrNumPhases; ++i) {
      const auto phase = static_cast<kernels::cpu::GdrPhase>(i);
      std::printf("  %-40s %8.1f ms %5.1f%%", kernels::cpu::gdr_phase_name(phase), sec[i] * 1e3,
                  100 * sec[i] / total);
      if (fmas[i] > 0)
        std::printf("  %.2f of FMA peak", 2 * fmas[i] / sec[i] / 1e9 / peak_gflops());
      std::printf("\n");
    }
  }
  for (auto [seq, sec] : s.layer_s)
    std::printf("layer, %lld tokens: %.3f s, %.1f us/token\n", static_cast<long long>(seq), sec,
                sec / static_cast<double>(seq) * 1e6);
  if (s.layer_s.count(8192) && s.layer_s.count(32768))
    std::printf("layer 32K / 8K time: %.2f (linear: 4)\n",
                s.layer_s.at(32768) / s.layer_s.at(8192));
}

}  // namespace
}  // namespace attnkit

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  attnkit::print_summary();
  benchmark::Shutdown();
  return 0;
}
