// Statistics shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <string>
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

// The CPU, for the first line of a report: "<model name> (family F, model
// M)" from /proc/cpuinfo.
inline std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", family, number;
  while (std::getline(in, line)) {
    const auto value = [&] { return line.substr(line.find(':') + 2); };
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") model = value();
    if (line.rfind("cpu family", 0) == 0 && family.empty()) family = value();
    if (line.rfind("model\t", 0) == 0 && number.empty()) number = value();
  }
  return model + " (family " + family + ", model " + number + ")";
}

}  // namespace attnkit::bench
