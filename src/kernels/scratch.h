// Per-thread scratch for kernels that must not allocate in steady state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>

#include "attnkit/status.h"

namespace attnkit::kernels {

// A buffer that only grows: a call no larger than the largest one before
// it reuses the buffer and allocates nothing, and growth never fills the
// new elements (for trivial T), since every caller writes before it reads.
template <class T>
struct Scratch {
  std::unique_ptr<T[]> data;
  size_t count = 0;

  // Room for n elements; false if they cannot be had (the old buffer is
  // then gone, and count is 0).
  bool grow(size_t n) noexcept {
    if (n <= count) return true;
    data.reset();
    count = 0;
    // No machine holds more than PTRDIFF_MAX bytes; asking operator new[]
    // for more aborts under some compilers' sanitizers instead of throwing.
    if (n > static_cast<size_t>(PTRDIFF_MAX) / sizeof(T)) return false;
    data.reset(new (std::nothrow) T[n]);
    if (data == nullptr) return false;
    count = n;
    return true;
  }

  // grow(n), or a ResourceExhausted status naming `function` and `what`.
  Status reserve(size_t n, const char* function, const char* what) {
    if (grow(n)) return Status::Ok();
    return resource_exhausted(std::string(function) + ": cannot allocate " + std::to_string(n) +
                              " " + what);
  }

  T* get() const { return data.get(); }
};

}  // namespace attnkit::kernels
