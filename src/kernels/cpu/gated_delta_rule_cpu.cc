#include "kernels/cpu/gated_delta_rule_cpu.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/threads.h"
#include "kernels/linear.h"

namespace attnkit::kernels::cpu {
namespace {

// Function-level targets: the same source compiled for AVX-512, AVX2 and
// the baseline, chosen at run time by the active SIMD target
// (core/cpu_features.h), without flags on the whole file. Every body is
// an always-inline function, so its code lands in each target's wrapper.
// Sums run in the same order on every target; targets with FMA contract
// multiply-adds, so their last bits differ from the baseline's.
#define ATTNKIT_GDR_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma")))
#define ATTNKIT_GDR_AVX2 __attribute__((target("avx2,fma")))
#define ATTNKIT_GDR_INLINE [[gnu::always_inline]] inline

// 16 floats, any alignment: GCC lowers its arithmetic to one zmm, two ymm
// or four xmm registers by the function's target.
typedef float V16 __attribute__((vector_size(64), aligned(4)));

// k . q over n values: 16 lanes of partial sums, then the tail.
ATTNKIT_GDR_INLINE float dot(const float* k, const float* q, int64_t n) {
  V16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc += *reinterpret_cast<const V16*>(k + i) * *reinterpret_cast<const V16*>(q + i);
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += acc[j];
  for (; i < n; ++i) sum += k[i] * q[i];
  return sum;
}

// NB blocks of kGdrColumns columns side by side, [c0, c0 + 16 NB) of head
// h of sequence b, every token of the call. Each pass walks the rows in
// address order (NB * 64 contiguous bytes per row, the whole row when NB *
// 16 == dv), which the hardware prefetchers follow; the 2 NB sums are
// independent chains, enough to keep both FMA ports busy.
template <int NB>
ATTNKIT_GDR_INLINE void recurrent_wide(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                       int64_t c0) {
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);
  float* S = p.state + (b * p.num_v_heads + h) * dk * dv + c0;  // row i at S + i * dv
  for (int64_t t = 0; t < p.seq; ++t) {
    const int64_t row = b * p.seq + t;
    const float* q = p.q + row * p.q_stride + kh * dk;
    const float* k = p.k + row * p.k_stride + kh * dk;
    const float* v = p.v + row * p.v_stride + h * dv + c0;
    float* out = p.out + row * p.out_stride + h * dv + c0;
    const float decay = std::exp(p.g[row * p.num_v_heads + h]);
    const float beta = p.beta[row * p.num_v_heads + h];
    const float kq = dot(k, q, dk);
    V16 sk[NB] = {}, sq[NB] = {}, delta[NB];
    for (int64_t i = 0; i < dk; ++i) {
      const V16* s = reinterpret_cast<const V16*>(S + i * dv);
      for (int u = 0; u < NB; ++u) {
        sk[u] += s[u] * k[i];
        sq[u] += s[u] * q[i];
      }
    }
    // S_new = decay S + k delta^T, so S_new^T q = decay S^T q + (k.q) delta.
    for (int u = 0; u < NB; ++u) {
      delta[u] = beta * (reinterpret_cast<const V16*>(v)[u] - decay * sk[u]);
      reinterpret_cast<V16*>(out)[u] = decay * sq[u] + kq * delta[u];
    }
    for (int64_t i = 0; i < dk; ++i) {
      V16* s = reinterpret_cast<V16*>(S + i * dv);
      for (int u = 0; u < NB; ++u) s[u] = decay * s[u] + k[i] * delta[u];
    }
  }
}

// The last dv % 16 columns, [c0, c0 + width), the same steps in scalars.
ATTNKIT_GDR_INLINE void recurrent_tail(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                       int64_t c0, int64_t width) {
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);
  float* S = p.state + (b * p.num_v_heads + h) * dk * dv + c0;
  for (int64_t t = 0; t < p.seq; ++t) {
    const int64_t row = b * p.seq + t;
    const float* q = p.q + row * p.q_stride + kh * dk;
    const float* k = p.k + row * p.k_stride + kh * dk;
    const float* v = p.v + row * p.v_stride + h * dv + c0;
    float* out = p.out + row * p.out_stride + h * dv + c0;
    const float decay = std::exp(p.g[row * p.num_v_heads + h]);
    const float beta = p.beta[row * p.num_v_heads + h];
    const float kq = dot(k, q, dk);
    float sk[kGdrColumns] = {}, sq[kGdrColumns] = {}, delta[kGdrColumns];
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < width; ++j) {
        sk[j] += S[i * dv + j] * k[i];
        sq[j] += S[i * dv + j] * q[i];
      }
    for (int64_t j = 0; j < width; ++j) {
      delta[j] = beta * (v[j] - decay * sk[j]);
      out[j] = decay * sq[j] + kq * delta[j];
    }
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < width; ++j) S[i * dv + j] = decay * S[i * dv + j] + k[i] * delta[j];
  }
}

