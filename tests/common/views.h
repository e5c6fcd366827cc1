// Reading strided views in tests: one element as float, and every byte a
// view spans (e.g. a KVCache's padded rows), for before/after snapshots.
#pragma once

#include <cstdint>
#include <vector>

#include "attnkit/tensor.h"

namespace attnkit_test {

// Element (i0, i1, i2, i3) of a rank-4 f32 or bf16 view, as float.
inline float view_at(const attnkit::TensorView& v, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  const int64_t i = i0 * v.strides[0] + i1 * v.strides[1] + i2 * v.strides[2] + i3 * v.strides[3];
  return v.dtype == attnkit::DType::kBF16 ? attnkit::bf16_to_float(v.ptr<const attnkit::bf16>()[i])
                                          : v.ptr<const float>()[i];
}

// The bytes from a view's first element to its last (non-negative strides).
inline std::vector<unsigned char> span_bytes(const attnkit::TensorView& v) {
  const auto* p = static_cast<const unsigned char*>(v.data);
  if (v.numel() == 0) return {};
  int64_t last = 0;
  for (int r = 0; r < v.rank; ++r) last += (v.shape[r] - 1) * v.strides[r];
  return std::vector<unsigned char>(p, p + (last + 1) * int64_t(attnkit::dtype_size(v.dtype)));
}

}  // namespace attnkit_test
