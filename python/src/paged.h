// The PagedKVCache object Python holds, shared by its own bindings
// (paged.cc) and the layers' forward_batch and new_paged_cache
// (attention_layer.cc, mla.cc), and the parsing of a step's packed layout.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "attnkit/paged_kv_cache.h"

namespace attnkit::python {

// A pool shared with Python. Compute runs without the GIL; `mu` serialises
// every access (taken after the GIL is released).
struct PyPagedKVCache {
  explicit PyPagedKVCache(PagedKVCache p) : pool(std::move(p)) {}
  PagedKVCache pool;
  std::mutex mu;
};

// `cache` as a PagedKVCache, or ValueError naming fn.
PyPagedKVCache& paged_cache_arg(pybind11::handle cache, const char* fn);

// A 1-D sequence of ints (list, tuple, numpy array) as int64 values;
// `name` in messages.
std::vector<int64_t> int64_list(pybind11::handle obj, const char* fn, const char* name);

// cu_seqlens as int32 offsets (values are checked by the C++ call).
std::vector<int32_t> offsets_arg(pybind11::handle obj, const char* fn, const char* name);

}  // namespace attnkit::python