// kMax blocks at a time: 8 on AVX-512 (16 zmm sums of its 32 registers),
// 4 elsewhere (AVX2's 16 ymm registers hold 4 blocks' sums).
template <int kMax>
ATTNKIT_GDR_INLINE void recurrent_head_impl(const GatedDeltaRuleParams& p, int64_t b, int64_t h) {
  const int64_t dv = p.value_head_dim;
  int64_t c0 = 0;
  for (; c0 + kMax * kGdrColumns <= dv; c0 += kMax * kGdrColumns) recurrent_wide<kMax>(p, b, h, c0);
  const int64_t rest = (dv - c0) / kGdrColumns;
  if constexpr (kMax > 4) {
    if (rest >= 4) {
      recurrent_wide<4>(p, b, h, c0);
      c0 += 4 * kGdrColumns;
    }
  }
  if ((dv - c0) / kGdrColumns >= 2) {
    recurrent_wide<2>(p, b, h, c0);
    c0 += 2 * kGdrColumns;
  }
  if ((dv - c0) / kGdrColumns >= 1) {
    recurrent_wide<1>(p, b, h, c0);
    c0 += kGdrColumns;
  }
  if (c0 < dv) recurrent_tail(p, b, h, c0, dv - c0);
}

ATTNKIT_GDR_AVX512 void recurrent_head_avx512(const GatedDeltaRuleParams& p, int64_t b, int64_t h) {
  recurrent_head_impl<8>(p, b, h);
}
ATTNKIT_GDR_AVX2 void recurrent_head_avx2(const GatedDeltaRuleParams& p, int64_t b, int64_t h) {
  recurrent_head_impl<4>(p, b, h);
}
void recurrent_head_scalar(const GatedDeltaRuleParams& p, int64_t b, int64_t h) {
  recurrent_head_impl<4>(p, b, h);
}

// The chunked form's scratch, one worker's, carved from one float array.
struct ChunkScratch {
  float* sw;   // [dk + C, dv]: the state S, then U (the chunk's deltas)
  float* kc;   // [C, dk]: the chunk's keys, contiguous
  float* qx;   // [C, dk + C]: row i = [exp(G_i) q_i | D[i][:] * (q_i . k_:), lower-incl]
  float* kk;   // [C, C]: K K^T, then Q K^T
  float* dm;   // [C, C]: D[i][j] = exp(G_i - G_j), j <= i
  float* tm;   // [C, C]: T = (I + L)^-1
  float* rhs;  // [C, dv]: K S0, then beta * (V - exp(G) K S0)
  float* kwt;  // [dk, C]: (exp(G_n-1 - G_j) k_j)^T
  float* y;    // [dk, dv]: kwt U
};

