// Peak memory of a long causal prefill through the public sdpa: the
// process's peak resident set (VmHWM) after the call, minus what it held
// before the inputs were made, minus the inputs and the output themselves,
// is what the kernel allocated on the way (scratch, task lists, partials).
// The kernels promise scratch that does not grow with the key count: at 32K
// tokens it stays far below 64 MiB (measured figures: docs/PERFORMANCE.md).
//
//   build/bench/prefill_memory_bench [tokens=32768] [threads=2] [kv=f32|bf16]
//
// GQA 32/8, head_dim 128, causal. Prints the bytes and the time of the call.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "attnkit/attention.h"

namespace {

// A field of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 if absent.
int64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::strtoll(line.c_str() + key.size(), nullptr, 10) * 1024;
  return -1;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  using namespace attnkit;
  const int64_t S = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const DType kv = argc > 3 && std::strcmp(argv[3], "bf16") == 0 ? DType::kBF16 : DType::kF32;
  const int64_t H = 32, Hkv = 8, D = 128;
  if (S < 1 || threads < 1) {
    std::fprintf(stderr, "usage: %s [tokens >= 1] [threads >= 1] [f32|bf16]\n", argv[0]);
    return 2;
  }
  const int64_t before = status_bytes("VmRSS");

  // Inputs and output, every page touched (filled), so they are resident.
  const size_t qn = static_cast<size_t>(S * H * D), kvn = static_cast<size_t>(S * Hkv * D);
  std::vector<float> q(qn), out(qn);
  std::vector<uint16_t> kv_storage(2 * kvn * (kv == DType::kBF16 ? 1 : 2));
  uint32_t x = 12345;
  auto next = [&x] {  // xorshift: cheap values in [-1, 1)
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
  };
  for (float& v : q) v = next();
  std::fill(out.begin(), out.end(), 0.0f);
  char* kvp = reinterpret_cast<char*>(kv_storage.data());
  const size_t elem = dtype_size(kv);
  for (size_t i = 0; i < 2 * kvn; ++i) {
    const float v = next();
    if (kv == DType::kBF16) {
      const bf16 h = float_to_bf16(v);
      std::memcpy(kvp + 2 * i, &h, 2);
    } else {
      std::memcpy(kvp + 4 * i, &v, 4);
    }
  }
  const int64_t io_bytes = static_cast<int64_t>((2 * qn) * sizeof(float) + 2 * kvn * elem);

  AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  const auto t0 = std::chrono::steady_clock::now();
  const Status st =
      sdpa(make_view(q.data(), DType::kF32, {1, S, H, D}), make_view(kvp, kv, {1, S, Hkv, D}),
           make_view(kvp + kvn * elem, kv, {1, S, Hkv, D}),
           make_view(out.data(), DType::kF32, {1, S, H, D}), o);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.to_string().c_str());
    return 1;
  }
  const int64_t peak = status_bytes("VmHWM");
  const int64_t extra = peak - before - io_bytes;
  std::printf(
      "prefill GQA 32/8, head_dim 128, causal, %lld tokens, %s K/V, %d threads: %.2f s\n"
      "  resident before inputs %.1f MiB; inputs + output %.1f MiB; peak %.1f MiB\n"
      "  peak - before - inputs - output = %.1f MiB (target <= 64 MiB)\n",
      static_cast<long long>(S), kv == DType::kBF16 ? "bf16" : "f32", threads, seconds, mib(before),
      mib(io_bytes), mib(peak), mib(extra));
  return 0;
}
