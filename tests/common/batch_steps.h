// Drives a layer's forward_batch() through a schedule of continuous-batching
// steps, for the layer tests: sequence s has inputs x[s] [N_s, hidden];
// step t feeds each sequence its next steps[t][s] tokens (0 = idle that
// step), packed in sequence order, after reserving them with
// pool.append(); the packed outputs go back to out[s] [N_s, hidden].
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnkit/paged_kv_cache.h"
#include "attnkit/tensor.h"

namespace attnkit_test {

// forward(x [total, hidden] view, cu_seqlens_q, seq_ids, out view) -> Status.
template <class Forward>
void run_batch_steps(attnkit::PagedKVCache& pool, int64_t hidden,
                     const std::vector<std::vector<float>>& x,
                     const std::vector<std::vector<int64_t>>& steps,
                     std::vector<std::vector<float>>* out, Forward forward) {
  const size_t n = x.size();
  std::vector<int64_t> ids, done(n, 0);
  for (size_t s = 0; s < n; ++s) ids.push_back(pool.add_sequence());
  out->assign(n, {});
  for (size_t s = 0; s < n; ++s) (*out)[s].assign(x[s].size(), -9.0f);
  for (const std::vector<int64_t>& counts : steps) {
    ASSERT_EQ(counts.size(), n);
    const attnkit::Status reserved = pool.append(ids, counts);
    ASSERT_TRUE(reserved.ok()) << reserved.to_string();
    std::vector<int32_t> cu{0};
    std::vector<float> xs, os;
    for (size_t s = 0; s < n; ++s) {
      const auto first = x[s].begin() + done[s] * hidden;
      xs.insert(xs.end(), first, first + counts[s] * hidden);
      cu.push_back(cu.back() + static_cast<int32_t>(counts[s]));
    }
    os.assign(xs.size() + 1, -9.0f);
    xs.push_back(0.0f);  // a spare element: an empty step still has a buffer
    const int64_t total = cu.back();
    const attnkit::Status st =
        forward(attnkit::make_view(xs.data(), attnkit::DType::kF32, {total, hidden}), cu, ids,
                attnkit::make_view(os.data(), attnkit::DType::kF32, {total, hidden}));
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (size_t s = 0; s < n; ++s) {
      std::copy_n(os.begin() + cu[s] * hidden, counts[s] * hidden,
                  (*out)[s].begin() + done[s] * hidden);
      done[s] += counts[s];
    }
  }
}

}  // namespace attnkit_test
