// The QK stage of a tile: the packed, scaled queries and S = K Q^T
// through the KernelTable (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/decode_amx.h"

namespace attnkit::kernels::cpu {

// qt = scale * q in the KernelTable's blocked, transposed layout (fp32, or
// bf16 pairs for the vdpbf16ps kernels), or as 4 row-major rows for the
// qk_rows_* kernels. Pad columns m >= m_ are 0 so that their scores stay
// finite. In the portable loops columns are the inner loop: writes are
// contiguous, and the rows being read (one per column) stay in L1.
void TaskRunner::pack_q() {
  const float** rows = reinterpret_cast<const float**>(ws_ + g_.qrows);
  for (int64_t m = 0; m < m_; ++m)
    rows[m] = p_.q + b_ * p_.q_stride.batch + p_.q_row(b_, row_of(m)) * p_.q_stride.row +
              head_of(m) * p_.q_stride.head;
  const float scale = p_.scale;
  const int64_t w = g_.kt->qk_block_cols, dim = p_.q_stride.dim;
  const KernelTable& kt = *g_.kt;
  if (g_.q16_rows > 0) return pack_q_int16(rows);
  if (g_.amx_qk && dim == 1)
    return amx_pack_q(rows, m_, g_.d, scale, reinterpret_cast<uint16_t*>(qt_),
                      g_.q8 ? reinterpret_cast<uint16_t*>(qt_) + 16 * g_.qt_row : nullptr,
                      g_.qt_row);
  if (g_.amx_qk) {  // decode_amx.h's operand, zero past m_ and head_dim
    uint16_t* out = reinterpret_cast<uint16_t*>(qt_);
    uint16_t* lo = out + 16 * g_.qt_row;  // 8-bit keys: the remainders
    std::fill(out, out + (g_.q8 ? 32 : 16) * g_.qt_row, uint16_t{0});
    for (int64_t m = 0; m < m_; ++m)
      for (int64_t c = 0; c < g_.d; ++c) {
        const float x = rows[m][c * dim] * scale;
        const bf16 hi = float_to_bf16(x);
        out[amx_q_index(m, c)] = hi.bits;
        if (g_.q8) lo[amx_q_index(m, c)] = float_to_bf16(x - bf16_to_float(hi)).bits;
      }
    return;
  }
  if (g_.rows_qk || g_.qk_groups) {  // 4 (fp8 groups: m_pad) row-major rows, zero-padded
    // One plain loop per row and dtype, so that the compiler vectorises
    // it (a loop over the padded row with the dtype test inside did not,
    // and took ~6 % of a bf16 decode step).
    const int64_t count = g_.qk_groups ? g_.m_pad : 4;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t valid = r < m_ ? g_.d : 0;
      if (g_.dot_bf16) {
        uint16_t* out = reinterpret_cast<uint16_t*>(qt_) + r * g_.qt_row;
        for (int64_t c = 0; c < valid; ++c) out[c] = float_to_bf16(rows[r][c * dim] * scale).bits;
        std::fill(out + valid, out + g_.qt_row, uint16_t{0});
      } else {
        float* out = qt_ + r * g_.qt_row;
        for (int64_t c = 0; c < valid; ++c) out[c] = rows[r][c * dim] * scale;
        std::fill(out + valid, out + g_.qt_row, 0.0f);
      }
    }
    return;
  }
  if (dim == 1 && (g_.dot_bf16 ? kt.pack_q_bf16 != nullptr : kt.pack_q_f32 != nullptr)) {
    for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
      const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
      if (g_.dot_bf16)
        kt.pack_q_bf16(rows + m0, valid, g_.d, scale,
                       reinterpret_cast<uint16_t*>(qt_) + m0 * ceil_div(g_.d, 2) * 2, w);
      else
        kt.pack_q_f32(rows + m0, valid, g_.d, scale, qt_ + m0 * g_.d, w);
    }
    return;
  }
  if (g_.dot_bf16) {
    uint16_t* qt2 = reinterpret_cast<uint16_t*>(qt_);
    const int64_t pairs = ceil_div(g_.d, 2);
    for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
      uint16_t* block = qt2 + m0 * pairs * 2;
      const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
      for (int64_t c = 0; c < pairs * 2; ++c) {
        uint16_t* out = block + (c / 2) * w * 2 + (c & 1);
        for (int64_t x = 0; x < valid; ++x)
          out[2 * x] = c < g_.d ? float_to_bf16(rows[m0 + x][c * dim] * scale).bits : 0;
        for (int64_t x = valid; x < w; ++x) out[2 * x] = 0;
      }
    }
    return;
  }
  float* qt = qt_;
  for (int64_t m0 = 0; m0 < g_.m_pad; m0 += w) {
    float* block = qt + m0 * g_.d;
    const int64_t valid = std::clamp(m_ - m0, int64_t{0}, w);
    for (int64_t c = 0; c < g_.d; ++c) {
      float* out = block + c * w;
      for (int64_t x = 0; x < valid; ++x) out[x] = rows[m0 + x][c * dim] * scale;
      std::fill(out + valid, out + w, 0.0f);
    }
  }
}

