// The best of repeated runs of a probe, taken until it is stable. Shared
// machines slow some runs down (other work on the cores, frequency
// changes) but never speed one up past what the hardware does, so the
// fastest run is the best estimate; "stable" means that run was matched by
// another, so one lucky or mismeasured sample cannot set the figure alone.
#pragma once

#include <algorithm>
#include <vector>

namespace attnkit {

struct BestRun {
  double seconds = 0;   // the fastest run
  int runs = 0;         // runs taken
  bool stable = false;  // another run was within `tolerance` of the fastest
};

// Calls run() (which returns the seconds one run took) at least
// `min_runs` and at most `max_runs` times, stopping as soon as
// min_runs are done and the two fastest runs differ by at most
// `tolerance` (relative). min_runs >= 2, max_runs >= min_runs.
template <typename Run>
BestRun best_until_stable(Run&& run, int min_runs, int max_runs, double tolerance) {
  std::vector<double> t;
  BestRun b;
  while (b.runs < max_runs) {
    t.push_back(run());
    ++b.runs;
    std::partial_sort(t.begin(), t.begin() + std::min<size_t>(2, t.size()), t.end());
    b.seconds = t[0];
    b.stable = t.size() >= 2 && t[1] <= t[0] * (1.0 + tolerance);
    if (b.runs >= min_runs && b.stable) break;
  }
  return b;
}

}  // namespace attnkit
