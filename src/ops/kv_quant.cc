#include "ops/kv_quant.h"

#include <cmath>
#include <limits>

#include "core/checked_math.h"
#include "kernels/cpu/tile_policy.h"

namespace attnkit {

KvRowLayout kv_row_layout(int64_t heads, int64_t dim, DType dtype, int64_t scale_block) {
  KvRowLayout l;
  int64_t values;
  if (heads < 1 || dim < 1 || scale_block < 0 || !checked_mul(heads, dim, &values)) return l;
  if (!is_kv_quantized(dtype)) {
    l.row = kernels::cpu::padded_token_row(values, static_cast<int64_t>(dtype_size(dtype)));
    return l;
  }
  l.scales_per_head = scale_block == 0 ? 1 : (dim + scale_block - 1) / scale_block;
  int64_t scale_bytes, end;
  if (values > INT64_MAX - 3 || !checked_mul(heads, 4 * l.scales_per_head, &scale_bytes)) return l;
  l.scale_offset = (values + 3) / 4 * 4;
  if (!checked_add(l.scale_offset, scale_bytes, &end) || end > INT64_MAX - 31) return l;
  l.row = kernels::cpu::padded_token_row((end + 31) / 32 * 32, 1);
  return l;
}

void quantize_kv(const float* x, int64_t stride, int64_t n, DType dtype, int64_t block,
                 uint8_t* codes, float* scales) {
  const bool fp8 = dtype == DType::kFp8E4M3;
  const float code_max = fp8 ? 448.0f : 127.0f;
  if (block == 0) block = n;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = b0 + block < n ? b0 + block : n;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = b0; i < b1; ++i) {
      const float a = std::fabs(x[i * stride]);
      finite = finite && std::isfinite(a);
      amax = a > amax ? a : amax;
    }
    float& scale = scales[b0 / block];
    const float inv = code_max / amax;
    // Blocks of zeros, and blocks so small (max below ~4e-37) that code_max
    // / max overflows, are stored as zeros.
    if (!finite || !std::isfinite(inv)) {
      scale = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = b0; i < b1; ++i) codes[i] = 0;
      continue;
    }
    scale = amax / code_max;
    for (int64_t i = b0; i < b1; ++i) {
      const float y = x[i * stride] * inv;  // |y| <= code_max up to a rounding
      if (fp8) {
        codes[i] = float_to_fp8_e4m3(y);
      } else {
        const float r = std::nearbyint(y);
        codes[i] = static_cast<uint8_t>(static_cast<int8_t>(r > 127.0f    ? 127
                                                            : r < -127.0f ? -127
                                                                          : static_cast<int>(r)));
      }
    }
  }
}

}  // namespace attnkit
