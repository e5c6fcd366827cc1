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
// ATTNKIT_SIMD=avx2 runs attnkit's AVX2 kernels; DNNL_MAX_CPU_ISA=AVX2
// makes oneDNN run as on a CPU without AVX-512 (an AMD Zen 3, say).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

struct Shape {
  int64_t out, in;
};
constexpr Shape kShapes[] = {{4096, 4096},  {1024, 4096},  {1024, 4096}, {4096, 4096},
                             {14336, 4096}, {14336, 4096}, {4096, 14336}};
constexpr size_t kRotateBytes = size_t{1} << 30;

// The layer's weights in one dtype, `copies` times.
struct Stack {
  DType dtype;
  std::vector<std::vector<uint16_t>> b16;  // per copy, all shapes back to back
  std::vector<std::vector<float>> f32;
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

}  // namespace

int main(int argc, char** argv) {
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
