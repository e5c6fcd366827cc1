#include "measure.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cli.h"

namespace attnkit::cli {

void ok_or_throw(const Status& st, const std::string& what) {
  if (!st.ok()) throw RunError{what + ": " + st.message()};
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Timing time_median(const std::function<void(int64_t)>& fn, double budget_s, int min_samples,
                   int max_samples, int max_calls_per_sample) {
  int64_t call = 0;
  double t0 = now_seconds();
  fn(call++);
  const double first = std::max(now_seconds() - t0, 1e-9);
  Timing t;
  t.calls_per_sample = static_cast<int>(
      std::clamp(std::ceil(1e-3 / first), 1.0, static_cast<double>(max_calls_per_sample)));
  std::vector<double> per_call;
  const double start = now_seconds();
  while (static_cast<int>(per_call.size()) < max_samples &&
         (static_cast<int>(per_call.size()) < min_samples || now_seconds() - start < budget_s)) {
    t0 = now_seconds();
    for (int c = 0; c < t.calls_per_sample; ++c) fn(call++);
    per_call.push_back((now_seconds() - t0) / t.calls_per_sample);
  }
  std::sort(per_call.begin(), per_call.end());
  const size_t n = per_call.size();
  t.median = n % 2 ? per_call[n / 2] : 0.5 * (per_call[n / 2 - 1] + per_call[n / 2]);
  t.min = per_call.front();
  t.samples = static_cast<int>(n);
  return t;
}

void fill_uniform(const TensorView& t, uint64_t seed, double stddev) {
  // Uniform on [-a, a] has standard deviation a / sqrt(3).
  const double a = stddev * std::sqrt(3.0);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  auto next = [&s, a] {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>((static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0) * a);
  };
  const int64_t n = t.numel();
  if (t.dtype == DType::kBF16) {
    bf16* p = t.ptr<bf16>();
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(next());
  } else {
    float* p = t.ptr<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = next();
  }
}

std::string format_bandwidth(double bytes_per_s) { return format_sig3(bytes_per_s / 1e9, " GB/s"); }
std::string format_percent(double fraction) { return format_sig3(fraction * 100, "%"); }
std::string format_ratio(double x) { return format_sig3(x, "x"); }

Progress::Progress(std::string label, int64_t total)
    : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1) {}

void Progress::step(const std::string& what) {
  if (!enabled_) {
    ++done_;
    return;
  }
  constexpr int kWidth = 30;
  const int filled = total_ > 0 ? static_cast<int>(kWidth * done_ / total_) : kWidth;
  std::fprintf(stderr, "\r\033[K%s [%s%s] %lld/%lld %s", label_.c_str(),
               std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
               static_cast<long long>(done_ + 1), static_cast<long long>(total_), what.c_str());
  std::fflush(stderr);
  ++done_;
}

void Progress::finish() {
  if (enabled_) std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

}  // namespace attnkit::cli
