// The order on scores that the indexer's top-k select counts and compares
// by (kernels/sparse.h): shared by the select and by the scoring kernels
// that count each score's first digit while the score is in a register
// (kernels/indexer_amx.cc).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include "kernels/cpu/x86_intrinsics.h"
#endif

namespace attnkit::kernels {

// A key that orders floats as uint32s: a > b iff key(a) > key(b); -0 and
// +0 one key (x + 0 is +0 for both), NaN that of -inf. Negative floats
// flip every bit, others the sign bit.
inline uint32_t order_key(float x) {
  const float y = x + 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  const uint32_t key =
      bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  return x != x ? 0x007fffffu : key;
}

#if defined(__x86_64__) || defined(_M_X64)
// order_key of each lane of x.
__attribute__((target("avx512f"))) inline __m512i order_keys16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(_mm512_add_ps(x, _mm512_setzero_ps()));
  return _mm512_mask_mov_epi32(
      _mm512_xor_si512(bits,
                       _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(INT32_MIN))),
      _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x007fffff));
}
#endif

}  // namespace attnkit::kernels
