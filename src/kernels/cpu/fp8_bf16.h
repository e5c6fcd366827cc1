// fp8 E4M3 codes to bf16, exactly, for AMX's tdpbf16ps (every E4M3 value
// is a bf16 value, and a normal one: E4M3's subnormals, k * 2^-9, are far
// above bf16's smallest normal, so AMX, which reads bf16 denormals as 0,
// sees every value). Shared by the AMX forms that multiply fp8 codes (the
// DSA indexer's keys; decode_amx.cc's keys and values, in order).
//
// The decoder turns 64 codes into 64 bf16 words with two byte lookups of
// 128 entries (vpermi2b: one table for each byte of the bf16 word, indexed
// by the code's low 7 bits; the sign bit is or-ed into the high byte) and
// two byte interleaves (vpunpck{l,h}bw). The interleaves work within each
// 128-bit lane, so the words come out in a fixed permutation of the codes'
// order (fp8_bf16_feature): a dot product is the same in any order of its
// features, so the other operand is laid out with the same permutation
// instead of paying for a shuffle per key. About 7 instructions per 64
// codes, where widening to 16 bits, shifting the fields into place and
// patching the subnormals from a table took about 26.
//
// NaN codes (0x7f, 0xff) decode to a bf16 NaN (0x7fc0, 0xffc0), which
// makes every product, sum and hence score of that key NaN: IEEE
// arithmetic, as tdpbf16ps's fp32 multiply-adds do.
#pragma once

#include <cstdint>

#include "kernels/cpu/x86_intrinsics.h"

namespace attnkit::kernels::cpu {

// bf16 bits of the E4M3 code's magnitude m (0..127, sign dropped); 0x7fc0
// (a quiet NaN) for 0x7f.
constexpr uint16_t fp8_e4m3_magnitude_bf16(int m) {
  if (m == 0x7f) return 0x7fc0;
  const int e = m >> 3, f = m & 7;
  // Normal: 2^(e - 7) (1 + f / 8) -> bf16 exponent e - 7 + 127.
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (f << 4));
  if (f == 0) return 0;
  // Subnormal f * 2^-9: leading bit b of f gives 2^(b - 9) (1 + rest).
  const int b = f >= 4 ? 2 : f >= 2 ? 1 : 0;
  return static_cast<uint16_t>(((118 + b) << 7) | ((f - (1 << b)) << (7 - b)));
}

// The code whose value fp8_bf16_decode64 writes at word p (0..63) of its
// output: vpunpcklbw takes bytes 0-7 of each 16-byte lane, vpunpckhbw
// bytes 8-15, and the low words are stored first. Blocks of 64 repeat it:
// fp8_bf16_feature(p) for any p >= 0 is the code at p's place in p's
// block of 64.
constexpr int64_t fp8_bf16_feature(int64_t p) {
  const int64_t w = p % 64, half = w / 32, j = w % 32;
  return p - w + (j / 8) * 16 + half * 8 + j % 8;
}

#if defined(__x86_64__) || defined(_M_X64)

#define ATTNKIT_FP8_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi")))

// The high and low bytes of fp8_e4m3_magnitude_bf16(m), m < 128; magnitude
// 0x7f gets nan_bits (the kernels that decode it to +-480, kernel_table.h,
// pass 480's bf16 bits, 0x43f0: the byte layout that would follow 448).
struct Fp8Bf16Bytes {
  uint8_t hi[128], lo[128];
};
constexpr Fp8Bf16Bytes fp8_bf16_bytes(uint16_t nan_bits = fp8_e4m3_magnitude_bf16(0x7f)) {
  Fp8Bf16Bytes b{};
  for (int m = 0; m < 128; ++m) {
    const uint16_t bits = m == 0x7f ? nan_bits : fp8_e4m3_magnitude_bf16(m);
    b.hi[m] = static_cast<uint8_t>(bits >> 8);
    b.lo[m] = static_cast<uint8_t>(bits & 0xff);
  }
  return b;
}
alignas(64) inline constexpr Fp8Bf16Bytes kFp8Bf16Bytes = fp8_bf16_bytes();
alignas(64) inline constexpr Fp8Bf16Bytes kFp8Bf16Bytes480 = fp8_bf16_bytes(0x43f0);