size_t chunk_floats(int64_t dk, int64_t dv, int64_t C, ChunkScratch* s, float* base) {
  const int64_t sizes[] = {(dk + C) * dv, C * dk, C * (dk + C), C * C,  C * C,
                           C * C,         C * dv, dk * C,       dk * dv};
  float** slots[] = {&s->sw, &s->kc, &s->qx, &s->kk, &s->dm, &s->tm, &s->rhs, &s->kwt, &s->y};
  size_t total = 0;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    // 16-float (64-byte) alignment for every block.
    if (base) *slots[i] = base + total;
    total += static_cast<size_t>((sizes[i] + 15) / 16 * 16);
  }
  return total;
}

// Below f32's smallest normal a decay is written as 0: its terms are below
// 1e-38 of the others, and denormal operands would slow every product.
constexpr double kMinDecay = 1.1754943508222875e-38;

ATTNKIT_GDR_INLINE void chunked_head_impl(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                          const ChunkScratch& s) {
  constexpr int64_t C = kGdrChunk;
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);
  const int64_t H = p.num_v_heads;
  float* state = p.state + (b * H + h) * dk * dv;
  float* S = s.sw;
  float* U = s.sw + dk * dv;
  std::copy(state, state + dk * dv, S);
  std::array<double, C> decay;  // exp(g_t), each <= 1
  std::array<float, C> eg;      // exp(G_i), G_i = g_0 + .. + g_i
  LinearOptions one;
  one.backend = Backend::kFast;
  for (int64_t c0 = 0; c0 < p.seq; c0 += C) {
    const int64_t n = std::min(C, p.seq - c0);
    const int64_t row0 = b * p.seq + c0;
    const float* q0 = p.q + row0 * p.q_stride + kh * dk;
    const float* k0 = p.k + row0 * p.k_stride + kh * dk;
    const float* v0 = p.v + row0 * p.v_stride + h * dv;
    const float* g0 = p.g + row0 * H + h;
    const float* beta0 = p.beta + row0 * H + h;
    // Decays as products of the per-token factors exp(g_t) <= 1 in double:
    // D[i][j] = exp(g_j+1) ... exp(g_i). Every partial product is <= 1, so
    // nothing overflows however fast a head forgets, and a row's relative
    // error is at most ~n double roundings: as exact as the authors'
    // log-space cumulative sums, with n exps per chunk instead of n^2.
    double acc = 1.0;
    for (int64_t i = 0; i < n; ++i) {
      decay[i] = std::exp(static_cast<double>(g0[i * H]));
      acc = acc * decay[i] < kMinDecay ? 0.0 : acc * decay[i];
      eg[i] = static_cast<float>(acc);
    }
    for (int64_t i = 0; i < n; ++i) {
      float* di = s.dm + i * C;
      std::fill(di, di + n, 0.0f);
      double d = 1.0;
      di[i] = 1.0f;
      for (int64_t j = i - 1; j >= 0; --j) {
        d *= decay[j + 1];
        if (d < kMinDecay) break;
        di[j] = static_cast<float>(d);
      }
    }
    for (int64_t i = 0; i < n; ++i)
      std::copy(k0 + i * p.k_stride, k0 + i * p.k_stride + dk, s.kc + i * dk);

    // T = (I + L)^-1, L[i][j] = beta_i D[i][j] k_i.k_j (j < i): row i of T
    // is e_i - sum_{j<i} L[i][j] T_j, and T_j is zero beyond column j.
    linear(s.kc, dk, s.kc, nullptr, s.kk, C, n, n, dk, one);
    for (int64_t i = 0; i < n; ++i) {
      float* ti = s.tm + i * C;
      std::fill(ti, ti + n, 0.0f);
      ti[i] = 1.0f;
      const float bi = beta0[i * H];
      for (int64_t j = 0; j < i; ++j) {
        const float lij = bi * s.dm[i * C + j] * s.kk[i * C + j];
        const float* tj = s.tm + j * C;
        for (int64_t c = 0; c <= j; ++c) ti[c] -= lij * tj[c];
      }
    }

    // U = T (beta * (V - exp(G) * (K S0))).
    linear_nn(s.kc, dk, S, dv, s.rhs, dv, n, dv, dk, Backend::kFast);
    for (int64_t i = 0; i < n; ++i) {
      const float bi = beta0[i * H], ei = eg[i];
      const float* vi = v0 + i * p.v_stride;
      float* ri = s.rhs + i * dv;
      for (int64_t j = 0; j < dv; ++j) ri[j] = bi * (vi[j] - ei * ri[j]);
    }
    linear_nn(s.tm, C, s.rhs, dv, U, dv, n, dv, n, Backend::kFast);

    // O = [exp(G) Q | lower-incl(D * Q K^T)] [S0; U], written in place.
    linear(q0, p.q_stride, s.kc, nullptr, s.kk, C, n, n, dk, one);
    for (int64_t i = 0; i < n; ++i) {
      const float* qi = q0 + i * p.q_stride;
      float* xi = s.qx + i * (dk + C);
      for (int64_t d = 0; d < dk; ++d) xi[d] = eg[i] * qi[d];
      for (int64_t j = 0; j < n; ++j) xi[dk + j] = s.dm[i * C + j] * s.kk[i * C + j];
    }
    linear_nn(s.qx, dk + C, S, dv, p.out + row0 * p.out_stride + h * dv, p.out_stride, n, dv,
              dk + n, Backend::kFast);

    // S = exp(G_n-1) S0 + (D[n-1][:] K)^T U.
    const float* last_row = s.dm + (n - 1) * C;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = s.kc + j * dk;
      for (int64_t d = 0; d < dk; ++d) s.kwt[d * C + j] = last_row[j] * kj[d];
    }
    linear_nn(s.kwt, C, U, dv, s.y, dv, dk, dv, n, Backend::kFast);
    const float last = eg[n - 1];
    for (int64_t i = 0; i < dk * dv; ++i) S[i] = last * S[i] + s.y[i];
  }
  std::copy(S, S + dk * dv, state);
}

