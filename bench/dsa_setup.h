// What the DeepSeek sparse attention (DSA) benchmarks share: DeepSeek-V3.2's
// MLA and lightning-indexer sizes, the seeded filler of their random inputs
// and their stopwatch. dsa_decode_bench.cc and dsa_prefill_bench.cc time
// the same layer shape, so these live in one place: a change of shape or
// of the random stream reaches both, and their tables stay comparable.
#pragma once

#include <chrono>
#include <cstdint>

namespace attnkit::bench::dsa {

// The layer (DeepSeek-V3.2's config.json): 128 query heads; the latent
// cache row is kv_lora_rank 512 then the 64 RoPE dimensions.
constexpr int64_t kHeads = 128, kLatent = 512, kRope = 64, kRow = kLatent + kRope;
// The lightning indexer: 64 heads of 128 fp8 values, the top 2048 keys.
constexpr int64_t kIndexHeads = 64, kIndexDim = 128, kTopk = 2048;

// A xorshift64* stream: the same inputs on every run and machine, without
// <random>'s distributions, whose output the standard leaves open.
struct Fill {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  uint64_t bits() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  // Uniform in [-1, 1).
  float next() { return static_cast<float>(static_cast<double>(bits() >> 11) * 0x1p-53 * 2 - 1); }
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace attnkit::bench::dsa
