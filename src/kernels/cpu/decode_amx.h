// S = K Q^T and O = alpha O + P V on AMX tiles for decode tiles of 5-16
// packed rows (2-4 tokens of GQA-4 decode), bf16 or 8-bit K/V
// (tile_policy.h, scores_on_amx).
//
// One tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one: 8,192
// multiply-adds, where a 512-bit FMA does 16 and vdpbf16ps or vpdpwssd 32.
// A 16-row tile of 64 keys at head_dim 128 (131,072 multiply-adds for QK)
// is 16 of them. The keys are the A operand, row-major as they lie in the
// cache (16 keys x 32 dims, copied or decoded into an L1 buffer); the
// queries the B operand, packed once per task and head; C is the tile of
// scores s[key][packed row], the key-major layout the softmax walks.
//
// Exact operands: bf16 keys are copied; fp8 E4M3 values have at most 4
// significant bits and exponents well inside bf16's normal range (E4M3's smallest subnormal is
// 2^-9), so they decode to bf16 exactly and never to a bf16 denormal (which AMX reads as 0). Their
// scales (one per key row) multiply the scores afterwards, in fp32. fp8 codes decode by byte
// lookups (AVX512-VBMI's vpermi2b: fp8_bf16.h's tables), ~7 instructions per 64 codes. For bf16 K/V
// the queries and the weights are rounded to bf16 (relative error 2^-9), as the vdpbf16ps kernels
// round them; for 8-bit K/V, whose other kernels keep them to 2^-15 or better, each is split into
// two bf16 parts (2^-17) and multiplied twice. Sums accumulate in fp32. int8 K/V take AMX-INT8
// instead: the key codes as they are against the int16 queries of qk_rows_i8 split into two int8
// halves (amx_qk_i8), the value codes against pv_i8's int16 weights split alike (amx_pv_i8), summed
// exactly in int32. Their value codes need no decoding, only reordering
// into four keys' quads (one vpermb per 64 bytes, where the bf16 pairs took
// four byte lookups): at 4 tokens, GQA 32/8, 16K keys, 2 threads the call
// went from 3.64-3.83 to 3.24-3.26 ms (attnkit_bench, three runs of each
// build alternated, 2026-11-28 on an Intel Xeon family 6 model 167).
#pragma once

#include <cstdint>