namespace {

// One query row scaled and rounded to int16 in steps of qmax / max |scale *
// x| (pack_q_int16); returns the step, NaN for a row holding NaN or Inf, 0
// for a row of zeros (or so small that qmax / max overflows), whose codes
// are then 0. Written for the compiler to vectorise (it is called per task
// and kv head, 32 times per row in a split 16K-key decode step): max |y|
// and the non-finite test as one integer max on the bits (a float max
// reduction it may not reorder: one maxss after another was most of the
// packing's time), and rounding to nearest by adding and subtracting 1.5 *
// 2^23 (exact for |y| <= qmax < 2^22), not nearbyint, which the baseline
// target calls out of line.
template <int64_t kStride>
float quantize_q_row(const float* x, int64_t stride, int64_t n, float scale, float qmax,
                     int16_t* out) {
  if constexpr (kStride != 0) stride = kStride;
  // Non-negative floats order as their bits do; Inf and NaN above all.
  uint32_t top = 0;
  for (int64_t c = 0; c < n; ++c) {
    const float y = x[c * stride] * scale;
    uint32_t bits;
    std::memcpy(&bits, &y, sizeof bits);
    top = std::max(top, bits & 0x7fffffffu);
  }
  const bool bad = top >= 0x7f800000u;
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  const float inv = qmax / amax;
  if (bad || !std::isfinite(inv)) {
    for (int64_t c = 0; c < n; ++c) out[c] = 0;
    return bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  for (int64_t c = 0; c < n; ++c) {
    const float y = x[c * stride] * scale * inv;
    out[c] = static_cast<int16_t>(static_cast<int32_t>((y + kRound) - kRound));
  }
  return amax / qmax;
}

}  // namespace

// For qk_rows_i8 (int8 keys): each of the q16_rows rows, scaled, quantized
// to int16 with a factor of its own, row r = qf[r] * q16[r] (qf after the
// q16_rows rows of qt_row int16s; rows past m_ are 0). The range keeps head_dim * 127 * max|q16|
// below 2^31, so the kernel's int32 sums are exact: 32767 up to head_dim 516, 29357 at MLA's 576. A
// row's rounding is at most qf / 2 per element, 2^-16 of its largest |scale * q| at head dims up to
// 516: small beside the int8 keys' own step of 2^-8 of theirs.
void TaskRunner::pack_q_int16(const float* const* rows) {
  const double limit = std::min(g_.amx_int8 ? double(kAmxQ16Max) : 32767.0,
                                std::floor(2147483647.0 / (127.0 * double(g_.d))));
  const float qmax = static_cast<float>(limit);
  const int64_t dim = p_.q_stride.dim;
  int16_t* q16 = reinterpret_cast<int16_t*>(qt_);
  float* qf = reinterpret_cast<float*>(q16 + g_.q16_rows * g_.qt_row);
  for (int64_t r = 0; r < g_.q16_rows; ++r) {
    int16_t* out = q16 + r * g_.qt_row;
    const int64_t valid = r < m_ ? g_.d : 0;
    qf[r] = dim == 1 ? quantize_q_row<1>(rows[r], 1, valid, p_.scale, qmax, out)
                     : quantize_q_row<0>(rows[r], dim, valid, p_.scale, qmax, out);
    std::fill(out + valid, out + g_.qt_row, int16_t{0});
  }
  if (g_.amx_int8) {
    int8_t* hi = reinterpret_cast<int8_t*>(qf + g_.q16_rows);
    amx_split_q(q16, g_.qt_row, g_.d, hi, hi + 16 * g_.amx_kd8, g_.amx_kd8);
  }
}

// `seen`: see tile(); the kernels take it for a whole tile, not for a
// run of keys that a ring or a page cuts short.
void TaskRunner::scores(int64_t j0, int64_t nk, float* s, Prefetch pf, const int64_t* seen) {
  const KernelTable& kt = *g_.kt;
  auto whole = [&](int64_t n) { return n == nk ? seen : nullptr; };
  auto fetch = [&](int64_t at, int64_t row) {
    return prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
  };
  if (g_.amx_qk) return scores_amx(j0, nk, s, pf);
  if (g_.q8) return scores_8bit(j0, nk, s, pf, seen);
  if (g_.rows_qk && g_.dot_bf16) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(qt_);
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.qk_rows_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, q,
                      g_.qt_row, s + at * 4, fetch(at, row));
    });
  } else if (g_.rows_qk && !g_.bf16) {
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.qk_rows_f32(static_cast<const float*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_,
                     g_.qt_row, s + at * 4, fetch(at, row));
    });
  } else if (g_.dot_bf16) {
    const uint16_t* qt2 = reinterpret_cast<const uint16_t*>(qt_) + m_lo_ * ceil_div(g_.d, 2) * 2;
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.qk_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, qt2,
                 g_.m_pad - m_lo_, s + at * g_.s_stride + m_lo_, g_.s_stride, fetch(at, row));
    });
  } else if (g_.rows_qk && g_.bf16 && !g_.k_copies) {
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.qk_rows_widen(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_,
                       g_.qt_row, s + at * 4, fetch(at, row));
    });
  } else if (g_.bf16) {
    float* kw = ws_ + g_.kw;
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.widen_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d,
                    kw + at * g_.d_pad, g_.d_pad, fetch(at, row));
    });
    if (g_.rows_qk)
      kt.qk_rows_f32(kw, g_.d_pad, nk, g_.d, qt_, g_.qt_row, s, 0);
    else
      kt.qk_f32(kw, g_.d_pad, nk, g_.d, qt_ + m_lo_ * g_.d, g_.m_pad - m_lo_, s + m_lo_,
                g_.s_stride, 0, seen);
  } else {
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.qk_f32(static_cast<const float*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_ + m_lo_ * g_.d,
                g_.m_pad - m_lo_, s + at * g_.s_stride + m_lo_, g_.s_stride, fetch(at, row),
                whole(n));
    });
  }
}

