// The P V stage of a tile: O = alpha O + P V through the KernelTable, and
// the slow path for masked keys holding non-finite values (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <cstring>

namespace attnkit::kernels::cpu {

namespace {

bool rows_finite(const void* base, DType dtype, int64_t stride, int64_t rows, int64_t cols) {
  uint32_t bad = 0;
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

float load_kv(const void* base, DType dtype, int64_t index) {
  if (dtype == DType::kBF16) return bf16_to_float(static_cast<const bf16*>(base)[index]);
  return static_cast<const float*>(base)[index];
}

}  // namespace

// Rows [m_lo_, m_) of o += P V (s and alpha indexed by packed row).
void TaskRunner::accumulate(int64_t j0, int64_t nk, const float* s, const float* alpha, Prefetch pf,
                            const int64_t* seen) {
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

bool TaskRunner::values_finite(int64_t j0, int64_t nk) const {
  bool finite = true;
  for_runs(p_, b_, j0, nk, [&](int64_t, int64_t row, int64_t n) {
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
    const void* v = v_row(p_.key_row(b_, j0 + n));
    for (int64_t m = m_lo_; m < m_; ++m) {
      const float w = s[n * g_.s_stride + m];
      if (w == 0.0f) continue;
      for (int64_t c = 0; c < g_.dv; ++c) o[m * g_.dv_pad + c] += w * load_kv(v, p_.kv_dtype, c);
    }
  }
}

}  // namespace attnkit::kernels::cpu
