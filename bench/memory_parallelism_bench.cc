// How many cache-line misses one core keeps in flight: the bound on any
// read that the hardware prefetchers do not run ahead of. On the Zen 3 it
// is below what 1-token decode reads per thread, so the decode is carried
// by the L2 streamer as a sequential read is, not by its own prefetches
// alone (memory_parallelism_bench 512, 2026-11-24 at ba80e07 on a Zen 3:
// docs/PERFORMANCE.md#what-limits-decode).
//
// Each thread follows k independent chains of dependent loads through a
// random cyclic order of the 64-byte lines of its own buffer (>> LLC), so
// every load misses every cache and no hardware prefetcher can guess the
// next line: exactly k misses are ever outstanding, if the core has room
// for k. Time per step gives the latency at k = 1; by Little's law,
//   lines in flight = (lines per second) x (latency at k = 1),
// which grows with k until the core's miss buffers are full and then
// flattens: the flat value is the core's memory parallelism for demand
// misses, and 64 B x that / latency the most a core can read that way.
// The buffers use 2 MiB pages where the kernel grants them
// (MADV_HUGEPAGE), so that the chains wait on memory rather than on
// address translation; the report says how much of them it got.
//
//   build/bench/memory_parallelism_bench [MiB per thread, default 512]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_stats.h"

namespace {

using attnkit::bench::median;

constexpr int64_t kLine = 64;
constexpr int64_t kHuge = int64_t{2} << 20;
constexpr int kRepeats = 7;

// A buffer of `bytes` on 2 MiB boundaries, advised to use huge pages.
struct Buffer {
  char* raw = nullptr;
  size_t raw_bytes = 0;
  uint64_t* lines = nullptr;  // line i starts at lines[i * 8]
  int64_t count = 0;

