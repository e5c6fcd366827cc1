#include "kernels/cpu/gated_delta_rule_cpu.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "core/threads.h"
#include "kernels/cpu/gated_delta_rule_chunked.inc"
#include "kernels/linear.h"

namespace attnkit::kernels::cpu {
namespace {

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

// Block u of a row into / from a V16; kTail: the row's last `tail` (< 16)
// columns, lane by lane, the lanes past them 0.
template <bool kTail>
ATTNKIT_GDR_INLINE void load_block(V16& dst, const float* row, int u, int64_t tail) {
  if constexpr (kTail) {
    dst = V16{};
    for (int64_t j = 0; j < tail; ++j) dst[j] = row[j];
  } else {
    dst = reinterpret_cast<const V16*>(row)[u];
  }
}
template <bool kTail>
ATTNKIT_GDR_INLINE void store_block(float* row, int u, const V16& v, int64_t tail) {
  if constexpr (kTail) {
    for (int64_t j = 0; j < tail; ++j) row[j] = v[j];
  } else {
    reinterpret_cast<V16*>(row)[u] = v;
  }
}

// NB blocks of kGdrColumns columns side by side, [c0, c0 + 16 NB) of head
// h of sequence b, every token of the call; kTail: one block of the last
// `tail` (< 16) columns, moved lane by lane. Each pass walks the rows in
// address order (NB * 64 contiguous bytes per row, the whole row when NB *
// 16 == dv), which the hardware prefetchers follow; the 2 NB sums are
// independent chains, enough to keep both FMA ports busy.
template <int NB, bool kTail = false>
ATTNKIT_GDR_INLINE void recurrent_wide(const GatedDeltaRuleParams& p, int64_t b, int64_t h,
                                       int64_t c0, int64_t tail = 0) {
  static_assert(!kTail || NB == 1);
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);
  float* S = p.state + (b * p.num_v_heads + h) * dk * dv + c0;  // row i at S + i * dv
  for (int64_t t = 0; t < p.seq; ++t) {
    const int64_t row = b * p.seq + t;
    const float* q = p.q_at(row, kh);
    const float* k = p.k_at(row, kh);
    const float* v = p.v_at(row, h) + c0;
    float* out = p.out + row * p.out_stride + h * dv + c0;
    const float decay = std::exp(p.g[row * p.num_v_heads + h]);
    const float beta = p.beta[row * p.num_v_heads + h];
    const float kq = dot(k, q, dk);
    V16 sk[NB] = {}, sq[NB] = {}, delta[NB], x;
    for (int64_t i = 0; i < dk; ++i) {
      for (int u = 0; u < NB; ++u) {
        load_block<kTail>(x, S + i * dv, u, tail);
        sk[u] += x * k[i];
        sq[u] += x * q[i];
      }
    }
    // S_new = decay S + k delta^T, so S_new^T q = decay S^T q + (k.q) delta.
    for (int u = 0; u < NB; ++u) {
      load_block<kTail>(x, v, u, tail);
      delta[u] = beta * (x - decay * sk[u]);
      store_block<kTail>(out, u, decay * sq[u] + kq * delta[u], tail);
    }
    for (int64_t i = 0; i < dk; ++i)
      for (int u = 0; u < NB; ++u) {
        load_block<kTail>(x, S + i * dv, u, tail);
        store_block<kTail>(S + i * dv, u, decay * x + k[i] * delta[u], tail);
      }
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
  if (c0 < dv) recurrent_wide<1, true>(p, b, h, c0, dv - c0);
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

}  // namespace

size_t gated_delta_rule_chunked_scratch(const GatedDeltaRuleParams& p) {
  ChunkScratch unused;
  // A line more than the blocks: room to start them at a line (line_start).
  return chunk_floats(p, &unused, nullptr) + 16;
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
  auto task_fn = avx512(target)                ? chunked_task_avx512<NoClock>
                 : target == SimdTarget::kAvx2 ? chunked_task_avx2<NoClock>
                                               : chunked_task_scalar<NoClock>;
  const int64_t per_task = task_groups(p),
                tasks_per_seq = (p.num_k_heads + per_task - 1) / per_task;
  // One pointer captured: std::function keeps it without allocating.
  const struct {
    const GatedDeltaRuleParams& p;
    decltype(task_fn) run;
    float* scratch;
    size_t per_worker;
    int64_t per_task, tasks_per_seq;
  } ctx{p,        task_fn,      line_start(scratch), gated_delta_rule_chunked_scratch(p),
        per_task, tasks_per_seq};
  parallel_for(p.batch * tasks_per_seq, threads, [c = &ctx](int64_t task, int worker) {
    ChunkScratch s;
    chunk_floats(c->p, &s, c->scratch + static_cast<size_t>(worker) * c->per_worker);
    const int64_t kh0 = task % c->tasks_per_seq * c->per_task;
    NoClock clock;
    c->run(c->p, task / c->tasks_per_seq, kh0, std::min(kh0 + c->per_task, c->p.num_k_heads), s,
           clock);
  });
}

}  // namespace attnkit::kernels::cpu