// scores() for 8-bit keys: qk_rows_i8 / qk_rows_fp8 where the codes lie
// (1-4 rows, one scale per row), else each run of the tile dequantized into
// the kw buffer (fp32, or bf16 for qk_bf16) and the product over the copy.
void TaskRunner::scores_8bit(int64_t j0, int64_t nk, float* s, Prefetch pf, const int64_t* seen) {
  const KernelTable& kt = *g_.kt;
  auto fetch = [&](int64_t at, int64_t row) {
    return prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
  };
  const int64_t kss = p_.k_scale_stride.row;
  if (g_.qk_groups) return scores_8bit_groups(j0, nk, s, pf);
  if (g_.rows_qk) {
    const int16_t* q16 = reinterpret_cast<const int16_t*>(qt_);
    const float* qf = reinterpret_cast<const float*>(q16 + 4 * g_.qt_row);
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      if (g_.fp8)
        kt.qk_rows_fp8(static_cast<const uint8_t*>(k_row(row)), p_.k_stride.row, n, g_.d, qt_,
                       g_.qt_row, k_scales(row), kss, s + at * 4, fetch(at, row));
      else
        kt.qk_rows_i8(static_cast<const int8_t*>(k_row(row)), p_.k_stride.row, n, g_.d, q16,
                      g_.qt_row, qf, k_scales(row), kss, s + at * 4, fetch(at, row));
    });
    return;
  }
  float* kw = ws_ + g_.kw;
  uint16_t* kw16 = reinterpret_cast<uint16_t*>(kw);
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    const uint8_t* codes = static_cast<const uint8_t*>(k_row(row));
    if (g_.dot_bf16)
      kt.dequant_bf16(codes, p_.k_stride.row, n, g_.d, k_scales(row), kss, p_.scale_block, g_.fp8,
                      kw16 + at * g_.d_pad, g_.d_pad, fetch(at, row));
    else
      kt.dequant_f32(codes, p_.k_stride.row, n, g_.d, k_scales(row), kss, p_.scale_block, g_.fp8,
                     kw + at * g_.d_pad, g_.d_pad, fetch(at, row));
  });
  if (g_.dot_bf16)
    kt.qk_bf16(kw16, g_.d_pad, nk, g_.d,
               reinterpret_cast<const uint16_t*>(qt_) + m_lo_ * ceil_div(g_.d, 2) * 2,
               g_.m_pad - m_lo_, s + m_lo_, g_.s_stride, 0);
  else
    kt.qk_f32(kw, g_.d_pad, nk, g_.d, qt_ + m_lo_ * g_.d, g_.m_pad - m_lo_, s + m_lo_, g_.s_stride,
              0, seen);
}