  explicit Buffer(int64_t bytes) {
    raw_bytes = static_cast<size_t>(bytes + kHuge);
    void* p = mmap(nullptr, raw_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
    raw = static_cast<char*>(p);
    char* aligned = raw + (kHuge - reinterpret_cast<uintptr_t>(raw) % kHuge) % kHuge;
    madvise(aligned, static_cast<size_t>(bytes), MADV_HUGEPAGE);
    lines = reinterpret_cast<uint64_t*>(aligned);
    count = bytes / kLine;
  }
  ~Buffer() { munmap(raw, raw_bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // One cycle through all lines in random order (Sattolo's algorithm);
  // each line's first word is the index of the next.
  void link(uint64_t seed) {
    std::vector<uint32_t> order(static_cast<size_t>(count));
    std::iota(order.begin(), order.end(), 0u);
    std::mt19937_64 rng(seed);
    for (int64_t i = count - 1; i > 0; --i) {
      std::uniform_int_distribution<int64_t> pick(0, i - 1);
      std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(pick(rng))]);
    }
    for (int64_t i = 0; i < count; ++i)
      lines[static_cast<int64_t>(order[static_cast<size_t>(i)]) * 8] =
          order[static_cast<size_t>((i + 1) % count)];
    start_points.assign(order.begin(), order.end());
  }
  std::vector<uint32_t> start_points;  // the cycle, in order
};

// Follows K chains `steps` steps each; the K loads of a step are
// independent, so the core may overlap them. Returns the last indices'
// sum so that nothing is optimised away.
template <int K>
uint64_t chase(const uint64_t* lines, const uint32_t* cycle, int64_t count, int64_t steps) {
  uint64_t at[K];
  for (int c = 0; c < K; ++c) at[c] = cycle[static_cast<int64_t>(c) * (count / K)];
  for (int64_t s = 0; s < steps; ++s)
    for (int c = 0; c < K; ++c) at[c] = lines[at[c] * 8];
  uint64_t sum = 0;
  for (int c = 0; c < K; ++c) sum += at[c];
  return sum;
}

using ChaseFn = uint64_t (*)(const uint64_t*, const uint32_t*, int64_t, int64_t);
struct Width {
  int k;
  ChaseFn fn;
};
constexpr Width kWidths[] = {{1, &chase<1>},   {2, &chase<2>},   {4, &chase<4>},   {8, &chase<8>},
                             {12, &chase<12>}, {16, &chase<16>}, {20, &chase<20>}, {24, &chase<24>},
                             {32, &chase<32>}, {48, &chase<48>}, {64, &chase<64>}};

// Seconds for each of `threads` threads to run `fn` on its own buffer at
// once; the slowest thread's time.
double run(std::vector<Buffer*>& buffers, ChaseFn fn, int64_t steps, int threads, uint64_t* sink) {
  std::vector<double> secs(static_cast<size_t>(threads));
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const Buffer& b = *buffers[static_cast<size_t>(t)];
      const auto t0 = std::chrono::steady_clock::now();
      sums[static_cast<size_t>(t)] = fn(b.lines, b.start_points.data(), b.count, steps);
      secs[static_cast<size_t>(t)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  for (auto& th : pool) th.join();
  for (uint64_t s : sums) *sink += s;
  return *std::max_element(secs.begin(), secs.end());
}

// Kilobytes of the process's memory in 2 MiB pages.
long huge_kib() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string key;
  long value = 0;
  while (f >> key) {
    if (key == "AnonHugePages:") {
      f >> value;
      return value;
    }
    f.ignore(1 << 10, '\n');
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 512;
  if (mib < 64) {
    std::fprintf(stderr, "MiB per thread must be at least 64 (far above the LLC): %lld\n",
                 static_cast<long long>(mib));
    return 2;
  }
  Buffer b0(mib << 20), b1(mib << 20);
  b0.link(1);
  b1.link(2);
  std::vector<Buffer*> buffers = {&b0, &b1};
  std::printf("buffers: 2 x %lld MiB, %ld MiB of them in 2 MiB pages\n",
              static_cast<long long>(mib), huge_kib() >> 10);

  uint64_t sink = 0;
  for (int threads = 1; threads <= 2; ++threads) {
    std::printf("\n%d thread(s), median (best) of %d runs\n", threads, kRepeats);
    std::printf("%6s %16s %16s %18s\n", "chains", "ns/step", "GB/s/thread", "lines in flight");
    double latency_ns = 0, best_latency_ns = 0;
    for (const Width& w : kWidths) {
      // ~60 ms per run at k = 1, less as k grows.
      const int64_t steps = std::max<int64_t>(int64_t{400000} / w.k, 20000);
      std::vector<double> secs;
      run(buffers, w.fn, steps / 4, threads, &sink);  // warm the TLB and the code
      for (int r = 0; r < kRepeats; ++r) secs.push_back(run(buffers, w.fn, steps, threads, &sink));
      // The best run too: a shared machine's noise only ever adds time, so
      // the fastest run is the closest to what the core itself allows.
      const double s = median(secs), best = *std::min_element(secs.begin(), secs.end());
      const double step_ns = s / static_cast<double>(steps) * 1e9;
      const double best_step_ns = best / static_cast<double>(steps) * 1e9;
      if (w.k == 1) {
        latency_ns = step_ns;
        best_latency_ns = best_step_ns;
      }
      const double lines_per_us = static_cast<double>(steps) * w.k / s / 1e6;
      const double best_lines_per_us = static_cast<double>(steps) * w.k / best / 1e6;
      std::printf("%6d %8.1f (%5.1f) %8.2f (%5.2f) %10.1f (%5.1f)\n", w.k, step_ns, best_step_ns,
                  lines_per_us * kLine / 1e3, best_lines_per_us * kLine / 1e3,
                  lines_per_us * latency_ns / 1e3, best_lines_per_us * best_latency_ns / 1e3);
    }
  }
  std::printf("\n(sink %llu)\n", static_cast<unsigned long long>(sink % 10));
  return 0;
}
