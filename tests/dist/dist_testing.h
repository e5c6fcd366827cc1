// Shared by the multi-process tests (run under mpirun; every rank runs every
// test): the world communicator, data every rank generates identically from
// a seed, float64 references of the layers, and the comparison criterion.
//
// The criterion (FlashAttention's): a distributed result may be off its
// float64 reference by at most twice what the single-process fp32 result of
// the same computation is off it, plus the rounding of one length-n fp32 dot
// product of the result's magnitude, gamma_n max|ref| (Higham), which covers
// a single-process error that happens to be tiny. A wrong split, a lost
// head, a misplaced token or a bad merge is off by O(0.1) and fails.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "attnkit/tensor.h"
#include "common/attention_f64.h"
#include "common/random.h"

namespace attnkit_dist_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

inline std::vector<float> uniform(size_t n, uint64_t seed, float scale = 1.0f) {
  attnkit_test::Rng rng(seed);
  std::vector<float> v(n);
  for (float& e : v) e = rng.uniform(-scale, scale);
  return v;
}

inline double gamma(int64_t n) {
  constexpr double u = 0x1p-24;
  return double(n) * u / (1.0 - double(n) * u);
}

inline double max_abs(std::span<const double> v) {
  double m = 0.0;
  for (double e : v)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

// max |a - ref| over finite ref entries; a non-finite ref must be matched exactly.
inline double max_err(std::span<const float> a, std::span<const double> ref, bool* specials_ok) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) {
      if (double(a[i]) != ref[i]) *specials_ok = false;
      continue;
    }
    worst = std::max(worst, std::fabs(double(a[i]) - ref[i]));
  }
  return worst;
}

