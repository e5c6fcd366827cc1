// The P V stage of a tile: O = alpha O + P V through the KernelTable, and
// the slow path for masked keys holding non-finite values (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/decode_amx.h"
#include "kernels/kv_load.h"

namespace attnkit::kernels::cpu {

namespace {

bool rows_finite(const void* base, DType dtype, int64_t stride, int64_t rows, int64_t cols) {
  uint32_t bad = 0;
  if (dtype == DType::kI8 || dtype == DType::kFp8E4M3) {  // base: the rows' scales
    const float* x = static_cast<const float*>(base);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) bad |= !std::isfinite(x[n * stride + c]);
    return bad == 0;
  }
  if (dtype == DType::kBF16) {
    const uint16_t* x = static_cast<const uint16_t*>(base);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) bad |= (x[n * stride + c] & 0x7f80u) == 0x7f80u;
  } else {
    const uint32_t* x = static_cast<const uint32_t*>(base);
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t c = 0; c < cols; ++c) bad |= (x[n * stride + c] & 0x7f800000u) == 0x7f800000u;
  }
  return bad == 0;
}

}  // namespace

// Rows [m_lo_, m_) of o += P V (s and alpha indexed by packed row).
void TaskRunner::accumulate(int64_t j0, int64_t nk, const float* s, const float* alpha, Prefetch pf,
                            const int64_t* seen) {
  if (g_.amx_pv) return accumulate_amx(j0, nk, s, alpha, pf);
  if (g_.q8 && g_.pv_copies) return accumulate_dequantized(j0, nk, s, alpha, pf, seen);
  const KernelTable& kt = *g_.kt;
  auto fetch = [&](int64_t at, int64_t row) {
    return prefetch_at(pf, j0, nk, at, row, p_.v_stride.row);
  };
  float* o = o_ + m_lo_ * g_.dv_pad;
  const float* ones = ws_ + g_.ones;
  s += m_lo_;
  alpha += m_lo_;
  const int64_t rows = m_ - m_lo_;
  auto whole = [&](int64_t n) { return n == nk ? seen : nullptr; };
  if (g_.dot_bf16) {
    uint16_t* pack = reinterpret_cast<uint16_t*>(ws_ + g_.pack);
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.pv_bf16(s + at * g_.s_stride, n, g_.m_pad - m_lo_, g_.s_stride, rows,
                 static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, g_.dv, o, g_.dv_pad,
                 at == 0 ? alpha : ones, pack, fetch(at, row));
    });
    return;
  }
  if (g_.pv_copies) {
    // A compact copy: V rows of a kv head are often 4 KiB apart (all
    // heads of a token are adjacent), which folds a tile's columns onto
    // a few L1 sets; PV reads the tile once per block of rows.
    float* vw = ws_ + g_.vw;
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      if (g_.bf16) {
        kt.widen_bf16(static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, n, g_.dv,
                      vw + at * g_.vw_stride, g_.vw_stride, fetch(at, row));
        return;
      }
      const float* v = static_cast<const float*>(v_row(row));
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(vw + (at + r) * g_.vw_stride, v + r * p_.v_stride.row, sizeof(float) * g_.dv);
    });
    kt.pv_f32(s, nk, g_.s_stride, rows, vw, g_.vw_stride, g_.dv, o, g_.dv_pad, alpha, 0, seen);
    return;
  }
  if (g_.q8) {
    // 8-bit V where it lies, each key's value scale applied by the kernel.
    // Masked keys have weight 0 and finite scales here (finish_head sends
    // tiles with non-finite ones to the slow path).
    uint16_t* pack = reinterpret_cast<uint16_t*>(ws_ + g_.pack);
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      const float* w = s + at * g_.s_stride;
      const float* a = at == 0 ? alpha : ones;
      if (g_.fp8)
        kt.pv_fp8(w, n, g_.s_stride, rows, static_cast<const uint8_t*>(v_row(row)), p_.v_stride.row,
                  v_scales(row), p_.v_scale_stride.row, g_.dv, o, g_.dv_pad, a, pack,
                  fetch(at, row), whole(n));
      else
        (g_.pv_i8_f32 ? kt.pv_i8_f32 : kt.pv_i8)(
            w, n, g_.s_stride, rows, static_cast<const int8_t*>(v_row(row)), p_.v_stride.row,
            v_scales(row), p_.v_scale_stride.row, g_.dv, o, g_.dv_pad, a, pack, fetch(at, row),
            whole(n));
    });
    return;
  }
  if (g_.bf16) {
    for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
      kt.pv_widen(s + at * g_.s_stride, n, g_.s_stride, rows,
                  static_cast<const uint16_t*>(v_row(row)), p_.v_stride.row, g_.dv, o, g_.dv_pad,
                  at == 0 ? alpha : ones, fetch(at, row), whole(n));
    });
    return;
  }
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    kt.pv_f32(s + at * g_.s_stride, n, g_.s_stride, rows, static_cast<const float*>(v_row(row)),
              p_.v_stride.row, g_.dv, o, g_.dv_pad, at == 0 ? alpha : ones, fetch(at, row),
              whole(n));
  });
}

