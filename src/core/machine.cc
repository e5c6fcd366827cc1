// Peak and bandwidth probes. Each probe is compiled for its ISA with a
// target attribute and chosen at run time, so a binary built on a machine
// with AVX-512 still runs (and measures honestly) on one without.
#include "attnkit/machine.h"

#include "core/best_run.h"
#include "core/cpu_features.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace attnkit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs fn(thread_index) on `threads` threads that start together; returns
// the wall time of the slowest.
template <typename Fn>
double timed_parallel(int threads, Fn fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      fn(t);
    });
  while (ready.load() < threads) {
  }
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  return seconds_since(t0);
}

volatile float g_sink;  // keeps probe results observable

// Horizontal sum through memory: GCC 12's _mm512_reduce_add_ps trips
// -Wuninitialized inside its own header.
__attribute__((target("avx512f"))) float hsum512(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

// Independent accumulator chains hide the FMA latency (4-5 cycles) on two
// pipes, which takes 8-10; the result is returned so the work cannot be
// optimised away. Every chain must stay in a register: AVX2 has 16, so 16
// chains plus the two operands spilled three chains to the stack, whose
// store-to-load latency halved the measured peak (57 instead of 100 GFLOP/s
// on one Zen 3 core, below what 4-token decode reached).
constexpr int kFmaChains512 = 16;
constexpr int kFmaChains256 = 12;

__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[kFmaChains512];
  for (int i = 0; i < kFmaChains512; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < kFmaChains512; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kFmaChains512; ++i) s = _mm512_add_ps(s, acc[i]);
  return hsum512(s);
}

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[kFmaChains256];
  for (int i = 0; i < kFmaChains256; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < kFmaChains256; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < kFmaChains256; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

// vdpbf16ps: 16 lanes x 2 products each, i.e. 64 FLOPs per instruction.
__attribute__((target("avx512f,avx512bf16"))) float dpbf16_avx512(int64_t iters) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  return hsum512(s);
}

__attribute__((target("avx512f"))) float read_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return hsum512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

