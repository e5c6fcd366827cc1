// One K or V element as a kernel's params describe it, for the loops that
// read elements one at a time: the reference twin and the fast kernel's
// slow path for masked keys holding non-finite values. 8-bit codes are
// dequantized with their row's scale (attention_params.h); the product of
// a code (at most 8 significant bits) and an fp32 scale is exact in double.
#pragma once

#include <cstdint>

#include "kernels/attention_params.h"

namespace attnkit::kernels {

// Element `index` of k (value = false) or v, counted from the tensor's start
// in elements; (b, r, h, c) name its batch item, physical row, kv head and
// channel, which the 8-bit types need for the scale.
inline double kv_element(const AttentionParams& p, bool value, int64_t index, int64_t b, int64_t r,
                         int64_t h, int64_t c) {
  const void* base = value ? p.v : p.k;
  switch (p.kv_dtype) {
    case DType::kBF16:
      return bf16_to_float(static_cast<const bf16*>(base)[index]);
    case DType::kI8:
    case DType::kFp8E4M3: {
      const uint8_t code = static_cast<const uint8_t*>(base)[index];
      const double decoded =
          p.kv_dtype == DType::kI8 ? static_cast<int8_t>(code) : fp8_e4m3_to_float(code);
      const Strides4& st = value ? p.v_scale_stride : p.k_scale_stride;
      const float* scale = (value ? p.v_scale : p.k_scale) + b * st.batch + r * st.row +
                           h * st.head + (p.scale_block > 0 ? c / p.scale_block * st.dim : 0);
      return decoded * *scale;
    }
    default:
      return static_cast<const float*>(base)[index];
  }
}

}  // namespace attnkit::kernels