// 8-bit V dequantized run by run into the vw buffer (fp32, or bf16 for
// pv_bf16), then the product over the copy.
void TaskRunner::accumulate_dequantized(int64_t j0, int64_t nk, const float* s, const float* alpha,
                                        Prefetch pf, const int64_t* seen) {
  const KernelTable& kt = *g_.kt;
  float* vw = ws_ + g_.vw;
  uint16_t* vw16 = reinterpret_cast<uint16_t*>(vw);
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    const uint8_t* codes = static_cast<const uint8_t*>(v_row(row));
    const int64_t fetch = prefetch_at(pf, j0, nk, at, row, p_.v_stride.row);
    if (g_.dot_bf16)
      kt.dequant_bf16(codes, p_.v_stride.row, n, g_.dv, v_scales(row), p_.v_scale_stride.row,
                      p_.scale_block, g_.fp8, vw16 + at * g_.vw_stride, g_.vw_stride, fetch);
    else
      kt.dequant_f32(codes, p_.v_stride.row, n, g_.dv, v_scales(row), p_.v_scale_stride.row,
                     p_.scale_block, g_.fp8, vw + at * g_.vw_stride, g_.vw_stride, fetch);
  });
  float* o = o_ + m_lo_ * g_.dv_pad;
  const int64_t rows = m_ - m_lo_;
  if (g_.dot_bf16)
    kt.pv_bf16(s + m_lo_, nk, g_.m_pad - m_lo_, g_.s_stride, rows, vw16, g_.vw_stride, g_.dv, o,
               g_.dv_pad, alpha + m_lo_, reinterpret_cast<uint16_t*>(ws_ + g_.pack), 0);
  else
    kt.pv_f32(s + m_lo_, nk, g_.s_stride, rows, vw, g_.vw_stride, g_.dv, o, g_.dv_pad,
              alpha + m_lo_, 0, seen);
}

// accumulate() on AMX tiles (Geometry::amx_pv): the tile's values (each
// key's row wherever its run puts it) decoded straight into AMX's pairs in
// the vw buffer (int8: reordered into quads there, by amx_pv_i8), their
// scales in kw, then one product for the whole tile (all 16 rows: o has
// m_pad of them).
void TaskRunner::accumulate_amx(int64_t j0, int64_t nk, const float* s, const float* alpha,
                                Prefetch pf) {
  amx_begin();
  float* vscale = g_.q8 ? ws_ + g_.kw : nullptr;
  const void** rows = reinterpret_cast<const void**>(ws_ + g_.kw + g_.bk);
  int64_t* fetch = reinterpret_cast<int64_t*>(rows + g_.bk);
  for_runs(p_, b_, j0, nk, [&](int64_t at, int64_t row, int64_t n) {
    const int64_t f = prefetch_at(pf, j0, nk, at, row, p_.v_stride.row);
    for (int64_t i = 0; i < n; ++i) {
      rows[at + i] = v_row(row + i);
      fetch[at + i] = f;
    }
    if (!g_.q8) return;
    const float* sc = v_scales(row);
    for (int64_t i = 0; i < n; ++i) vscale[at + i] = sc[i * p_.v_scale_stride.row];
  });
  if (g_.amx_int8) {
    int8_t* scratch = reinterpret_cast<int8_t*>(ws_ + g_.pack);
    amx_pv_i8(rows, fetch, nk, g_.dv, g_.dv_pad, s, g_.s_stride, vscale, o_, alpha,
              reinterpret_cast<int8_t*>(ws_ + g_.vw), scratch,
              reinterpret_cast<int32_t*>(scratch + kAmxPvI8WeightBytes));
    return;
  }
  uint16_t* pairs = reinterpret_cast<uint16_t*>(ws_ + g_.vw);
  amx_value_pairs(rows, fetch, nk, g_.dv, g_.dv_pad, g_.fp8, pairs);
  amx_pv(s, nk, g_.s_stride, vscale, pairs, o_, g_.dv_pad, alpha,
         reinterpret_cast<uint16_t*>(ws_ + g_.pack), g_.q8);
}

// Whether the tile's V values are finite (8-bit V: its scales, the codes
// always decode to finite values).
bool TaskRunner::values_finite(int64_t j0, int64_t nk) const {
  bool finite = true;
  for_runs(p_, b_, j0, nk, [&](int64_t, int64_t row, int64_t n) {
    if (g_.q8)
      finite = finite && rows_finite(v_scales(row), p_.kv_dtype, p_.v_scale_stride.row, n,
                                     g_.row_scales ? 1 : ceil_div(g_.dv, p_.scale_block));
    else
      finite = finite && rows_finite(v_row(row), p_.kv_dtype, p_.v_stride.row, n, g_.dv);
  });
  return finite;
}

void TaskRunner::accumulate_skipping_zeros(int64_t j0, int64_t nk, const float* s,
                                           const float* alpha) {
  float* o = o_;
  for (int64_t m = m_lo_; m < m_; ++m)
    for (int64_t c = 0; c < g_.dv; ++c) o[m * g_.dv_pad + c] *= alpha[m];
  for (int64_t n = 0; n < nk; ++n) {
    const int64_t r = p_.key_row(b_, j0 + n);
    const int64_t v0 = b_ * p_.v_stride.batch + r * p_.v_stride.row + kvh_ * p_.v_stride.head;
    for (int64_t m = m_lo_; m < m_; ++m) {
      const float w = s[n * g_.s_stride + m];
      if (w == 0.0f) continue;
      for (int64_t c = 0; c < g_.dv; ++c)
        o[m * g_.dv_pad + c] +=
            w * static_cast<float>(kv_element(p_, true, v0 + c, b_, r, kvh_, c));
    }
  }
}

}  // namespace attnkit::kernels::cpu
