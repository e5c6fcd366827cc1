// The reads of a 1-token decode without its arithmetic: how much of the gap
// between decode and a sequential read of the same bytes the order of the
// fast kernel's reads accounts for (docs/PERFORMANCE.md, "What limits
// decode").
//
// The cache is attnkit's own KVCache layout for GQA 32/8, head_dim 128,
// fp32: K and V apart, one token's row holding all 8 kv heads plus one
// 64-byte line of padding (tile_policy.h, kPadTokenRowMultipleBytes). As
// the kernel's plan does (tile_policy.h), the keys are split into 512-token
// tasks shared by the threads, and each task walks its keys in tiles of 12
// tokens (or as many as asked). Two orders within a tile:
//   K, then V   the kernel's (task_runner.cc, tile()): every head's 12 K
//               rows (512 B each, a token row apart), then every head's V
//               rows; each 64-byte line read prefetches the line of the next
//               head's rows, the last head's K the first head's V, the last
//               head's V the next tile's first K;
//   by head     the order before it: a head's K rows then its V rows, head
//               after head; each K line prefetches the same line of V, each
//               V line the next head's K (or the next tile's first head).
// Each walk is also run without prefetches. Every call is timed against a
// sequential read of the same bytes (each task's K rows, then its V rows,
// in address order), the two alternated call by call; the report gives
// each walk's median time over the read's.
//
//   build/bench/decode_read_bench [threads, default 2] [pairs, default 30]
//       [keys per tile, default the kernel's 12]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "bench_stats.h"

namespace {

using attnkit::bench::median;

constexpr int64_t kTokens = 16384, kHeads = 8, kDim = 128;
constexpr int64_t kRow = kHeads * kDim + 64 / sizeof(float);  // padded token row, floats
constexpr int64_t kTaskTokens = 512;
// The kernel's tile for 1-token fp32 decode on AVX2 (kShortTileKeysF32).
constexpr int64_t kKernelTile = 12;
constexpr int64_t kLineFloats = 64 / sizeof(float);

enum class Walk { kSequential, kPhases, kPhasesPlain, kByHead, kByHeadPlain };
constexpr int kWalks = 5;
constexpr const char* kWalkNames[kWalks] = {"sequential", "K, then V", "K, then V, no prefetch",
                                            "by head", "by head, no prefetch"};

// XOR of the words of n floats from p, 64 bytes at a time, optionally
// prefetching the line `pf` floats on from each line read. Integer XOR,
// not float adds, so the sum is not a chain of dependent adds.
template <bool kPrefetch>
inline uint64_t read_row(const float* p, int64_t n, int64_t pf) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t i = 0; i < n; i += kLineFloats) {
    if (kPrefetch && pf != 0) __builtin_prefetch(p + i + pf);
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p + i);
    a ^= w[0] ^ w[4];
    b ^= w[1] ^ w[5];
    c ^= w[2] ^ w[6];
    d ^= w[3] ^ w[7];
  }
  return a ^ b ^ c ^ d;
}

// nk rows of kv head h from token j0 on, in K or V, each line read
// prefetching the line pf floats on.
template <bool kPrefetch>
uint64_t read_head(const float* kv, int64_t j0, int64_t nk, int64_t h, int64_t pf) {
  uint64_t x = 0;
  for (int64_t r = 0; r < nk; ++r)
    x ^= read_row<kPrefetch>(kv + (j0 + r) * kRow + h * kDim, kDim, pf);
  return x;
}

// From the last head's V rows of a tile to the next tile's first K rows;
// 0 (no prefetch) after the task's last tile.
int64_t v_to_next_tile(int64_t j0, int64_t nk, int64_t t1, int64_t k_to_v) {
  return j0 + nk < t1 ? nk * kRow - (kHeads - 1) * kDim - k_to_v : 0;
}

// One task's keys [t0, t1) in tiles: every head's K rows, then every
// head's V rows (the kernel's order), or head by head.
template <bool kPrefetch, bool kByHead>
uint64_t walk_task(const float* k, const float* v, int64_t t0, int64_t t1, int64_t tile) {
  const int64_t k_to_v = v - k;
  uint64_t x = 0;
  for (int64_t j0 = t0; j0 < t1; j0 += tile) {
    const int64_t nk = std::min(tile, t1 - j0);
    const int64_t v_last = v_to_next_tile(j0, nk, t1, k_to_v);
    if constexpr (kByHead) {
      for (int64_t h = 0; h < kHeads; ++h) {
        x ^= read_head<kPrefetch>(k, j0, nk, h, k_to_v);
        x ^= read_head<kPrefetch>(v, j0, nk, h, h + 1 < kHeads ? kDim - k_to_v : v_last);
      }
    } else {
      for (int64_t h = 0; h < kHeads; ++h)
        x ^= read_head<kPrefetch>(k, j0, nk, h,
                                  h + 1 < kHeads ? kDim : k_to_v - (kHeads - 1) * kDim);
      for (int64_t h = 0; h < kHeads; ++h)
        x ^= read_head<kPrefetch>(v, j0, nk, h, h + 1 < kHeads ? kDim : v_last);
    }
  }
  return x;
}

