// A decode step's projections with bf16 weights against f32 weights: the
// seven projections of a Llama-3-8B layer (q, k, v, o: 4096x4096,
// 1024x4096 twice, 4096x4096; gate, up: 14336x4096; down: 4096x14336), run
// one after the other through kernels::linear as the layers call it, for M
// rows (M sequences decoding one token each), weights rotated over copies
// of >= 1 GiB per dtype so that every step streams them from memory.
//
// Columns, per M (median of `reps` steps, the dtypes alternated so that
// the machine's moment-to-moment speed cancels in the ratios):
//   f32           f32 weights (oneDNN)
//   bf16 plan     bf16 weights as kernels::linear's plan runs them
//   bf16 stream   the stream GEMM forced (kernels/linear_bf16.h)
//   bf16 oneDNN   oneDNN forced (its bf16 kernel, or W widened to f32)
//   plan/f32      the step's time ratio (target: <= 0.6 where memory bound)
//   read          the plan's bf16 bytes / its time / the read bandwidth
//                 measured by measure_machine() in this process
//   GFLOP/s       2 M N K / time, the plan's
//
//   build/bench/linear_bf16_bench [threads, default 2] [reps, default 7]
//                                 [rows, default 1,4,16,32,64,128]
//
// --kernel: the GEMMs alone, for the plan's row limit (linear.cc,
// bf16_stream_max_rows) and the tiles' efficiency: one thread, one
// 1024 x 4096 W (8 MiB bf16, cache-resident: arithmetic, not memory),
// GFLOP per thread-CPU second (a busy machine takes the core away, which
// wall time would count), median of `reps` alternated calls of each:
//   stream        the bf16 stream GEMM
//   oneDNN bf16   oneDNN on bf16 W (its bf16 kernel, or W widened)
//   oneDNN f32    oneDNN on the same weights as f32
//   stream/oneDNN the plan streams up to the last M where this is >= 1
//   %peak         stream and f32 over one core's fp32 FMA peak at the
//                 active target's vector width, timed the same way
//
//   build/bench/linear_bf16_bench --kernel [reps, default 9]
//                                 [rows, default 1,4,8,16,24,32,48,64,96]
// ATTNKIT_SIMD=avx2 runs attnkit's AVX2 kernels; DNNL_MAX_CPU_ISA=AVX2
// makes oneDNN run as on a CPU without AVX-512 (an AMD Zen 3, say).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/machine.h"
#include "bench_stats.h"
#include "core/cpu_features.h"
#include "kernels/linear.h"

namespace {

using attnkit::DType;
using attnkit::kernels::LinearOptions;
using Clock = std::chrono::steady_clock;

// Weights 64-byte aligned, as attnkit's tensors hold them (a std::vector's
// large blocks start 16 bytes past a page, so every other 32-byte load
// would split a cache line).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  explicit Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const Aligned64&) const { return true; }
};
template <class T>
using AlignedVector = std::vector<T, Aligned64<T>>;

struct Shape {
  int64_t out, in;
};
constexpr Shape kShapes[] = {{4096, 4096},  {1024, 4096},  {1024, 4096}, {4096, 4096},
                             {14336, 4096}, {14336, 4096}, {4096, 14336}};
constexpr size_t kRotateBytes = size_t{1} << 30;

// The layer's weights in one dtype, `copies` times.
struct Stack {
  DType dtype;
  std::vector<AlignedVector<uint16_t>> b16;  // per copy, all shapes back to back
  std::vector<AlignedVector<float>> f32;
  size_t layer_bytes = 0;
  size_t copies() const { return dtype == DType::kBF16 ? b16.size() : f32.size(); }
};

Stack make_stack(DType dtype) {
  Stack s{dtype, {}, {}, 0};
  size_t elems = 0;
  for (const Shape& sh : kShapes) elems += size_t(sh.out * sh.in);
  s.layer_bytes = elems * attnkit::dtype_size(dtype);
  const size_t copies = (kRotateBytes + s.layer_bytes - 1) / s.layer_bytes;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-0.02f, 0.02f);
  for (size_t c = 0; c < copies; ++c) {
    if (dtype == DType::kBF16) {
      s.b16.emplace_back(elems);
      for (uint16_t& v : s.b16.back()) v = attnkit::float_to_bf16(u(rng)).bits;
    } else {
      s.f32.emplace_back(elems);
      for (float& v : s.f32.back()) v = attnkit::bf16_to_float(attnkit::float_to_bf16(u(rng)));
    }
  }
  return s;
}