// scores_8bit() by groups of 4 rows (Geometry::qk_groups: int8 keys on
// tiles of 5-16 rows, or 8-bit keys of any rows in batch-invariant plans):
// qk_rows_i8 (int16 query rows) or qk_rows_fp8 (fp32 ones) over the codes
// where they lie, one group of 4 query rows at a time (the first group's
// pass brings the tile into L1 and issues the prefetches, the others read
// it from there), each group's packed scores copied into its 4 columns of
// s. Groups wholly before m_lo_ or past the task's rows are skipped: their
// columns are not read (before m_lo_), or keep the finite values run() and
// the softmax left there (past m_).
void TaskRunner::scores_8bit_groups(int64_t j0, int64_t nk, float* s, Prefetch pf) {
  const KernelTable& kt = *g_.kt;
  const int16_t* q16 = reinterpret_cast<const int16_t*>(qt_);
  const float* qf = reinterpret_cast<const float*>(q16 + g_.q16_rows * g_.qt_row);
  float* packed = ws_ + g_.kw;  // [nk][4]
  const int64_t kss = p_.k_scale_stride.row;
  const int64_t r_end = round_up(m_, 4);
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    int64_t fetch = prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
    for (int64_t r0 = m_lo_ / 4 * 4; r0 < r_end; r0 += 4) {
      if (g_.fp8)
        kt.qk_rows_fp8(static_cast<const uint8_t*>(k_row(row)), p_.k_stride.row, n, g_.d,
                       qt_ + r0 * g_.qt_row, g_.qt_row, k_scales(row), kss, packed, fetch);
      else
        kt.qk_rows_i8(static_cast<const int8_t*>(k_row(row)), p_.k_stride.row, n, g_.d,
                      q16 + r0 * g_.qt_row, g_.qt_row, qf + r0, k_scales(row), kss, packed, fetch);
      fetch = 0;
      float* out = s + at * g_.s_stride + r0;
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(out + i * g_.s_stride, packed + 4 * i, 4 * sizeof(float));
    }
  });
}

}  // namespace attnkit::kernels::cpu