// The in-order form's byte shuffle: at[fp8_bf16_feature(p)] = p, so that
// codes moved by it (vpermb: byte i <- byte at[i]) come out of the
// decoder with word p holding code p.
struct Fp8Bf16Order {
  uint8_t at[64];
};
constexpr Fp8Bf16Order fp8_bf16_order() {
  Fp8Bf16Order o{};
  for (int64_t p = 0; p < 64; ++p) o.at[fp8_bf16_feature(p)] = static_cast<uint8_t>(p);
  return o;
}
alignas(64) inline constexpr Fp8Bf16Order kFp8Bf16Order = fp8_bf16_order();

// The two byte tables in registers: hi*/lo* for magnitudes 0-63 (*0) and
// 64-127 (*1). Load once per call, outside the loop over keys.
struct Fp8Bf16Tables {
  __m512i hi0, hi1, lo0, lo1;
};

ATTNKIT_FP8_BF16_TARGET inline Fp8Bf16Tables fp8_bf16_tables(
    const Fp8Bf16Bytes& bytes = kFp8Bf16Bytes) {
  const uint8_t* hi = bytes.hi;
  const uint8_t* lo = bytes.lo;
  return {_mm512_loadu_si512(hi), _mm512_loadu_si512(hi + 64), _mm512_loadu_si512(lo),
          _mm512_loadu_si512(lo + 64)};
}

// The 64 codes in `code` decoded: *first = words 0-31, *second = words
// 32-63, word p the bf16 bits of code byte fp8_bf16_feature(p).
ATTNKIT_FP8_BF16_TARGET inline void fp8_bf16_words(const Fp8Bf16Tables& t, __m512i code,
                                                   __m512i* first, __m512i* second) {
  // vpermi2b indexes with bits 0-6 and ignores bit 7, the sign.
  const __m512i hi_mag = _mm512_permutex2var_epi8(t.hi0, code, t.hi1);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, code, t.lo1);
  // hi = hi_mag | (code & 0x80): ternary-logic truth table A | (B & C).
  const __m512i hi = _mm512_ternarylogic_epi32(hi_mag, code, _mm512_set1_epi8(-128), 0xf8);
  *first = _mm512_unpacklo_epi8(lo, hi);
  *second = _mm512_unpackhi_epi8(lo, hi);
}

// out[p] = bf16 bits of codes[fp8_bf16_feature(p)], p < 64.
ATTNKIT_FP8_BF16_TARGET inline void fp8_bf16_decode64(const Fp8Bf16Tables& t, const uint8_t* codes,
                                                      uint16_t* out) {
  __m512i first, second;
  fp8_bf16_words(t, _mm512_loadu_si512(codes), &first, &second);
  _mm512_storeu_si512(out, first);
  _mm512_storeu_si512(out + 32, second);
}

// The in-order form, for operands whose features cannot take the permuted
// order for free (P V's values: their features are the output's columns)
// or whose rows end in half a block (keys padded to 32 dims): one vpermb
// more (order: kFp8Bf16Order loaded) puts code p at word p, p < 64.
ATTNKIT_FP8_BF16_TARGET inline void fp8_bf16_words_in_order(const Fp8Bf16Tables& t, __m512i order,
                                                            __m512i code, __m512i* first,
                                                            __m512i* second) {
  fp8_bf16_words(t, _mm512_permutexvar_epi8(order, code), first, second);
}

// out[b * 64 + p] = bf16 bits of codes[b * 64 + fp8_bf16_feature(p)] for
// the n / 64 blocks of n codes (n a multiple of 64). For callers outside a
// loop; loops keep the tables in registers and call fp8_bf16_decode64.
ATTNKIT_FP8_BF16_TARGET inline void fp8_bf16_decode(const uint8_t* codes, int64_t n,
                                                    uint16_t* out) {
  const Fp8Bf16Tables t = fp8_bf16_tables();
  for (int64_t i = 0; i + 64 <= n; i += 64) fp8_bf16_decode64(t, codes + i, out + i);
}

#endif

}  // namespace attnkit::kernels::cpu