// One step: every projection of copy `copy`, M rows. Seconds.
double step(const Stack& s, size_t copy, int64_t rows, const std::vector<float>& x,
            std::vector<float>& y, const LinearOptions& opt) {
  const auto t0 = Clock::now();
  size_t at = 0;
  for (const Shape& sh : kShapes) {
    const attnkit::kernels::Weight w =
        s.dtype == DType::kBF16 ? attnkit::kernels::Weight{s.b16[copy].data() + at, DType::kBF16}
                                : attnkit::kernels::Weight{s.f32[copy].data() + at, DType::kF32};
    attnkit::kernels::linear(x.data(), sh.in, w, nullptr, y.data(), sh.out, rows, sh.out, sh.in,
                             opt);
    at += size_t(sh.out * sh.in);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<int64_t> parse_rows(const char* text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoll(item.c_str()));
  return out;
}

double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

volatile float g_sink;

// 16 independent FMA chains, enough to fill two FMA ports of 4-cycle
// latency.
__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iters) {
  __m256 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_ps(0.001f * float(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < 16; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  return _mm256_cvtss_f32(acc[0]);
}
__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iters) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < 16; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_cvtss_f32(acc[0]);
}

// One core's fp32 FMA peak, GFLOP per thread-CPU second, at the active
// target's vector width: the best of 5.
double core_peak(bool avx512) {
  const int64_t iters = 4'000'000;
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double t0 = thread_cpu_seconds();
    g_sink = avx512 ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
    best = std::min(best, thread_cpu_seconds() - t0);
  }
  return 2.0 * 16 * (avx512 ? 16 : 8) * double(iters) / best * 1e-9;
}

