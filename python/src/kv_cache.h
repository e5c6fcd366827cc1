// The KVCache object Python holds, shared by the KVCache bindings
// (kv_cache.cc) and the attention layer's forward and new_cache
// (attention_layer.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <mutex>
#include <utility>

#include "attnkit/kv_cache.h"

namespace attnkit::python {

// A KVCache shared with Python. Compute runs without the GIL, so two Python
// threads could reach the same cache at once; `mu` serialises every access
// (taken only after the GIL is released, so waiting never blocks Python).
struct PyKVCache {
  explicit PyKVCache(KVCache c) : cache(std::move(c)) {}
  KVCache cache;
  std::mutex mu;
};

// Runs f() holding `mu` with the GIL released.
template <typename F>
auto locked(std::mutex& mu, F&& f) {
  pybind11::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(mu);
  return f();
}

}  // namespace attnkit::python