// The criterion above; `n` is the longest dot product behind one element.
inline ::testing::AssertionResult within_twice_single(const std::string& what,
                                                      std::span<const float> dist,
                                                      std::span<const float> single,
                                                      std::span<const double> ref, int64_t n) {
  if (dist.size() != ref.size() || single.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": sizes " << dist.size() << ", "
                                         << single.size() << ", reference " << ref.size();
  bool specials = true;
  const double e_dist = max_err(dist, ref, &specials);
  const double e_single = max_err(single, ref, &specials);
  const double bound = 2.0 * e_single + gamma(n) * max_abs(ref);
  if (!specials)
    return ::testing::AssertionFailure()
           << what << ": an -inf/NaN entry differs from the reference";
  if (e_dist > bound)
    return ::testing::AssertionFailure()
           << what << ": max error " << e_dist << " > bound " << bound << " (single-process error "
           << e_single << ", max |ref| " << max_abs(ref) << ")";
  return ::testing::AssertionSuccess();
}

// Whether every rank holds the same bytes in `v`.
inline bool same_on_every_rank(std::span<const float> v) {
  const int n = static_cast<int>(v.size() * sizeof(float));
  std::vector<char> root(v.size() * sizeof(float));
  if (world_rank() == 0) std::memcpy(root.data(), v.data(), root.size());
  MPI_Bcast(root.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  int same = std::memcmp(root.data(), v.data(), root.size()) == 0 ? 1 : 0, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// ---- slicing whole-sequence data into a rank's share ---------------------

// Rows `tokens` (dim 1) of a [B, S, row] tensor, as [B, tokens.size(), row].
template <typename E>
std::vector<E> take(const std::vector<E>& x, int64_t B, int64_t S, int64_t row,
                    const std::vector<int64_t>& tokens) {
  std::vector<E> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t : tokens)
      out.insert(out.end(), x.begin() + (b * S + t) * row, x.begin() + (b * S + t + 1) * row);
  return out;
}
// Entries `tokens` of the last dim of an lse [B, H, S] (BH = B * H).
template <typename E>
std::vector<E> take_lse(const std::vector<E>& x, int64_t BH, int64_t S,
                        const std::vector<int64_t>& tokens) {
  std::vector<E> out;
  for (int64_t i = 0; i < BH; ++i)
    for (int64_t t : tokens) out.push_back(x[size_t(i * S + t)]);
  return out;
}
// The tokens [begin, end).
inline std::vector<int64_t> token_range(int64_t begin, int64_t end) {
  std::vector<int64_t> t;
  for (int64_t i = begin; i < end; ++i) t.push_back(i);
  return t;
}

inline std::vector<float> round_bf16(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = attnkit_test::round_bf16(x[i]);
  return out;
}
inline std::vector<attnkit::bf16> to_bf16(const std::vector<float>& x) {
  std::vector<attnkit::bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = attnkit::float_to_bf16(x[i]);
  return out;
}

// The float64 attention oracle over f32 data (widened exactly).
struct OracleShape {
  int64_t batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, head_dim_v;
};
inline attnkit_test::OracleResult oracle(const OracleShape& s, const std::vector<float>& q,
                                         const std::vector<float>& k, const std::vector<float>& v,
                                         bool causal = false, double softcap = 0.0,
                                         std::vector<int32_t> seqlens_k = {}) {
  attnkit_test::OracleOptions o;
  o.batch = s.batch;
  o.seqlen_q = s.seqlen_q;
  o.seqlen_k = s.seqlen_k;
  o.num_heads = s.num_heads;
  o.num_kv_heads = s.num_kv_heads;
  o.head_dim = s.head_dim;
  o.head_dim_v = s.head_dim_v;
  o.causal = causal;
  o.softcap = softcap;
  o.seqlens_k = std::move(seqlens_k);
  return attnkit_test::attention_f64(o, std::vector<double>(q.begin(), q.end()),
                                     std::vector<double>(k.begin(), k.end()),
                                     std::vector<double>(v.begin(), v.end()));
}

// ---- float64 layer references -------------------------------------------

// y [rows, out] = x [rows, in] W^T (+ b), W [out, in].
inline std::vector<double> linear(std::span<const double> x, int64_t rows, int64_t in,
                                  std::span<const float> w, int64_t out,
                                  std::span<const float> b = {}) {
  std::vector<double> y(size_t(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : double(b[size_t(o)]);
      for (int64_t i = 0; i < in; ++i) s += x[size_t(r * in + i)] * double(w[size_t(o * in + i)]);
      y[size_t(r * out + o)] = s;
    }
  return y;
}

// In place over consecutive groups of `dim`: x / rms(x) * g.
inline void rms_norm(std::vector<double>& x, int64_t dim, std::span<const float> g, double eps,
                     int64_t stride, int64_t offset = 0) {
  for (size_t base = size_t(offset); base + size_t(dim) <= x.size(); base += size_t(stride)) {
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += x[base + size_t(i)] * x[base + size_t(i)];
    const double r = 1.0 / std::sqrt(ss / double(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) x[base + size_t(i)] *= r * double(g[size_t(i)]);
  }
}

// RoPE on `dim` features starting at `offset` of every group of `stride`
// values, group g at position pos[g / groups_per_pos]; interleaved pairs
// (2i, 2i+1) or half-split pairs (i, i + dim/2), no scaling.
inline void rope(std::vector<double>& x, int64_t dim, int64_t stride, int64_t offset,
                 int64_t groups_per_pos, std::span<const int64_t> pos, double theta,
                 bool interleaved) {
  const int64_t groups = int64_t(x.size()) / stride;
  for (int64_t g = 0; g < groups; ++g) {
    const double p = double(pos[size_t(g / groups_per_pos)]);
    double* v = x.data() + g * stride + offset;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double a = p * std::pow(theta, -2.0 * double(i) / double(dim));
      const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + dim / 2;
      const double xa = v[ia], xb = v[ib];
      v[ia] = xa * std::cos(a) - xb * std::sin(a);
      v[ib] = xb * std::cos(a) + xa * std::sin(a);
    }
  }
}

}  // namespace attnkit_dist_test
