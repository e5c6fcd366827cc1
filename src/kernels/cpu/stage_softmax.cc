// The softmax stage of a tile: softcap, the masks (mask.h's rules) and
// the online softmax step (task_runner.h).
#include "kernels/cpu/task_runner.h"

#include <algorithm>
#include <cstring>

#include "kernels/mask.h"

namespace attnkit::kernels::cpu {

// The selected head's tile after its scores s: softcap, masks, the online
// softmax step and O = alpha O + P V (prefetch: as accumulate()).
void TaskRunner::finish_head(int64_t j0, int64_t nk, float* s, Prefetch prefetch,
                             const int64_t* seen, bool masked, bool sparse_partial,
                             const int64_t* row_lo, const int64_t* row_hi) {
  const int64_t cols = g_.m_pad - m_lo_;
  if (p_.softcap > 0.0f) {
    if (g_.rows_qk)  // elementwise: the packed tile as rows of 16 (whole vectors)
      g_.kt->softcap(s, ceil_div(nk * 4, 16), 16, 16, p_.softcap);
    else
      g_.kt->softcap(s + m_lo_, nk, cols, g_.s_stride, p_.softcap);
  }
  if (masked) apply_masks(j0, nk, s, row_lo, row_hi, sparse_partial);
  float* alpha = ws_ + g_.alpha;
  if (g_.rows_qk)
    g_.kt->softmax_rows4(s, nk, row_max_, row_sum_, alpha);
  else
    g_.kt->softmax(s + m_lo_, nk, cols, g_.s_stride, row_max_ + m_lo_, row_sum_ + m_lo_,
                   alpha + m_lo_);
  // A weight of 0 times a NaN or Inf value is NaN: where masked keys
  // hold non-finite values, add only the nonzero weights (rare, slow).
  if (masked && !values_finite(j0, nk))
    accumulate_skipping_zeros(j0, nk, s, alpha);
  else
    accumulate(j0, nk, s, alpha, prefetch, seen);
}

// bitmap[il][n] = the sparse pattern admits (row il, key j0 + n). The
// pattern is constant on (query block, key block) pairs, so it is asked
// once per pair and rows of one query block share a bitmap row.
void TaskRunner::fill_sparse_bitmap(int64_t j0, int64_t nk, const int64_t* row_lo,
                                    const int64_t* row_hi, int64_t* admitted,
                                    int64_t* admitted_visible) {
  uint8_t* bits = reinterpret_cast<uint8_t*>(ws_ + g_.bitmap);
  const SparsePattern& sp = p_.sparse;
  int64_t prev_block = 0;
  for (int64_t il = 0; il < rows_; ++il) {
    const int64_t pos = i0_ + il + offset_;
    const int64_t block = floor_div(pos, sp.block_size);
    uint8_t* row = bits + il * g_.bk;
    if (il > 0 && block == prev_block) {
      std::memcpy(row, row - g_.bk, static_cast<size_t>(nk));
    } else {
      bool admit = false;
      for (int64_t n = 0; n < nk; ++n) {
        const int64_t j = j0 + n;
        if (n == 0 || j % sp.block_size == 0) admit = sparse_admits(sp, pos, j);
        row[n] = admit;
      }
    }
    prev_block = block;
    const int64_t lo = std::clamp(row_lo[il] - j0, int64_t{0}, nk);
    const int64_t hi = std::clamp(row_hi[il] - j0, lo, nk);
    for (int64_t n = 0; n < nk; ++n) {
      *admitted += row[n];
      if (n >= lo && n < hi) *admitted_visible += row[n];
    }
  }
}

// Scores of keys a row may not see become -inf; the additive mask is
// added to the others (after softcap, as in the reference).
void TaskRunner::apply_masks(int64_t j0, int64_t nk, float* s, const int64_t* row_lo,
                             const int64_t* row_hi, bool sparse_partial) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(ws_ + g_.bitmap);
  const bool per_key = sparse_partial || p_.bool_mask || p_.add_mask;
  const Strides4& ms = p_.mask_stride;
  for (int64_t il = m_lo_ / g_.group; il < rows_; ++il) {
    const int64_t lo = std::clamp(row_lo[il] - j0, int64_t{0}, nk);
    const int64_t hi = std::clamp(row_hi[il] - j0, lo, nk);
    const int64_t i = i0_ + il;
    for (int64_t hg = 0; hg < g_.group; ++hg) {
      const int64_t m = il * g_.group + hg, h = kvh_ * g_.group + hg;
      float* col = s + m;
      for (int64_t n = 0; n < lo; ++n) col[n * g_.s_stride] = kNegInf;
      for (int64_t n = hi; n < nk; ++n) col[n * g_.s_stride] = kNegInf;
      if (!per_key) continue;
      const int64_t mask_row = b_ * ms.batch + h * ms.head + i * ms.row;
      for (int64_t n = lo; n < hi; ++n) {
        const int64_t at = mask_row + (j0 + n) * ms.dim;
        // A bias of -inf masks the key like false in a bool mask (and,
        // as in the reference, NaN + -inf must not make it NaN).
        if ((sparse_partial && !bits[il * g_.bk + n]) || (p_.bool_mask && p_.bool_mask[at] == 0) ||
            (p_.add_mask && p_.add_mask[at] == kNegInf)) {
          col[n * g_.s_stride] = kNegInf;
        } else if (p_.add_mask) {
          col[n * g_.s_stride] += p_.add_mask[at];
        }
      }
    }
  }
}

}  // namespace attnkit::kernels::cpu