__attribute__((target("avx2"))) float read_avx2(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

float read_scalar(const float* p, int64_t n) {
  float a[8] = {};
  for (int64_t i = 0; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) a[l] += p[i + l];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

float fma_scalar(int64_t iters) {
  float acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = static_cast<float>(i) * 1e-3f;
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// The widest vectors the active SIMD target uses (core/cpu_features.h):
// under ATTNKIT_SIMD=avx2 on an AVX-512 CPU the kernels run on 256-bit
// vectors, and a 512-bit peak would judge them against twice what they
// can reach.
int active_vector_bits() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const SimdTarget t = simd_target();
  if (avx512 && t >= SimdTarget::kAvx512) return 512;
  if (avx2 && t >= SimdTarget::kAvx2) return 256;
  return 32;
}

// The FMA probe at `bits` (512, 256, else scalar) on `threads` threads:
// the fastest run, once another matched it.
BestRun fma_probe(int threads, int bits, int64_t iters, int min_runs, int max_runs, double stable) {
  return best_until_stable(
      [&] {
        return timed_parallel(threads, [&](int) {
          g_sink = bits == 512   ? fma_avx512(iters)
                   : bits == 256 ? fma_avx2(iters)
                                 : fma_scalar(iters / 4);
        });
      },
      min_runs, max_runs, stable);
}

double peak_gflops(int threads, int bits, int64_t iters, const BestRun& fma) {
  const int lanes = bits == 512 ? 16 : bits == 256 ? 8 : 1;
  const int chains = bits == 512 ? kFmaChains512 : bits == 256 ? kFmaChains256 : 16;
  const double fma_iters = bits >= 256 ? static_cast<double>(iters) : iters / 4.0;
  return 2.0 * chains * lanes * fma_iters * threads / fma.seconds / 1e9;
}

}  // namespace

double measure_fp32_peak(int threads, int bits, bool quick) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  __builtin_cpu_init();
  if (bits == 512 && !__builtin_cpu_supports("avx512f")) return 0;
  if (bits == 256 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
  if (bits != 512 && bits != 256) bits = 32;
  const int64_t iters = quick ? 2'000'000 : 6'000'000;
  return peak_gflops(threads, bits, iters,
                     fma_probe(threads, bits, iters, quick ? 2 : 3, quick ? 8 : 20, 0.05));
}

MachineProfile measure_machine(int threads, bool quick) {
  const auto t_start = Clock::now();
  MachineProfile p;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  p.threads = threads;
  const int bits = active_vector_bits();
  const bool avx512 = bits == 512;
  const bool avx2 = bits == 256;
  p.has_avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  p.simd = avx512 ? "avx512" : avx2 ? "avx2" : "scalar";
  // Each probe keeps its fastest run (the one least disturbed by whatever
  // else the machine runs) once another run matches it: a peak measured
  // while other work held the cores came out at half, and a single run
  // cannot tell (docs/PERFORMANCE.md, "Measuring the machine").
  const int min_runs = quick ? 2 : 3, max_runs = quick ? 8 : 20;
  constexpr double kStable = 0.05;

  const int64_t iters = quick ? 2'000'000 : 6'000'000;
  const BestRun fma = fma_probe(threads, bits, iters, min_runs, max_runs, kStable);
  p.fp32_peak_gflops = peak_gflops(threads, bits, iters, fma);
  p.stable = fma.stable;

  if (p.has_avx512_bf16) {
    const BestRun bf = best_until_stable(
        [&] { return timed_parallel(threads, [&](int) { g_sink = dpbf16_avx512(iters); }); },
        min_runs, max_runs, kStable);
    p.bf16_dot_peak_gflops = 64.0 * 16.0 * static_cast<double>(iters) * threads / bf.seconds / 1e9;
    p.stable = p.stable && bf.stable;
  }

  // Read bandwidth over a buffer far larger than any last-level cache.
  const int64_t bytes = (quick ? 256ll : 512ll) << 20;
  const int64_t n = bytes / 4;
  float* buf = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
  if (buf != nullptr) {
    // First touch from the reading threads so pages sit where they are read,
    // with pseudo-random values, as a K/V cache holds. (On this project's
    // VMs the rate of this read moves between 34 and 59 GB/s from one second
    // to the next, whatever the contents; attnkit_bench therefore also
    // pairs decode calls with reads of the same bytes.)
    timed_parallel(threads, [&](int t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      uint32_t x = 0x9e3779b9u ^ static_cast<uint32_t>(t + 1);
      for (int64_t i = lo; i < hi; ++i) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        buf[i] = static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
      }
    });
    const BestRun read = best_until_stable(
        [&] {
          return timed_parallel(threads, [&](int t) {
            const int64_t lo = (n * t / threads) / 64 * 64, hi = (n * (t + 1) / threads) / 64 * 64;
            g_sink = avx512 ? read_avx512(buf + lo, hi - lo)
                     : avx2 ? read_avx2(buf + lo, hi - lo)
                            : read_scalar(buf + lo, hi - lo);
          });
        },
        min_runs, max_runs, kStable);
    p.dram_read_gbps = static_cast<double>(bytes) / read.seconds / 1e9;
    p.stable = p.stable && read.stable;
    std::free(buf);
  }
  p.seconds_spent = seconds_since(t_start);
  return p;
}

MachineCheck compare_machine_profiles(const MachineProfile& before, const MachineProfile& after,
                                      double tolerance) {
  MachineCheck c;
  c.before = before;
  c.after = after;
  c.best = before;
  c.best.stable = before.stable && after.stable;
  c.best.seconds_spent = before.seconds_spent + after.seconds_spent;
  struct Figure {
    const char* name;
    const char* unit;
    int decimals;
    double a, b;
    double* best;
  };
  const Figure figures[] = {
      {"fp32 peak", "GFLOP/s", 0, before.fp32_peak_gflops, after.fp32_peak_gflops,
       &c.best.fp32_peak_gflops},
      {"bf16 dot peak", "GFLOP/s", 0, before.bf16_dot_peak_gflops, after.bf16_dot_peak_gflops,
       &c.best.bf16_dot_peak_gflops},
      {"read bandwidth", "GB/s", 1, before.dram_read_gbps, after.dram_read_gbps,
       &c.best.dram_read_gbps},
  };
  for (const Figure& f : figures) {
    const double hi = std::max(f.a, f.b), lo = std::min(f.a, f.b);
    *f.best = hi;
    if (hi <= 0 || lo >= hi * (1.0 - tolerance)) continue;
    c.agree = false;
    char text[128];
    std::snprintf(text, sizeof text, "%s%s %.*f then %.*f %s", c.disagreement.empty() ? "" : "; ",
                  f.name, f.decimals, f.a, f.decimals, f.b, f.unit);
    c.disagreement += text;
  }
  return c;
}

}  // namespace attnkit
