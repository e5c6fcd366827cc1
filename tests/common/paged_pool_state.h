// What the paged pool's tests and fuzzer observe of a PagedKVCache beside
// its outputs: its bookkeeping (to check that a failed call changed none of
// it), its free pages (poisoned, so that a read of a page no sequence
// holds shows up as NaN in an output; cached-free pages keep their K/V for
// the prefix cache) and the prefix cache's invariants.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/paged_kv_cache.h"

namespace attnkit {
// Narrows the pool's page keys to `mask`'s bits, so that keys collide and
// the token comparison of every lookup is what keeps prefixes apart.
struct PagedKVCacheTesting {
  static void set_key_mask(PagedKVCache& pool, uint64_t mask) { pool.key_mask_ = mask; }
};
}  // namespace attnkit

namespace attnkit_test {

// Every observable of the pool's bookkeeping.
struct PoolSnapshot {
  std::vector<int64_t> ids, lengths, written;
  std::vector<std::vector<int32_t>> tables;
  int64_t free_pages = 0;
  std::vector<int32_t> cached_free;  // LRU order
  attnkit::PrefixCacheStats stats;
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
  s.cached_free = pool.cached_free_pages();
  s.stats = pool.prefix_cache_stats();
  return s;
}

// The page accounting the pool must keep: every page is held (by the
// sequences whose tables name it), cached-free or plainly free, never two
// of them; free_pages() counts the last two; cached-free pages are keyed
// (no more than the keyed pages). Returns "" or what is wrong.
inline std::string pool_state_error(const attnkit::PagedKVCache& pool) {
  const attnkit::PagedKVCacheSpec& s = pool.spec();
  std::vector<int> held(size_t(s.num_pages), 0);
  for (int64_t id : pool.sequence_ids()) {
    const std::vector<int32_t> table = pool.page_table(id).value();
    for (int32_t p : table)
      if (p >= 0) ++held[size_t(p)];
  }
  int64_t held_pages = 0;
  for (int h : held) held_pages += h > 0;
  const std::vector<int32_t> cached = pool.cached_free_pages();
  std::vector<bool> seen(size_t(s.num_pages), false);
  for (int32_t p : cached) {
    if (p < 0 || p >= s.num_pages || seen[size_t(p)])
      return "cached-free page " + std::to_string(p) + " is out of range or listed twice";
    if (held[size_t(p)] > 0) return "cached-free page " + std::to_string(p) + " is held";
    seen[size_t(p)] = true;
  }
  const attnkit::PrefixCacheStats st = pool.prefix_cache_stats();
  if (held_pages + pool.free_pages() != s.num_pages)
    return std::to_string(held_pages) + " held pages + " + std::to_string(pool.free_pages()) +
           " free != " + std::to_string(s.num_pages);
  if (st.cached_free_pages != int64_t(cached.size()) || st.cached_pages < st.cached_free_pages)
    return "stats count " + std::to_string(st.cached_free_pages) + " cached-free of " +
           std::to_string(st.cached_pages) + " keyed pages, the list " +
           std::to_string(cached.size());
  if (!s.prefix_caching && (st.cached_pages != 0 || !cached.empty()))
    return "a pool without prefix caching keyed pages";
  return "";
}

// Fills every page no sequence holds with NaN, in every layer (8-bit
// pools: codes 0x7f, fp8's NaN, and NaN scales).
inline void poison_free_pages(const attnkit::PagedKVCache& pool) {
  using attnkit::DType;
  const attnkit::PagedKVCacheSpec& s = pool.spec();
  std::vector<bool> held(size_t(s.num_pages), false);
  for (int32_t p : pool.cached_free_pages()) held[size_t(p)] = true;
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