int kernel_mode(int reps, const std::vector<int64_t>& row_list) {
  constexpr int64_t kOut = 1024, kIn = 4096;
  const bool avx512 = attnkit::simd_target() != attnkit::SimdTarget::kAvx2 &&
                      attnkit::simd_target() != attnkit::SimdTarget::kScalar;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.02f, 0.02f);
  AlignedVector<uint16_t> wb(size_t(kOut * kIn));
  AlignedVector<float> wf(wb.size());
  for (size_t i = 0; i < wb.size(); ++i) {
    wb[i] = attnkit::float_to_bf16(u(rng)).bits;
    wf[i] = attnkit::bf16_to_float(attnkit::bf16{wb[i]});
  }
  std::printf("linear_bf16_bench --kernel: %s, 1 thread, attnkit SIMD %s\n",
              attnkit::bench::cpu_name().c_str(),
              attnkit::simd_target_name(attnkit::simd_target()));
  std::printf("  f32 weights:  %s\n  bf16 weights: %s\n",
              attnkit::gemm_backend_name(DType::kF32).c_str(),
              attnkit::gemm_backend_name(DType::kBF16).c_str());
  const double peak = core_peak(avx512);
  std::printf(
      "  W %lld x %lld, GFLOP per thread-CPU second, median of %d; fp32 FMA peak %.1f (%s)\n",
      static_cast<long long>(kOut), static_cast<long long>(kIn), reps, peak,
      avx512 ? "zmm" : "ymm");
  std::printf("%5s %8s %12s %11s %14s %11s %12s %9s\n", "M", "stream", "oneDNN bf16", "oneDNN f32",
              "stream/oneDNN", "stream/f32", "stream %peak", "f32 %peak");
  using Choice = LinearOptions::Bf16Gemm;
  for (const int64_t rows : row_list) {
    std::vector<float> x(size_t(rows * kIn)), y(size_t(rows * kOut));
    for (float& v : x) v = u(rng) * 50.0f;
    LinearOptions base{.num_threads = 1, .backend = attnkit::Backend::kFast};
    LinearOptions stream = base, onednn = base;
    stream.bf16_gemm = Choice::kStream;
    onednn.bf16_gemm = Choice::kOneDnn;
    const attnkit::kernels::Weight b16{wb.data(), DType::kBF16}, f32{wf.data(), DType::kF32};
    // Calls of at least ~20 ms, so that the clock's tick does not count.
    const double flop = 2.0 * double(rows) * kOut * kIn;
    const int calls = std::max(1, int(2e9 / flop));
    const auto time = [&](const attnkit::kernels::Weight& w, const LinearOptions& opt) {
      const double t0 = thread_cpu_seconds();
      for (int c = 0; c < calls; ++c)
        attnkit::kernels::linear(x.data(), kIn, w, nullptr, y.data(), kOut, rows, kOut, kIn, opt);
      return flop * calls / (thread_cpu_seconds() - t0) * 1e-9;
    };
    time(b16, stream);  // warm-up: JIT, scratch
    time(b16, onednn);
    time(f32, base);
    std::vector<double> gs, go, gf, rs, rf;
    for (int r = 0; r < reps; ++r) {
      gs.push_back(time(b16, stream));
      go.push_back(time(b16, onednn));
      gf.push_back(time(f32, base));
      rs.push_back(gs.back() / go.back());
      rf.push_back(gs.back() / gf.back());
    }
    using attnkit::bench::median;
    std::printf("%5lld %8.1f %12.1f %11.1f %14.2f %11.2f %12.2f %9.2f\n",
                static_cast<long long>(rows), median(gs), median(go), median(gf), median(rs),
                median(rf), median(gs) / peak, median(gf) / peak);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--kernel") == 0) {
    const int reps = argc > 2 ? std::atoi(argv[2]) : 9;
    const std::vector<int64_t> rows = parse_rows(argc > 3 ? argv[3] : "1,4,8,16,24,32,48,64,96");
    if (reps < 1 || rows.empty()) {
      std::fprintf(stderr, "usage: linear_bf16_bench --kernel [reps] [rows,rows,...]\n");
      return 2;
    }
    return kernel_mode(reps, rows);
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const std::vector<int64_t> row_list = parse_rows(argc > 3 ? argv[3] : "1,4,16,32,64,128");
  if (threads < 1 || reps < 1 || row_list.empty()) {
    std::fprintf(stderr, "usage: linear_bf16_bench [threads] [reps] [rows,rows,...]\n");
    return 2;
  }
  const Stack f32 = make_stack(DType::kF32), bf16 = make_stack(DType::kBF16);
  const attnkit::MachineProfile mp = attnkit::measure_machine(threads, /*quick=*/true);
  std::printf("linear_bf16_bench: %s, %d threads, attnkit SIMD %s\n",
              attnkit::bench::cpu_name().c_str(), threads,
              attnkit::simd_target_name(attnkit::simd_target()));
  std::printf("  f32 weights:  %s\n  bf16 weights: %s\n",
              attnkit::gemm_backend_name(DType::kF32).c_str(),
              attnkit::gemm_backend_name(DType::kBF16).c_str());
  std::printf(
      "  measured read %.1f GB/s, fp32 FMA peak %.0f GFLOP/s (%d threads%s)\n"
      "Llama-3-8B layer projections (q k v o gate up down): f32 %.0f MiB, bf16 %.0f MiB; %zu "
      "and %zu copies rotated\n",
      mp.dram_read_gbps, mp.fp32_peak_gflops, threads, mp.stable ? "" : ", unsettled",
      double(f32.layer_bytes) / (1 << 20), double(bf16.layer_bytes) / (1 << 20), f32.copies(),
      bf16.copies());
  std::printf("%5s %10s %10s %11s %11s %9s %6s %8s\n", "M", "f32 ms", "bf16 plan", "bf16 stream",
              "bf16 oneDNN", "plan/f32", "read", "GFLOP/s");
  using Choice = LinearOptions::Bf16Gemm;
  double flops_per_row = 0;
  for (const Shape& sh : kShapes) flops_per_row += 2.0 * double(sh.out * sh.in);
  for (const int64_t rows : row_list) {
    std::vector<float> x(size_t(rows * 14336)), y(size_t(rows * 14336));
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : x) v = u(rng);
    LinearOptions base{.num_threads = threads, .backend = attnkit::Backend::kFast};
    LinearOptions stream = base, onednn = base;
    stream.bf16_gemm = Choice::kStream;
    onednn.bf16_gemm = Choice::kOneDnn;
    // Warm-up: JIT, page faults, scratch growth.
    for (size_t c = 0; c < 2; ++c) {
      step(f32, c % f32.copies(), rows, x, y, base);
      step(bf16, c % bf16.copies(), rows, x, y, base);
      step(bf16, c % bf16.copies(), rows, x, y, stream);
      step(bf16, c % bf16.copies(), rows, x, y, onednn);
    }
    std::vector<double> tf, tp, ts, to, ratio;
    size_t cf = 0, cb = 0;
    for (int r = 0; r < reps; ++r) {
      const double a = step(f32, cf++ % f32.copies(), rows, x, y, base);
      const double b = step(bf16, cb++ % bf16.copies(), rows, x, y, base);
      ts.push_back(step(bf16, cb++ % bf16.copies(), rows, x, y, stream));
      to.push_back(step(bf16, cb++ % bf16.copies(), rows, x, y, onednn));
      tf.push_back(a);
      tp.push_back(b);
      ratio.push_back(b / a);
    }
    using attnkit::bench::median;
    const double plan = median(tp);
    std::printf("%5lld %10.2f %10.2f %11.2f %11.2f %9.2f %6.2f %8.1f\n",
                static_cast<long long>(rows), median(tf) * 1e3, plan * 1e3, median(ts) * 1e3,
                median(to) * 1e3, median(ratio),
                double(bf16.layer_bytes) / plan / (mp.dram_read_gbps * 1e9),
                flops_per_row * double(rows) / plan * 1e-9);
    std::fflush(stdout);
  }
  return 0;
}
