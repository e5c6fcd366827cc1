// Microkernel templates shared by every SIMD target. Each per-target
// translation unit defines a vector-ops struct `V` in an anonymous namespace
// and instantiates these templates with it. Because V has internal linkage
// so does every instantiation, and each carries only its own target's
// instructions: an ordinary inline function shared by translation units
// compiled with different flags may be merged by the linker into the copy a
// CPU cannot run. For the same reason this header defines nothing that is
// not a template on V, and includes only <cstdint> and <type_traits>
// (types, no code).
//
// V provides (F = vector of kLanes floats, Mask = lane mask):
//   kLanes; kQkVecs, kQkAcc, kQkMaxKeys (QK register block: up to kQkVecs
//   vectors of rows times kQkAcc / vectors keys, at most kQkMaxKeys);
//   kPvRows, kPvVecs (PV register block: rows times vectors of columns);
//   optionally kPvFewRows, kPvFewVecs (a wider block for bf16 rows widened
//   in registers, in calls with at most kPvFewRows rows: 1-token decode);
//   zero, set1, load, store, bcast(const float*), mask_first(n),
//   load_masked(p, mask) (lanes off the mask read as 0 and never touched),
//   store_masked(p, mask, x) (lanes off the mask never touched),
//   fma(a, b, c) = a * b + c, mul, add, sub, div,
//   max(a, b) (b when either is NaN), abs, copysign(magnitude, sign),
//   ninf_to_zero (lanes equal to -inf become 0),
//   exp (exp(-inf) = 0, NaN stays NaN, a few ulp), and optionally
//   exp2_nonpos (2^t for t <= 0, -inf giving 0, NaN a NaN, a few ulp;
//   results below FLT_MIN may be 0),
//   widen_bf16(const uint16_t*, n) (first n of kLanes bf16, rest 0),
//   widen_i8(const int8_t*, n) (first n of kLanes int8 codes, exactly),
//   widen_fp8(const uint8_t*, n) (first n of kLanes fp8 E4M3 codes as
//   value * 2^-8, exactly: KernelTable's binary16 decoding),
//   prefetch(const void*) (a hint; any address, never faults),
// and optionally widen_fp8_pair(const uint8_t*, F[2]) (2 * kLanes whole
// codes as widen_fp8 decodes them, in fewer instructions).
// Layouts are described in kernel_table.h.
#pragma once

#include <cstdint>
#include <type_traits>

