// What both layers' forward_batch() need before they project anything: the
// step's packed layout checked, and every token's RoPE position.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"

namespace attnkit {

// The position of each of the `total` packed tokens of one step: sequence
// seq_ids[s] owns rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]), the tokens
// from the first one `layer` has not written (cache.written()) on.
// Checks cu_seqlens_q (n + 1 offsets from 0 to total), that the ids exist
// and that the layer is in range; attend() checks the rest.
Result<std::vector<int64_t>> paged_positions(const char* fn, std::span<const int32_t> cu_seqlens_q,
                                             std::span<const int64_t> seq_ids,
                                             const PagedKVCache& cache, int64_t layer,
                                             int64_t total);

}  // namespace attnkit
