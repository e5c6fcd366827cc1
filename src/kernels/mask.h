// Visibility rules shared by every kernel, so reference and fast paths cannot
// disagree on what a mask means. `p` is the query's key-space position
// (row + q_offset) and `j` the logical key index.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/attention_params.h"

namespace attnkit::kernels {

inline int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

inline bool sparse_admits(const SparsePattern& sp, int64_t p, int64_t j) {
  switch (sp.kind) {
    case SparsePattern::Kind::kNone:
      return true;
    case SparsePattern::Kind::kStrided: {
      const int64_t a = floor_div(p, sp.block_size), b = floor_div(j, sp.block_size);
      const int64_t d = a - b;
      return (d < sp.stride && -d < sp.stride) || d % sp.stride == 0;
    }
    case SparsePattern::Kind::kFixed: {
      const int64_t a = floor_div(p, sp.block_size), b = floor_div(j, sp.block_size);
      const int64_t l = sp.stride;
      return floor_div(a, l) == floor_div(b, l) || (b % l + l) % l >= l - sp.summary;
    }
  }
  return true;
}

// The half-open key range [lo, hi) that causal, window, chunk and k_len leave
// visible for a query at position p (the sparse pattern and explicit masks
// are checked per key on top). Empty when lo >= hi.
inline void key_range(const AttentionParams& prm, int64_t b, int64_t p, int64_t* lo, int64_t* hi) {
  int64_t begin = 0, end = prm.keys_of(b);
  if (prm.causal) end = std::min(end, p + 1);
  // Windows may be anything up to INT64_MAX (the API only requires >= -1),
  // so the bounds saturate: a bound that overflows lies beyond every key.
  int64_t bound;
  if (prm.window_right >= 0 && !__builtin_add_overflow(p, prm.window_right, &bound) && bound < end)
    end = bound + 1;
  if (prm.window_left >= 0 && !__builtin_sub_overflow(p, prm.window_left, &bound) && bound > begin)
    begin = bound;
  if (prm.chunk_size > 0) {
    // The chunk of p: [first, first + chunk_size). A query before key 0
    // (p < 0) sits in a chunk of negative keys only, so it sees none.
    const int64_t first = floor_div(p, prm.chunk_size) * prm.chunk_size;
    begin = std::max(begin, first);
    if (__builtin_add_overflow(first, prm.chunk_size, &bound) == 0) end = std::min(end, bound);
  }
  *lo = begin;
  *hi = std::max(begin, end);
}

}  // namespace attnkit::kernels
