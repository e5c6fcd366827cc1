// Overflow-checked integer arithmetic for sizes that come from users or
// files. Returns false (and leaves *out unspecified) on overflow.
#pragma once

#include <cstdint>

namespace attnkit {

inline bool checked_mul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool checked_add(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace attnkit