namespace attnkit::kernels::cpu {

// scores() on AMX tiles (Geometry::amx_qk): the tile's bf16 keys or int8
// codes read where they lie when the tile is one run of whole blocks, else
// each run copied (bf16, int8) or decoded (fp8) into the kw buffer, with
// their scales beside them; then one product for the whole tile. Every
// column of s is written (pad rows' with the scores of zero queries).
void TaskRunner::amx_begin() {
  if (amx_loaded_) return;
  amx_tiles_begin();
  amx_loaded_ = true;
}

void TaskRunner::scores_amx(int64_t j0, int64_t nk, float* s, Prefetch pf) {
  amx_begin();
  float* kscale = g_.q8 ? ws_ + g_.kw : nullptr;
  uint16_t* keys = reinterpret_cast<uint16_t*>(ws_ + g_.kw + g_.bk);
  if (g_.amx_int8) {
    int8_t* codes = reinterpret_cast<int8_t*>(keys);
    const int64_t kd8 = g_.amx_kd8;
    // Whole tiles of one run, at a head_dim of whole 64-byte rows, are read
    // in place; others are copied, with zero rows up to a whole 32 keys.
    const int8_t* tile = nullptr;
    int64_t stride = kd8, fetch = 0;
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      const int64_t f = prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
      if (n == nk && nk % 32 == 0 && g_.d == kd8) {
        tile = static_cast<const int8_t*>(k_row(row));
        stride = p_.k_stride.row;
        fetch = f;
      } else {
        amx_keys_copy_i8(static_cast<const int8_t*>(k_row(row)), p_.k_stride.row, n, g_.d,
                         codes + at * kd8, kd8, f);
      }
      const float* sc = k_scales(row);
      for (int64_t i = 0; i < n; ++i) kscale[at + i] = sc[i * p_.k_scale_stride.row];
    });
    if (tile == nullptr) {
      std::memset(codes + nk * kd8, 0, static_cast<size_t>((round_up(nk, 32) - nk) * kd8));
      tile = codes;
    }
    const int16_t* q16 = reinterpret_cast<const int16_t*>(qt_);
    const float* qf = reinterpret_cast<const float*>(q16 + g_.q16_rows * g_.qt_row);
    const int8_t* hi = reinterpret_cast<const int8_t*>(qf + g_.q16_rows);
    amx_qk_i8(tile, nk, stride, kd8, hi, hi + 16 * kd8, qf, kscale, s, g_.s_stride,
              reinterpret_cast<int32_t*>(ws_ + g_.kw + g_.bk + g_.bk * kd8 / 4), fetch);
    return;
  }
  const int64_t kd = g_.qt_row;
  // bf16 keys as the int8 codes above: a whole tile of one run, in blocks
  // of 16 keys at a head_dim of whole 64-byte rows, in place (the copy cost
  // 4-token bf16 decode ~8 % of its time: docs/PERFORMANCE.md); others
  // copied (fp8: decoded), with zero rows up to a whole 16 keys.
  const uint16_t* tile = nullptr;
  int64_t stride = kd, fetch = 0;
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    const int64_t f = prefetch_at(pf, j0, nk, at, row, p_.k_stride.row);
    uint16_t* dst = keys + at * kd;
    if (g_.bf16) {
      if (n == nk && nk % 16 == 0 && g_.d == kd) {
        tile = static_cast<const uint16_t*>(k_row(row));
        stride = p_.k_stride.row;
        fetch = f;
        return;
      }
      amx_keys_bf16(static_cast<const uint16_t*>(k_row(row)), p_.k_stride.row, n, g_.d, dst, kd, f);
      return;
    }
    amx_keys_fp8(static_cast<const uint8_t*>(k_row(row)), p_.k_stride.row, n, g_.d, dst, kd, f);
    const float* sc = k_scales(row);
    for (int64_t i = 0; i < n; ++i) kscale[at + i] = sc[i * p_.k_scale_stride.row];
  });
  if (tile == nullptr) {
    std::memset(keys + nk * kd, 0, static_cast<size_t>((round_up(nk, 16) - nk) * kd) * 2);
    tile = keys;
  }
  const uint16_t* q = reinterpret_cast<const uint16_t*>(qt_);
  amx_qk(tile, nk, stride, kd, q, g_.q8 ? q + 16 * g_.qt_row : nullptr, kscale, s, g_.s_stride,
         fetch);
}

}  // namespace attnkit::kernels::cpu