namespace attnkit::kernels::cpu::simd {

// ---- the keys a block of rows sees -------------------------------------

// The keys [first, end) that packed rows [m, m + count) see, from `seen`
// (KernelTable::qk_f32): the union of the rows' ranges, rows with an empty
// range adding nothing; all nk without `seen`, and an empty range if no row
// sees a key (P V then still scales o by alpha).
template <class V>
struct KeyRange {
  int64_t first, end;
};
template <class V>
inline KeyRange<V> keys_seen(const int64_t* seen, int64_t m, int64_t count, int64_t nk) {
  if (seen == nullptr) return {0, nk};
  int64_t first = nk, end = 0;
  for (int64_t r = m; r < m + count; ++r) {
    if (seen[2 * r] >= seen[2 * r + 1]) continue;
    first = seen[2 * r] < first ? seen[2 * r] : first;
    end = seen[2 * r + 1] > end ? seen[2 * r + 1] : end;
  }
  return {first, end > first ? end : first};
}

// ---- S = K Q^T: scores for one tile, key-major ------------------------

// One register block: KB keys by MV vectors of packed query rows, reduced
// over the whole head dimension. Keys are broadcast from their rows (no
// packing); queries are read from one column block of the q tile, whose
// rows are `w` floats apart (contiguous, so the block streams through L1).
template <class V, int KB, int MV>
inline void qk_block(const float* k, int64_t ks, int64_t d, const float* qt, int64_t w, int64_t ss,
                     float* s, int64_t pf) {
  using F = typename V::F;
  F acc[KB][MV];
#pragma GCC unroll 16
  for (int a = 0; a < KB; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) acc[a][b] = V::zero();
  // One pointer per key row, so that each broadcast is base + 4 c: written
  // as k + a * ks + c, GCC rebuilt some row addresses with lea chains inside
  // the loop, and the block ran at 0.71-0.83 of the FMA peak in L1 instead
  // of 0.79-0.92 (decode_tile_bench --benchmark_filter=rows16/compact/qk,
  // 2026-11-24 at 253bf29 on a Zen 3).
  const float* rows[KB];
#pragma GCC unroll 16
  for (int a = 0; a < KB; ++a) rows[a] = k + a * ks;
  for (int64_t c = 0; c < d; ++c) {
    if (pf != 0 && c % 16 == 0)
#pragma GCC unroll 16
      for (int a = 0; a < KB; ++a) V::prefetch(rows[a] + pf + c);
    const float* qrow = qt + c * w;
    F q[MV];
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) q[b] = V::load(qrow + b * V::kLanes);
#pragma GCC unroll 16
    for (int a = 0; a < KB; ++a) {
      const F kk = V::bcast(rows[a] + c);
#pragma GCC unroll 4
      for (int b = 0; b < MV; ++b) acc[a][b] = V::fma(kk, q[b], acc[a][b]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < KB; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < MV; ++b) V::store(s + a * ss + b * V::kLanes, acc[a][b]);
}

// All nk keys against one column block. A key count that is not a multiple
// of the block's KB ends with one more full block over the last KB keys,
// recomputing a few scores (the same values, written again) rather than
// running narrow blocks that are limited by loads.
template <class V, int MV>
inline void qk_columns(const float* k, int64_t ks, int64_t nk, int64_t d, const float* qt,
                       int64_t w, int64_t ss, float* s, int64_t pf) {
  constexpr int kb = V::kQkAcc / MV < V::kQkMaxKeys ? V::kQkAcc / MV : V::kQkMaxKeys;
  if (nk < kb) {
    for (int64_t n = 0; n < nk; ++n)
      qk_block<V, 1, MV>(k + n * ks, ks, d, qt, w, ss, s + n * ss, pf);
    return;
  }
  for (int64_t n = 0;; n += kb) {
    if (n + kb > nk) n = nk - kb;
    qk_block<V, kb, MV>(k + n * ks, ks, d, qt, w, ss, s + n * ss, pf);
    if (n + kb == nk) return;
  }
}

template <class V, int MV>
inline void qk_columns_tail(int64_t vecs, const float* k, int64_t ks, int64_t nk, int64_t d,
                            const float* qt, int64_t w, int64_t ss, float* s, int64_t pf) {
  if constexpr (MV >= 1) {
    if (vecs == MV) return qk_columns<V, MV>(k, ks, nk, d, qt, w, ss, s, pf);
    qk_columns_tail<V, MV - 1>(vecs, k, ks, nk, d, qt, w, ss, s, pf);
  }
}

// qt holds column blocks of kQkBlockCols = kQkVecs * kLanes columns, each
// [head_dim][kQkBlockCols] (see KernelTable::qk_block_cols).
// `pf` != 0: while reading a key row, prefetch the row pf elements further
// on (the next head's or the next tile's), once, from one column block: the
// first, or with `seen` the last, whose rows see the most keys of a causal
// diagonal. With `seen` each column block runs over the keys its rows see:
// a causal diagonal tile of 64 keys is a triangle, and computing all of it
// cost 6 % of a causal s1024 prefill's work in each product (32c4094,
// 2026-11-24, Zen 3: docs/PERFORMANCE.md#causal-prefill-skips).
template <class V>
void qk_f32(const float* k, int64_t ks, int64_t nk, int64_t d, const float* qt, int64_t m_pad,
            float* s, int64_t ss, int64_t pf, const int64_t* seen) {
  constexpr int64_t w = V::kQkVecs * V::kLanes;
  const int64_t vecs = m_pad / V::kLanes;
  const int64_t hinted = seen == nullptr ? 0 : (vecs - 1) / V::kQkVecs * V::kQkVecs;
  for (int64_t v = 0; v < vecs; v += V::kQkVecs) {
    const int64_t cvecs = vecs - v < V::kQkVecs ? vecs - v : V::kQkVecs;
    const KeyRange<V> keys = keys_seen<V>(seen, v * V::kLanes, cvecs * V::kLanes, nk);
    qk_columns_tail<V, V::kQkVecs>(cvecs, k + keys.first * ks, ks, keys.end - keys.first, d,
                                   qt + v / V::kQkVecs * d * w, w, ss,
                                   s + keys.first * ss + v * V::kLanes, v == hinted ? pf : 0);
  }
}

// ---- soft-capping and the online-softmax step --------------------------

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): e is in (0, 1],
// so nothing overflows; the absolute error is a few ulp of 1.
template <class V>
void softcap(float* s, int64_t nk, int64_t m_pad, int64_t ss, float cap) {
  using F = typename V::F;
  const F inv = V::set1(1.0f / cap), c = V::set1(cap), one = V::set1(1.0f),
          minus_two = V::set1(-2.0f);
  for (int64_t n = 0; n < nk; ++n)
    for (int64_t m = 0; m < m_pad; m += V::kLanes) {
      const F x = V::mul(V::load(s + n * ss + m), inv);
      const F e = V::exp(V::mul(V::abs(x), minus_two));
      const F t = V::div(V::sub(one, e), V::add(one, e));
      V::store(s + n * ss + m, V::mul(V::copysign(t, x), c));
    }
}

// exp(x - shift) for x <= shift (or -inf, or NaN): as 2^((x - shift) log2
// e) where the target has exp2_nonpos, which needs no clamp from above and
// one reduction step fewer. The softmax step of a prefill tile (64 keys x
// 256 packed rows, decode_tile_bench --benchmark_filter=rows256/compact/softmax,
// CPU time, medians of 5) took 3.9 us instead of 4.3-4.6 on AVX-512 and 6.1
// instead of 8.1-8.3 on AVX2 (2026-11-27, Intel Xeon family 6 model 167,
// busy: load 5-6): ~1 % and ~2 % of the tile (docs/PERFORMANCE.md#prefill).
template <class V>
inline typename V::F exp_below(typename V::F x, typename V::F shift) {
  if constexpr (requires(typename V::F t) { V::exp2_nonpos(t); })
    return V::exp2_nonpos(V::mul(V::sub(x, shift), V::set1(1.44269504088896341f)));
  else
    return V::exp(V::sub(x, shift));
}

template <class V>
void softmax(float* s, int64_t nk, int64_t m_pad, int64_t ss, float* row_max, float* row_sum,
             float* alpha) {
  using F = typename V::F;
  for (int64_t m = 0; m < m_pad; m += V::kLanes) {
    const F old_max = V::load(row_max + m);
    // Four independent max chains and two sum chains: the column is short
    // (a tile), so the reduction latency would otherwise dominate.
    F mx0 = old_max, mx1 = old_max, mx2 = old_max, mx3 = old_max;
    int64_t n = 0;
    for (; n + 4 <= nk; n += 4) {
      mx0 = V::max(V::load(s + n * ss + m), mx0);
      mx1 = V::max(V::load(s + (n + 1) * ss + m), mx1);
      mx2 = V::max(V::load(s + (n + 2) * ss + m), mx2);
      mx3 = V::max(V::load(s + (n + 3) * ss + m), mx3);
    }
    for (; n < nk; ++n) mx0 = V::max(V::load(s + n * ss + m), mx0);
    const F new_max = V::max(V::max(mx0, mx1), V::max(mx2, mx3));
    // A column with no finite score yet shifts by 0, so -inf stays -inf
    // (exp gives 0) instead of becoming -inf - -inf = NaN.
    const F shift = V::ninf_to_zero(new_max);
    const F a = V::exp(V::sub(old_max, shift));
    F sum0 = V::zero(), sum1 = V::zero();
    for (n = 0; n + 2 <= nk; n += 2) {
      const F p0 = exp_below<V>(V::load(s + n * ss + m), shift);
      const F p1 = exp_below<V>(V::load(s + (n + 1) * ss + m), shift);
      V::store(s + n * ss + m, p0);
      V::store(s + (n + 1) * ss + m, p1);
      sum0 = V::add(sum0, p0);
      sum1 = V::add(sum1, p1);
    }
    if (n < nk) {
      const F p0 = exp_below<V>(V::load(s + n * ss + m), shift);
      V::store(s + n * ss + m, p0);
      sum0 = V::add(sum0, p0);
    }
    V::store(row_sum + m, V::fma(V::load(row_sum + m), a, V::add(sum0, sum1)));
    V::store(row_max + m, new_max);
    V::store(alpha + m, a);
  }
}

// ---- O = alpha O + P V -------------------------------------------------

// V rows are fp32 (Elem = float) or bf16 (Elem = uint16_t, widened to fp32
// in registers, exactly, for targets without vdpbf16ps: a widened copy of
// the tile cost a store and a load per value and took no prefetch), or
// 8-bit codes decoded in registers (int8_t: int8; uint8_t: fp8 E4M3, as
// value * 2^-8), whose scales the caller has folded into the weights.
// The last vector of a row: lanes [count, kLanes) read as 0 and never
// touched; `mask` says the same for fp32 loads.
template <class V>
struct LastVec {
  typename V::Mask mask;
  int64_t count;
};

// The last vector of a column block of `cvecs` vectors from column c0, in
// rows of dv valid columns.
template <class V>
inline LastVec<V> last_vec(int64_t dv, int64_t c0, int64_t cvecs) {
  const int64_t valid = dv - (c0 + (cvecs - 1) * V::kLanes);
  const int64_t count = valid < 0 ? 0 : valid;
  return {V::mask_first(count), count};
}

template <class V>
inline typename V::F load_vec(const float* p) {
  return V::load(p);
}
template <class V>
inline typename V::F load_vec(const uint16_t* p) {
  return V::widen_bf16(p, V::kLanes);
}
template <class V>
inline typename V::F load_last(const float* p, LastVec<V> last) {
  return V::load_masked(p, last.mask);
}
template <class V>
inline typename V::F load_last(const uint16_t* p, LastVec<V> last) {
  return V::widen_bf16(p, last.count);
}
template <class V>
inline typename V::F load_vec(const int8_t* p) {
  return V::widen_i8(p, V::kLanes);
}
template <class V>
inline typename V::F load_last(const int8_t* p, LastVec<V> last) {
  return V::widen_i8(p, last.count);
}
template <class V>
inline typename V::F load_vec(const uint8_t* p) {
  return V::widen_fp8(p, V::kLanes);
}
template <class V>
inline typename V::F load_last(const uint8_t* p, LastVec<V> last) {
  return V::widen_fp8(p, last.count);
}

// One register block: MR packed rows by CV vectors of output columns, over
// all nk keys. The last column vector is loaded under `last` so a row is
// never read past head_dim_v. Prefetches are issued once per 64-byte line
// of the block's columns (a vector of 8 fp32 is half a line).
template <class V, int MR, int CV, class Elem>
inline void pv_block(const float* s, int64_t nk, int64_t ss, const Elem* v, int64_t vs, float* o,
                     int64_t dv_pad, const float* alpha, LastVec<V> last, int64_t pf, int64_t pf_lo,
                     int64_t pf_hi) {
  using F = typename V::F;
  F acc[MR][CV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const F a = V::bcast(alpha + r);
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) acc[r][c] = V::mul(V::load(o + r * dv_pad + c * V::kLanes), a);
  }
  // Keys [0, nk) in three runs, the middle one [pf_lo, pf_hi) prefetching
  // (empty without pf): unrolled, no run's loop tests per key whether to
  // prefetch. The test's compares and flag ops took the 6 x 2 block's loop
  // to ~30 instructions per 12 FMAs, near the front end's 6 a cycle; without
  // them whole calls ran 0.89-0.96x the time for 4-token decode and
  // 0.94-0.99x for prefill (A/B in one process, GQA 32/8 decode over 16K
  // keys and causal s1024-s2048 prefill, 2 threads; 2026-11-24 at d41a17f on
  // a Zen 3).
  const int64_t lo = pf_lo < 0 ? 0 : (pf_lo < nk ? pf_lo : nk);
  const int64_t hi = pf_hi < lo ? lo : (pf_hi < nk ? pf_hi : nk);
  const int64_t bounds[4] = {0, pf != 0 ? lo : 0, pf != 0 ? hi : 0, nk};
#pragma GCC unroll 3
  for (int run = 0; run < 3; ++run) {
    const bool fetch = run == 1;
    for (int64_t n = bounds[run]; n < bounds[run + 1]; ++n) {
      const Elem* vrow = v + n * vs;
      if (fetch)
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c)
          if (c * V::kLanes * sizeof(Elem) % 64 == 0) V::prefetch(vrow + pf + c * V::kLanes);
      F vv[CV];
      // fp8 codes of the first two vectors (whole ones: the last may be
      // cut) decoded together where the target can (widen_fp8_pair).
      constexpr bool kPair =
          CV >= 3 && std::is_same_v<Elem, uint8_t> && requires(const uint8_t* p, F* out) {
        V::widen_fp8_pair(p, out);
      };
      if constexpr (kPair) V::widen_fp8_pair(reinterpret_cast<const uint8_t*>(vrow), vv);
#pragma GCC unroll 4
      for (int c = kPair ? 2 : 0; c + 1 < CV; ++c) vv[c] = load_vec<V>(vrow + c * V::kLanes);
      vv[CV - 1] = load_last<V>(vrow + (CV - 1) * V::kLanes, last);
      const float* prow = s + n * ss;
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const F p = V::bcast(prow + r);
#pragma GCC unroll 4
        for (int c = 0; c < CV; ++c) acc[r][c] = V::fma(p, vv[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CV; ++c) V::store(o + r * dv_pad + c * V::kLanes, acc[r][c]);
}

template <class V, int MR, int CV, class Elem>
inline void pv_rows(int64_t rows, const float* s, int64_t nk, int64_t ss, const Elem* v, int64_t vs,
                    float* o, int64_t dv_pad, const float* alpha, LastVec<V> last, int64_t pf,
                    int64_t pf_lo, int64_t pf_hi) {
  if constexpr (MR >= 1) {
    if (rows == MR)
      return pv_block<V, MR, CV>(s, nk, ss, v, vs, o, dv_pad, alpha, last, pf, pf_lo, pf_hi);
    pv_rows<V, MR - 1, CV>(rows, s, nk, ss, v, vs, o, dv_pad, alpha, last, pf, pf_lo, pf_hi);
  }
}

// Each row block reads the whole V tile, so the prefetch of the rows pf
// further on is shared out, block b of B taking keys [b nk / B, (b + 1) nk /
// B): issued by the first block alone, a tile's lines were asked for in a
// third of the product (16 rows) and 4-token decode ran 5 % slower
// (GQA 32/8, 16K keys, 2 threads, alternated call by call; 2026-11-24 at
// d3bb6e7 on a Zen 5: docs/PERFORMANCE.md#prefetch). With
// `seen` a block runs over the
// keys its rows see only, and its share of the hints outside them is lost.
template <class V, int CV, class Elem>
inline void pv_columns(int64_t cvecs, int64_t rows, const float* s, int64_t nk, int64_t ss,
                       const Elem* v, int64_t vs, float* o, int64_t dv_pad, const float* alpha,
                       LastVec<V> last, int64_t pf, const int64_t* seen) {
  if constexpr (CV >= 1) {
    if (cvecs == CV) {
      const int64_t blocks = (rows + V::kPvRows - 1) / V::kPvRows;
      int64_t m = 0, b = 0;
      for (; m + V::kPvRows <= rows; m += V::kPvRows, ++b) {
        const KeyRange<V> k = keys_seen<V>(seen, m, V::kPvRows, nk);
        pv_block<V, V::kPvRows, CV>(s + m + k.first * ss, k.end - k.first, ss, v + k.first * vs, vs,
                                    o + m * dv_pad, dv_pad, alpha + m, last, pf,
                                    b * nk / blocks - k.first, (b + 1) * nk / blocks - k.first);
      }
      const KeyRange<V> k = keys_seen<V>(seen, m, rows - m, nk);
      return pv_rows<V, V::kPvRows - 1, CV>(rows - m, s + m + k.first * ss, k.end - k.first, ss,
                                            v + k.first * vs, vs, o + m * dv_pad, dv_pad, alpha + m,
                                            last, pf, b * nk / blocks - k.first, nk - k.first);
    }
    pv_columns<V, CV - 1>(cvecs, rows, s, nk, ss, v, vs, o, dv_pad, alpha, last, pf, seen);
  }
}

// The few-rows path: column blocks of up to CV vectors, one row block.
template <class V, int CV, class Elem>
inline void pv_few_columns(int64_t cvecs, int64_t rows, const float* s, int64_t nk, int64_t ss,
                           const Elem* v, int64_t vs, float* o, int64_t dv_pad, const float* alpha,
                           LastVec<V> last, int64_t pf) {
  if constexpr (CV >= 1) {
    if (cvecs == CV)
      return pv_rows<V, V::kPvFewRows, CV>(rows, s, nk, ss, v, vs, o, dv_pad, alpha, last, pf, 0,
                                           nk);
    pv_few_columns<V, CV - 1>(cvecs, rows, s, nk, ss, v, vs, o, dv_pad, alpha, last, pf);
  }
}

// `pf` != 0: prefetch the value rows pf elements further on, once. The
// few-rows path (decode) ignores `seen`.
template <class V, class Elem>
void pv(const float* s, int64_t nk, int64_t ss, int64_t rows, const Elem* v, int64_t vs, int64_t dv,
        float* o, int64_t dv_pad, const float* alpha, int64_t pf, const int64_t* seen) {
  if constexpr (sizeof(Elem) < 4 && requires { V::kPvFewVecs; }) {
    // Few rows leave most registers of the kPvRows block idle: a wider
    // block widens each loaded bf16 or 8-bit vector once for more multiply-adds and
    // keeps more accumulator chains in flight. (fp32 rows, which need no
    // widening, ran 5-10 % slower so: decode_tile_bench
    // --benchmark_filter=rows4/padded, 2026-11-24 at 2d9f2a5 on a Zen 3.)
    // The columns are cut so that no block is narrower than it must be (16
    // vectors at 3: 3 3 3 3 2 2, not 3 3 3 3 3 1, whose last block would
    // run one short chain per row).
    if (rows <= V::kPvFewRows) {
      const int64_t vecs = dv_pad / V::kLanes;
      for (int64_t c = 0; c < vecs;) {
        const int64_t left = vecs - c;
        const int64_t cvecs = left == V::kPvFewVecs + 1 ? (left + 1) / 2
                              : left < V::kPvFewVecs    ? left
                                                        : V::kPvFewVecs;
        const int64_t c0 = c * V::kLanes;
        pv_few_columns<V, V::kPvFewVecs>(cvecs, rows, s, nk, ss, v + c0, vs, o + c0, dv_pad, alpha,
                                         last_vec<V>(dv, c0, cvecs), pf);
        c += cvecs;
      }
      return;
    }
  }
  constexpr int64_t block = V::kPvVecs * V::kLanes;
  for (int64_t c0 = 0; c0 < dv_pad; c0 += block) {
    const int64_t width = dv_pad - c0 < block ? dv_pad - c0 : block;
    const int64_t cvecs = width / V::kLanes;
    pv_columns<V, V::kPvVecs>(cvecs, rows, s, nk, ss, v + c0, vs, o + c0, dv_pad, alpha,
                              last_vec<V>(dv, c0, cvecs), pf, seen);
  }
}

template <class V>
void pv_f32(const float* s, int64_t nk, int64_t ss, int64_t rows, const float* v, int64_t vs,
            int64_t dv, float* o, int64_t dv_pad, const float* alpha, int64_t pf,
            const int64_t* seen) {
  pv<V>(s, nk, ss, rows, v, vs, dv, o, dv_pad, alpha, pf, seen);
}

template <class V>
void pv_widen(const float* s, int64_t nk, int64_t ss, int64_t rows, const uint16_t* v, int64_t vs,
              int64_t dv, float* o, int64_t dv_pad, const float* alpha, int64_t pf,
              const int64_t* seen) {
  pv<V>(s, nk, ss, rows, v, vs, dv, o, dv_pad, alpha, pf, seen);
}

// KernelTable::pv_i8 / pv_fp8 in fp32: the weights of rows [0, rows) times
// each key's value scale (and 2^8 for fp8, which widen_fp8 decodes as value
// * 2^-8), copied to `pack`, then pv over the codes. (Folded into pv_block
// instead, the scale would cost a multiply per row and key; here it is one
// per key and vector of rows.)
template <class V, class Elem>
void pv_scaled(const float* s, int64_t nk, int64_t ss, int64_t rows, const Elem* v, int64_t vs,
               const float* vscale, int64_t vss, int64_t dv, float* o, int64_t dv_pad,
               const float* alpha, uint16_t* pack, int64_t pf, const int64_t* seen) {
  const float unit = std::is_same_v<Elem, uint8_t> ? 256.0f : 1.0f;
  float* w = reinterpret_cast<float*>(pack);
  for (int64_t n = 0; n < nk; ++n) {
    const typename V::F f = V::set1(vscale[n * vss] * unit);
    for (int64_t m = 0; m < rows; m += V::kLanes) {
      const int64_t left = rows - m;
      const typename V::Mask mask = V::mask_first(left);
      V::store_masked(w + n * ss + m, mask, V::mul(V::load_masked(s + n * ss + m, mask), f));
    }
  }
  pv<V>(w, nk, ss, rows, v, vs, dv, o, dv_pad, alpha, pf, seen);
}

template <class V>
void pv_i8(const float* s, int64_t nk, int64_t ss, int64_t rows, const int8_t* v, int64_t vs,
           const float* vscale, int64_t vss, int64_t dv, float* o, int64_t dv_pad,
           const float* alpha, uint16_t* pack, int64_t pf, const int64_t* seen) {
  pv_scaled<V>(s, nk, ss, rows, v, vs, vscale, vss, dv, o, dv_pad, alpha, pack, pf, seen);
}

template <class V>
void pv_fp8(const float* s, int64_t nk, int64_t ss, int64_t rows, const uint8_t* v, int64_t vs,
            const float* vscale, int64_t vss, int64_t dv, float* o, int64_t dv_pad,
            const float* alpha, uint16_t* pack, int64_t pf, const int64_t* seen) {
  pv_scaled<V>(s, nk, ss, rows, v, vs, vscale, vss, dv, o, dv_pad, alpha, pack, pf, seen);
}

// ---- 8-bit rows to fp32 ----------------------------------------------------

// KernelTable::dequant_f32. A block of scales is a multiple of 16 >=
// kLanes, so one vector never spans two scales; vectors past `cols` are
// stored as 0 without reading a scale (the row may hold no more).
template <class V>
void dequant_f32(const uint8_t* src, int64_t src_row_stride, int64_t rows, int64_t cols,
                 const float* scale, int64_t scale_stride, int64_t block, bool fp8, float* dst,
                 int64_t dst_row_stride, int64_t pf) {
  const float unit = fp8 ? 256.0f : 1.0f;  // widen_fp8 gives value * 2^-8
  for (int64_t n = 0; n < rows; ++n) {
    const uint8_t* row = src + n * src_row_stride;
    const float* sc = scale + n * scale_stride;
    if (pf != 0)
      for (int64_t c = 0; c < cols; c += 64) V::prefetch(row + pf + c);
    for (int64_t c = 0; c < dst_row_stride; c += V::kLanes) {
      const int64_t valid = cols - c < 0 ? 0 : cols - c;
      typename V::F x = V::zero();
      if (valid > 0) {
        x = fp8 ? V::widen_fp8(row + c, valid)
                : V::widen_i8(reinterpret_cast<const int8_t*>(row) + c, valid);
        x = V::mul(x, V::set1(sc[block > 0 ? c / block : 0] * unit));
      }
      V::store(dst + n * dst_row_stride + c, x);
    }
  }
}

// ---- bf16 rows to fp32 ---------------------------------------------------

// dst_row_stride is a multiple of kLanes and >= cols; the pad is written 0.
// `pf` != 0: also prefetch, per 64-byte line read, the line pf elements on.
template <class V>
void widen_bf16(const uint16_t* src, int64_t src_row_stride, int64_t rows, int64_t cols, float* dst,
                int64_t dst_row_stride, int64_t pf) {
  for (int64_t n = 0; n < rows; ++n) {
    const uint16_t* row = src + n * src_row_stride;
    if (pf != 0)
      for (int64_t c = 0; c < cols; c += 32) V::prefetch(row + pf + c);
    for (int64_t c = 0; c < dst_row_stride; c += V::kLanes) {
      const int64_t valid = cols - c < 0 ? 0 : cols - c;
      V::store(dst + n * dst_row_stride + c, V::widen_bf16(row + c, valid));
    }
  }
}

}  // namespace attnkit::kernels::cpu::simd