ATTNKIT_GDR_AVX512 void chunked_head_avx512(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                            const ChunkScratch& s) {
  chunked_head_impl(p, b, h, s);
}
ATTNKIT_GDR_AVX2 void chunked_head_avx2(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                        const ChunkScratch& s) {
  chunked_head_impl(p, b, h, s);
}
void chunked_head_scalar(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                         const ChunkScratch& s) {
  chunked_head_impl(p, b, h, s);
}

bool avx512(SimdTarget t) { return t == SimdTarget::kAvx512 || t == SimdTarget::kAvx512Bf16; }

}  // namespace

size_t gated_delta_rule_chunked_scratch(const GatedDeltaRuleParams& p) {
  ChunkScratch unused;
  return chunk_floats(p.key_head_dim, p.value_head_dim, kGdrChunk, &unused, nullptr);
}

void gated_delta_rule_recurrent(const GatedDeltaRuleParams& p, int threads, SimdTarget target) {
  auto head = avx512(target)                ? recurrent_head_avx512
              : target == SimdTarget::kAvx2 ? recurrent_head_avx2
                                            : recurrent_head_scalar;
  parallel_for(p.batch * p.num_v_heads, threads, [&p, head](int64_t task, int) {
    head(p, task / p.num_v_heads, task % p.num_v_heads);
  });
}

void gated_delta_rule_chunked(const GatedDeltaRuleParams& p, int threads, SimdTarget target,
                              float* scratch) {
  auto head = avx512(target)                ? chunked_head_avx512
              : target == SimdTarget::kAvx2 ? chunked_head_avx2
                                            : chunked_head_scalar;
  const size_t per_worker = gated_delta_rule_chunked_scratch(p);
  parallel_for(p.batch * p.num_v_heads, threads, [&](int64_t task, int worker) {
    ChunkScratch s;
    chunk_floats(p.key_head_dim, p.value_head_dim, kGdrChunk, &s,
                 scratch + static_cast<size_t>(worker) * per_worker);
    head(p, task / p.num_v_heads, task % p.num_v_heads, s);
  });
}

}  // namespace attnkit::kernels::cpu
