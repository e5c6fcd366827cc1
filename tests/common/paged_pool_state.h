// What the paged pool's tests and fuzzer observe of a PagedKVCache beside
// its outputs: its bookkeeping (to check that a failed call changed none of
// it) and its free pages (poisoned, so that a read of a page no sequence
// holds shows up as NaN in an output).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "attnkit/paged_kv_cache.h"

namespace attnkit_test {

// Every observable of the pool's bookkeeping.
struct PoolSnapshot {
  std::vector<int64_t> ids, lengths, written;
  std::vector<std::vector<int32_t>> tables;
  int64_t free_pages = 0;
  bool operator==(const PoolSnapshot&) const = default;
};

inline PoolSnapshot snapshot(const attnkit::PagedKVCache& pool) {
  PoolSnapshot s;
  s.ids = pool.sequence_ids();
  for (int64_t id : s.ids) {
    s.lengths.push_back(pool.length(id).value());
    for (int64_t l = 0; l < pool.spec().num_layers; ++l)
      s.written.push_back(pool.written(id, l).value());
    s.tables.push_back(pool.page_table(id).value());
  }
  s.free_pages = pool.free_pages();
  return s;
}

// Fills every page no sequence holds with NaN, in every layer (8-bit
// pools: codes 0x7f, fp8's NaN, and NaN scales).
inline void poison_free_pages(const attnkit::PagedKVCache& pool) {
  using attnkit::DType;
  const attnkit::PagedKVCacheSpec& s = pool.spec();
  std::vector<bool> held(size_t(s.num_pages), false);
  for (int64_t id : pool.sequence_ids()) {
    const std::vector<int32_t> table = pool.page_table(id).value();
    for (int32_t p : table)
      if (p >= 0) held[size_t(p)] = true;
  }
  for (int64_t l = 0; l < s.num_layers; ++l)
    for (const attnkit::TensorView& t : {pool.keys(l).value(), pool.values(l).value(),
                                         pool.key_scales(l).value(), pool.value_scales(l).value()})
      for (int64_t p = 0; p < s.num_pages && t.present(); ++p)
        for (int64_t r = p * s.page_size; !held[size_t(p)] && r < (p + 1) * s.page_size; ++r)
          for (int64_t h = 0; h < t.shape[1]; ++h)
            for (int64_t x = 0; x < t.shape[2]; ++x) {
              const int64_t at = r * t.strides[0] + h * t.strides[1] + x;
              if (t.dtype == DType::kBF16)
                t.ptr<uint16_t>()[at] = 0x7fc0;
              else if (t.dtype == DType::kF32)
                t.ptr<float>()[at] = std::numeric_limits<float>::quiet_NaN();
              else
                t.ptr<uint8_t>()[at] = 0x7f;
            }
}

}  // namespace attnkit_test
