// What compare, bench and plot share: timing (median of repeats), seeded
// fills, run-time errors, a few more units and a progress bar.
//
// The machines we measure on are shared and noisy, so every figure is a
// median of several samples, and every speed is also printed as a fraction
// of the peak and bandwidth measured in the same process.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit::cli {

// A failure while running (not a bad flag): "attnkit <cmd>: <message>",
// exit code 1. Thrown and caught inside the tool only.
struct RunError {
  std::string message;
};

// Throws RunError("<what>: <status message>") unless `st` is OK.
void ok_or_throw(const Status& st, const std::string& what);
template <typename T>
T value_or_throw(Result<T> r, const std::string& what) {
  if (!r.ok()) ok_or_throw(r.status(), what);
  return std::move(r).value();
}

double now_seconds();  // steady clock

struct Timing {
  double median = 0;  // seconds per call, median over samples
  double min = 0;     // fastest sample, seconds per call
  int samples = 0;
  int calls_per_sample = 0;
};

// Times fn(i), i = 0, 1, 2, ... (callers rotate buffers with i). One call
// warms up (caches, page faults, thread pool) and calibrates: a sample
// groups enough calls to last >= 1 ms so the clock's resolution does not
// matter. Then samples are taken until both `min_samples` are done and
// `budget_s` has passed, or `max_samples` are done; the first sample that
// overruns the budget still counts, so a call slower than the budget gets
// min_samples samples. max_calls_per_sample caps the grouping where each
// call consumes something (a decode step fills a cache slot).
Timing time_median(const std::function<void(int64_t)>& fn, double budget_s, int min_samples,
                   int max_samples, int max_calls_per_sample = 1 << 20);

// Deterministic uniform values with mean 0 and standard deviation `stddev`
// (a splitmix64 stream from `seed`); bf16 storage is rounded from them.
void fill_uniform(const TensorView& t, uint64_t seed, double stddev);

std::string format_bandwidth(double bytes_per_s);  // "12.3 GB/s" (decimal, as DRAM specs)
std::string format_percent(double fraction);       // "42%", "3.1%", "0.12%"
std::string format_ratio(double x);                // "12.3x", "0.85x"

// A one-line progress bar on stderr, drawn only when stderr is a terminal
// (so pipes, files and tests never see it), erased by finish().
class Progress {
 public:
  Progress(std::string label, int64_t total);
  void step(const std::string& what);  // call before each item: `what` is running
  void finish();

 private:
  std::string label_;
  int64_t total_, done_ = 0;
  bool enabled_;
};

}  // namespace attnkit::cli
