// The 8-bit KV storage types (DType::kI8, DType::kFp8E4M3): how a token row
// of codes and scales is laid out, and how values are quantized into it.
//
// Each block of `block` consecutive values of one kv head's row (the whole
// row when block is 0) is stored as 1-byte codes and one fp32 scale:
//   scale = max |x| over the block / code_max   (127 for int8, 448 for fp8)
//   code  = round(x / scale)  (int8: to nearest, in [-127, 127]; fp8: to the
//           nearest E4M3 value, ties to even)
//   value = decode(code) * scale
// symmetric, quantized once when the token is written and never again. A
// block of zeros (or of magnitudes below ~4e-37, where 127 / max overflows)
// gets scale 0 and codes 0; a block holding NaN or Inf gets scale NaN
// and codes 0, so that every value read from it is NaN (as a non-finite
// f32 key or value makes its attention rows non-finite).
//
// A token's scales follow its codes in the same row:
//   [heads * dim codes | pad to 4 bytes | heads * scales_per_head fp32]
// padded to a multiple of 32 bytes (and by one more line when that is a
// multiple of 2 KiB, as KVCache pads f32 and bf16 rows: kv_token_stride).
// Every key layout (dense, packed, ring, paged) thus finds a key's scales
// through the row that holds its codes, and a page copy moves both.
// docs/QUANTIZATION.md gives the measured error of these choices.
#pragma once

#include <cstdint>

#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"

namespace attnkit {

inline bool is_kv_quantized(DType dtype) { return dtype == DType::kI8 || dtype == DType::kFp8E4M3; }

struct KvRowLayout {
  int64_t row = 0;              // elements between tokens (bytes for 8-bit types); 0 = overflow
  int64_t scale_offset = 0;     // bytes from a row's start to its first scale
  int64_t scales_per_head = 0;  // 0 for f32 and bf16
};

// The row layout of `heads` x `dim` values of `dtype` (f32 and bf16: as
// kv_token_stride; 8-bit: codes then scales, one per `scale_block` values of
// a head, 0 = one per head). Returns row = 0 when an argument is < 1 or a
// size overflows.
KvRowLayout kv_row_layout(int64_t heads, int64_t dim, DType dtype, int64_t scale_block = 0);

// Quantizes x[i * stride], i < n, into codes[0, n) and scales[0,
// ceil(n / block)) as described above (block 0 = one block of n).
void quantize_kv(const float* x, int64_t stride, int64_t n, DType dtype, int64_t block,
                 uint8_t* codes, float* scales);

// decode(code) for one code of an 8-bit type.
inline float kv_code_value(DType dtype, uint8_t code) {
  return dtype == DType::kI8 ? static_cast<float>(static_cast<int8_t>(code))
                             : fp8_e4m3_to_float(code);
}

}  // namespace attnkit