namespace attnkit::kernels::cpu {

// The queries' operand: bf16 pairs, element (packed row m < 16, dim c) at
// amx_q_index(m, c); dims up to round_up(head_dim, 32) (zero past head_dim).
inline int64_t amx_q_index(int64_t m, int64_t c) { return (c / 2) * 32 + m * 2 + (c & 1); }

// The queries' operand from count <= 16 contiguous rows of head_dim floats,
// times scale, rounded to bf16 (as vcvtne2ps2bf16 rounds: to nearest even,
// fp32 denormals to 0, which AMX would read as 0 anyway); rows past count
// and dims past head_dim (up to kd = round_up(head_dim, 32)) are 0.
// q_lo (nullptr: none) receives the remainders, bf16(x - bf16(x)), in the
// same layout: the two sum to x within 2^-17 of |x|.
void amx_pack_q(const float* const* rows, int64_t count, int64_t head_dim, float scale, uint16_t* q,
                uint16_t* q_lo, int64_t kd);

// A tile's keys as bf16 rows of `kd` = round_up(head_dim, 32) elements,
// zero past head_dim: n rows of the caller's keys (`stride` elements
// apart) into dst[n][kd], prefetching for each row read the row `prefetch`
// elements further on (0: none), as the KernelTable's kernels do. E4M3
// codes 0x7f / 0xff decode to +-480, as the other fast kernels' decoding
// (kernel_table.h) does.
void amx_keys_bf16(const uint16_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                   int64_t kd, int64_t prefetch);
void amx_keys_fp8(const uint8_t* k, int64_t stride, int64_t n, int64_t head_dim, uint16_t* dst,
                  int64_t kd, int64_t prefetch);

// s[n][m] = kscale[n] * sum_c keys[n][c] * (q(m, c) + q_lo(m, c)) for n <
// nk (<= 64), m < 16, s_stride >= 16 floats apart (kscale nullptr: 1;
// q_lo nullptr: 0). Key n's kd bf16 values are at keys + n * key_stride,
// for n up to round_up(nk, 16): a copy's rows past nk must be zero, and
// rows of s from nk up to round_up(nk, 16) are overwritten too. So the
// keys can be a cache's own rows where nk is a multiple of 16 and kd the
// head_dim. For each row read, the row `prefetch` elements further on is
// prefetched (0: none), spread over the products. Must run between
// amx_tiles_begin() and amx_tiles_end() in the calling thread.
void amx_qk(const uint16_t* keys, int64_t nk, int64_t key_stride, int64_t kd, const uint16_t* q,
            const uint16_t* q_lo, const float* kscale, float* s, int64_t s_stride,
            int64_t prefetch);

// The values of a tile as AMX's B operand: pairs[p][c][2] = (bf16 value of
// key 2 p, of key 2 p + 1) at column c < dv_pad (a multiple of 16), for p <
// 16 * ceil(nk / 32), zero past dv and past nk (<= 64). Key n's row is
// rows[n]; for each, the row fetch[n] elements further on is prefetched (0:
// none). bf16 values, or with fp8 E4M3 codes (decoded as amx_keys_fp8,
// exactly; their scales go to amx_pv). int8 values take amx_pv_i8.
void amx_value_pairs(const void* const* rows, const int64_t* fetch, int64_t nk, int64_t dv,
                     int64_t dv_pad, bool fp8, uint16_t* pairs);

// o[m][c] = alpha[m] * o[m][c] + sum_n w[m][n] * value(n, c) for m < 16, c
// < dv_pad, n < nk (<= 64), the values as amx_value_pairs lays them out,
// where w[m][n] = s[n * s_stride + m] (times vscale[n] unless nullptr),
// rounded to bf16 (relative error 2^-9, as pv_bf16 rounds its weights), or
// with `split` as two bf16 parts, bf16(w) and bf16(w - bf16(w)), which sum
// to w within 2^-17 of it (two products). o: 16 rows dv_pad apart, so pad
// rows must exist. Scratch w: 2 * 16 * 64 uint16s. Between
// amx_tiles_begin() and amx_tiles_end().
void amx_pv(const float* s, int64_t nk, int64_t s_stride, const float* vscale,
            const uint16_t* pairs, float* o, int64_t dv_pad, const float* alpha, uint16_t* w,
            bool split);

// int8 keys on AMX-INT8 (tdpbssd), their codes as they are: the queries
// as int16 rows q16 (qt apart, qf[m] each row's factor, as qk_rows_i8
// takes them, |q16| <= kAmxQ16Max) split into two int8 operands, q16 =
// 256 hi + lo, laid out by amx_split_q into hi and lo (16 * kd elements
// each, kd = round_up(head_dim, 64)); then for n < nk (<= 64), m < 16:
//   s[n][m] = kscale[n] * qf[m] * (256 sum_c k[n][c] hi[m][c] + sum_c k[n][c] lo[m][c]),
// each sum exact in int32. keys: rows of kd codes key_stride bytes apart,
// zero past head_dim, as they lie in a cache whose head_dim is a multiple
// of 64 or as amx_keys_copy_i8 copies them; rows from nk up to
// round_up(nk, 32) are read too and must be zero. For each key row, the
// row `prefetch` bytes further on is prefetched (0: none). c32: scratch of
// 4 * 256 int32s (the C tiles).
inline constexpr int64_t kAmxQ16Max = 127 * 256 + 127;
void amx_split_q(const int16_t* q16, int64_t qt, int64_t head_dim, int8_t* hi, int8_t* lo,
                 int64_t kd);
void amx_keys_copy_i8(const int8_t* k, int64_t stride, int64_t n, int64_t head_dim, int8_t* dst,
                      int64_t kd, int64_t prefetch);
void amx_qk_i8(const int8_t* keys, int64_t nk, int64_t key_stride, int64_t kd, const int8_t* hi,
               const int8_t* lo, const float* qf, const float* kscale, float* s, int64_t s_stride,
               int32_t* c32, int64_t prefetch);

// int8 values on AMX-INT8 too (with amx_qk_i8), their codes as they are:
// for m < 16, c < dv_pad,
//   o[m][c] = alpha[m] * o[m][c] + f[m] * sum_n w16[m][n] * code(n, c),
// over n < nk (<= 64), key n's codes at rows[n] (zero past dv), where
// w16[m][n] = round(w[m][n] * kAmxQ16Max / max_n w[m][n]), w[m][n] = s[n *
// s_stride + m] * vscale[n] >= 0 and f[m] = max_n w[m][n] / kAmxQ16Max:
// pv_i8's int16 weights, split into two int8 halves (as amx_split_q
// splits queries), the sums exact in int32. The codes become B operands
// of four keys a 32-bit lane, quads[j][p][x][r] = key 4 p + r's code at
// column 16 j + x (64 * dv_pad bytes). For each row read, the row fetch[n]
// bytes further on is prefetched (0: none). Scratch: w,
// kAmxPvI8WeightBytes; c32, kAmxPvI8SumInts int32s. Between
// amx_tiles_begin() and amx_tiles_end().
inline constexpr int64_t kAmxPvI8WeightBytes = 2 * 16 * 64;  // w
inline constexpr int64_t kAmxPvI8SumInts = 2 * 1024;         // c32
void amx_pv_i8(const void* const* rows, const int64_t* fetch, int64_t nk, int64_t dv,
               int64_t dv_pad, const float* s, int64_t s_stride, const float* vscale, float* o,
               const float* alpha, int8_t* quads, int8_t* w, int32_t* c32);

// Loads the tile configuration amx_qk, amx_qk_i8 and amx_pv use into this
// thread's tile state, and releases the tiles (so that context switches
// need not save them).
void amx_tiles_begin();
void amx_tiles_end();

}  // namespace attnkit::kernels::cpu