// The same bytes in address order (each token row's heads, not its pad).
uint64_t sequential_task(const float* k, const float* v, int64_t t0, int64_t t1) {
  uint64_t x = 0;
  for (int64_t t = t0; t < t1; ++t) x ^= read_row<false>(k + t * kRow, kHeads * kDim, 0);
  for (int64_t t = t0; t < t1; ++t) x ^= read_row<false>(v + t * kRow, kHeads * kDim, 0);
  return x;
}

// Seconds for `threads` threads to run all tasks of one call, claiming them
// in turn as the kernel's workers do.
double call(Walk walk, const float* k, const float* v, int64_t tile, int threads, uint64_t* sink) {
  std::atomic<int64_t> next{0};
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  auto work = [&](int t) {
    uint64_t x = 0;
    for (int64_t task; (task = next.fetch_add(1)) * kTaskTokens < kTokens;) {
      const int64_t t0 = task * kTaskTokens, t1 = std::min(t0 + kTaskTokens, kTokens);
      switch (walk) {
        case Walk::kSequential:
          x ^= sequential_task(k, v, t0, t1);
          break;
        case Walk::kPhases:
          x ^= walk_task<true, false>(k, v, t0, t1, tile);
          break;
        case Walk::kPhasesPlain:
          x ^= walk_task<false, false>(k, v, t0, t1, tile);
          break;
        case Walk::kByHead:
          x ^= walk_task<true, true>(k, v, t0, t1, tile);
          break;
        case Walk::kByHeadPlain:
          x ^= walk_task<false, true>(k, v, t0, t1, tile);
          break;
      }
    }
    sums[static_cast<size_t>(t)] = x;
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint64_t x : sums) *sink ^= x;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int pairs = argc > 2 ? std::atoi(argv[2]) : 30;
  const int64_t tile = argc > 3 ? std::atoll(argv[3]) : kKernelTile;
  if (threads < 1 || threads > 256 || pairs < 1 || tile < 1 || tile > kTaskTokens) {
    std::fprintf(stderr,
                 "threads must be in [1, 256], pairs >= 1 and tile keys in [1, %lld] "
                 "(got %d, %d, %lld)\n",
                 static_cast<long long>(kTaskTokens), threads, pairs, static_cast<long long>(tile));
    return 2;
  }
  // K then V in one allocation, so that the walk's K-to-V prefetch offset is
  // a distance within one array.
  const size_t floats = static_cast<size_t>(kTokens * kRow);
  std::vector<float> cache(2 * floats);
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<float>(i % 977) * 0.5f;
  const float* k = cache.data();
  const float* v = k + floats;
  const double bytes = 2.0 * kTokens * kHeads * kDim * sizeof(float);  // K and V read once
  std::printf(
      "GQA 32/8 fp32 cache, %lld keys, padded %lld-byte token rows, %.0f MiB of K and V "
      "read per call; tiles of %lld keys; %d thread(s), %d pairs\n",
      static_cast<long long>(kTokens), static_cast<long long>(kRow * sizeof(float)),
      bytes / (1 << 20), static_cast<long long>(tile), threads, pairs);

  uint64_t sink = 0;
  for (int w = 0; w < kWalks; ++w) call(static_cast<Walk>(w), k, v, tile, threads, &sink);
  std::vector<double> secs[kWalks], ratio[kWalks];
  for (int i = 0; i < pairs; ++i)
    for (int w = 1; w < kWalks; ++w) {
      // Alternate which of the pair runs first.
      const bool walk_first = (i + w) % 2 == 0;
      const Walk walk = static_cast<Walk>(w);
      double a = 0, s = 0;
      if (walk_first) a = call(walk, k, v, tile, threads, &sink);
      s = call(Walk::kSequential, k, v, tile, threads, &sink);
      if (!walk_first) a = call(walk, k, v, tile, threads, &sink);
      secs[0].push_back(s);
      secs[w].push_back(a);
      ratio[w].push_back(s / a);
    }
  for (int w = 0; w < kWalks; ++w) {
    const double m = median(secs[w]);
    std::printf("%-24s median %6.2f ms, %5.1f GB/s (%5.1f per thread)", kWalkNames[w], m * 1e3,
                bytes / m / 1e9, bytes / m / 1e9 / threads);
    if (w > 0) std::printf(", %.2f of the sequential read (median of pairs)", median(ratio[w]));
    std::printf("\n");
  }
  std::printf("(sink %llu)\n", static_cast<unsigned long long>(sink % 10));
  return 0;
}
