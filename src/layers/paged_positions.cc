#include "layers/paged_positions.h"

#include <string>

#include "ops/attention_checks.h"

namespace attnkit {

Result<std::vector<int64_t>> paged_positions(const char* fn, std::span<const int32_t> cu_seqlens_q,
                                             std::span<const int64_t> seq_ids,
                                             const PagedKVCache& cache, int64_t layer,
                                             int64_t total) {
  const int64_t n = static_cast<int64_t>(seq_ids.size());
  int32_t longest = 0;
  ATTNKIT_RETURN_IF_ERROR(
      check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, n, total, "x.shape[0]", &longest));
  std::vector<int64_t> positions(static_cast<size_t>(total));
  for (int64_t s = 0; s < n; ++s) {
    auto first = cache.written(seq_ids[s], layer);
    if (!first.ok())
      return Status(first.status().code(), std::string(fn) + ": " + first.status().message());
    for (int32_t r = cu_seqlens_q[s]; r < cu_seqlens_q[s + 1]; ++r)
      positions[static_cast<size_t>(r)] = *first + (r - cu_seqlens_q[s]);
  }
  return positions;
}

}  // namespace attnkit
