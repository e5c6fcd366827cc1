// Statistics shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace attnkit::bench {

// The middle value (the upper of the two middle ones for an even count);
// 0 for no values. Taken by value: the caller's order is kept.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

}  // namespace attnkit::bench
