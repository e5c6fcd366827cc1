// Error bounds of attnkit's attention against the float64 oracle
// (attention_f64.h) for inputs with |q|, |k|, |v| <= 1, as the cache, varlen
// and paged tests generate them.
//
// The kernel reads exactly the q, k, v the oracle reads (for bf16 K/V the
// oracle is fed the bf16-rounded values, so that rounding is part of the
// compared function, not of the error). What remains is the kernel's own
// arithmetic, which the contract allows to be fp32 (u = 2^-24, Higham's
// gamma_n = n u / (1 - n u)). First order, per output element, with
// S1 = scale * max_j sum_d |q_d k_jd| <= scale * head_dim and Vmax <= 1:
//   score error    ds <= (gamma_D + 8u) S1 + 4u   (f32 dot, scale, softcap,
//                  the exp argument, a few-ulp exp; moves out by 2 ds Vmax)
//   P.V and sum    2 gamma_2N Vmax                 (online rescaling included)
//   output         u Vmax
//   merges         f32 partial outputs and LSEs (a window's two parts, split
//                  keys): (u (2 + Lmax) + ds) Vmax, Lmax <= S1 + log N
// i.e. Vmax (3 ds + 3 gamma_2N + u (3 + Lmax)); the tests allow twice that.
// The reference backend (double accumulation) leaves only the f32 rounding
// of the scale (2 u S1), of the output (u) and of merged partial results
// (u (2 + Lmax)). With bf16 K/V the fast kernel may also round the scaled
// queries and the softmax weights to bf16 (src/kernels/cpu/attention_cpu.h:
// relative 2^-8 each), adding 2^-8 (2 S1 + 2) Vmax, again doubled.
// The 8-bit K/V types (against the oracle on their dequantized values,
// kv_quant_f64.h) may do the same with the dequantized K/V (prefill tiles
// on avx512bf16) and, for int8 keys, round the scaled queries to int16 in
// steps of max |scale q| / 29357 or finer (kernels/cpu/stage_qk.cc): a
// score error of at most S1 / 58714, 3x in the output, and round the
// weights to int16 for decode's P V: 2^-10 Vmax (kernels/cpu/kernel_table.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"
#include "common/random.h"

namespace attnkit_test {

inline double gamma_f32(int64_t n) {
  constexpr double u = 0x1p-24;
  return double(n) * u / (1.0 - double(n) * u);
}

// Absolute bound on an output element of attention over at most `keys`
// keys with head_dim `head_dim`; `scale` 0 = 1/sqrt(head_dim).
inline Tolerance attention_tolerance(int64_t head_dim, int64_t keys, attnkit::DType kv_dtype,
                                     attnkit::Backend backend, double scale = 0.0) {
  constexpr double u = 0x1p-24;
  const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(double(head_dim));
  const double s1 = s * double(head_dim);
  const double lmax = s1 + std::log(double(std::max<int64_t>(keys, 1)));
  if (backend == attnkit::Backend::kReference) return {2.0 * u * (3.0 + 2.0 * s1 + lmax), 0.0};
  const double ds = (gamma_f32(head_dim) + 8.0 * u) * s1 + 4.0 * u;
  double bound = 3.0 * ds + 3.0 * gamma_f32(2 * keys) + u * (3.0 + lmax);
  const bool q8 = kv_dtype == attnkit::DType::kI8 || kv_dtype == attnkit::DType::kFp8E4M3;
  if (kv_dtype == attnkit::DType::kBF16 || q8) bound += 0x1p-8 * (2.0 * s1 + 2.0);
  if (kv_dtype == attnkit::DType::kI8) bound += 3.0 * s1 / 58714.0 + 0x1p-10;
  return {2.0 * bound, 0.0};
}

}  // namespace attnkit_test
