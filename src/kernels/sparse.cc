// DeepSeek sparse attention kernels (kernels/sparse.h).
//
// Indexer, fast form: one query row's indexer heads, dequantized and laid
// out [head_dim, n_heads] (heads innermost), meet every visible key once:
// the key's 128-value block is decoded through a 256-entry table and each
// decoded value multiplies all heads' features at once, a loop over heads
// with one accumulator per head that compilers vectorize without
// reassociating a sum. A decode step (one query row) splits its keys over
// the threads; prefill gives each thread whole rows.
//
// Top-k: std::nth_element over the visible keys' indices under a total
// order (higher score first, equal scores by lower index), then the chosen
// are sorted by index: O(visible) expected, and the chosen set is a
// function of the scores alone.
//
// Sparse attention, fast form: tasks are (batch item, query row, kv head,
// group of query heads); each task reads its selected keys in place
// (key_row()), widening one key row at a time to fp32 only when the cache
// is not fp32, scores all its heads against it, then does the same for the
// values. No gathered copy of the keys is made.
#include "kernels/sparse.h"

#include "attnkit/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/dispatch.h"
#include "kernels/kv_load.h"

namespace attnkit::kernels {
namespace {

namespace base {
#include "kernels/sparse_loops.inc"
}  // namespace base
// The same loops compiled for AVX2 and AVX-512: GCC through its target
// pragmas, clang (the sanitizer and fuzz builds) through a target attribute
// applied to every function of the region.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
#include "kernels/sparse_loops.inc"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,fma"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,fma,prefer-vector-width=512")
#endif
namespace avx512 {
#include "kernels/sparse_loops.inc"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

struct Loops {
  decltype(&base::score_heads) score_heads;
  decltype(&base::accumulate_heads) accumulate_heads;
  decltype(&base::accumulate_heads4) accumulate_heads4;
  decltype(&base::indexer_key) indexer_key;
};

// The loops for the active SIMD target (set_simd_target() can lower it).
Loops loops() {
  switch (simd_target()) {
    case SimdTarget::kAvx512:
    case SimdTarget::kAvx512Bf16:
      return {avx512::score_heads, avx512::accumulate_heads, avx512::accumulate_heads4,
              avx512::indexer_key};
    case SimdTarget::kAvx2:
      return {avx2::score_heads, avx2::accumulate_heads, avx2::accumulate_heads4,
              avx2::indexer_key};
    default:
      return {base::score_heads, base::accumulate_heads, base::accumulate_heads4,
              base::indexer_key};
  }
}

constexpr double kFp8Max = 448.0;

const float* fp8_table() {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] = fp8_e4m3_to_float(static_cast<uint8_t>(c));
    return t;
  }();
  return table.data();
}

// Higher score first; equal scores by lower index. NaN scores were mapped
// to -inf by the callers, so this is a strict total order.
template <class T>
void select_topk(const T* score, int64_t visible, int64_t topk, int32_t* order, int32_t* out,
                 int64_t out_stride) {
  const int64_t k = std::min(topk, visible);
  std::iota(order, order + visible, 0);
  const auto better = [score](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  if (k < visible) std::nth_element(order, order + k, order + visible, better);
  std::sort(order, order + k);
  for (int64_t n = 0; n < k; ++n) out[n * out_stride] = order[n];
  for (int64_t n = k; n < topk; ++n) out[n * out_stride] = -1;
}

template <class T>
T finite_or_lowest(T s) {
  return std::isnan(s) ? -std::numeric_limits<T>::infinity() : s;
}

// ---- indexer --------------------------------------------------------------

void indexer_row_ref(const IndexerParams& p, int64_t b, int64_t t, double* score, int32_t* order) {
  const int64_t H = p.n_heads, D = p.head_dim, S = p.seqlen_k;
  const int64_t visible = S - p.seqlen_q + t + 1;
  for (int64_t s = 0; s < visible; ++s) {
    const uint8_t* kc = p.k_codes + b * p.k_codes_stride.batch + s * p.k_codes_stride.row;
    const float* ks = p.k_scales + b * p.k_scales_stride.batch + s * p.k_scales_stride.row;
    double total = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* qc = p.q_codes + b * p.q_codes_stride.batch + t * p.q_codes_stride.row +
                          h * p.q_codes_stride.head;
      const float* qs = p.q_scales + b * p.q_scales_stride.batch + t * p.q_scales_stride.row +
                        h * p.q_scales_stride.head;
      double dot = 0.0;
      for (int64_t c = 0; c < D; ++c) {
        const int64_t blk = c / kIndexerBlock;
        dot += static_cast<double>(fp8_e4m3_to_float(qc[c * p.q_codes_stride.dim])) *
               qs[blk * p.q_scales_stride.dim] *
               static_cast<double>(fp8_e4m3_to_float(kc[c * p.k_codes_stride.col])) *
               ks[blk * p.k_scales_stride.col];
      }
      const double w = p.weights[b * p.weights_stride.batch + t * p.weights_stride.row +
                                 h * p.weights_stride.col];
      total += w * std::max(dot, 0.0);
    }
    score[s] = finite_or_lowest(total);
  }
  if (p.scores) {
    float* row = p.scores + b * p.scores_stride.batch + t * p.scores_stride.row;
    for (int64_t s = 0; s < S; ++s)
      row[s * p.scores_stride.col] =
          s < visible ? static_cast<float>(score[s]) : -std::numeric_limits<float>::infinity();
  }
  select_topk(score, visible, p.topk, order,
              p.indices + b * p.indices_stride.batch + t * p.indices_stride.row,
              p.indices_stride.col);
}

// qt [D, H]: query row (b, t) dequantized, heads innermost.
void load_query_transposed(const IndexerParams& p, int64_t b, int64_t t, float* qt) {
  const float* lut = fp8_table();
  const int64_t H = p.n_heads, D = p.head_dim;
  for (int64_t h = 0; h < H; ++h) {
    const uint8_t* qc = p.q_codes + b * p.q_codes_stride.batch + t * p.q_codes_stride.row +
                        h * p.q_codes_stride.head;
    const float* qs = p.q_scales + b * p.q_scales_stride.batch + t * p.q_scales_stride.row +
                      h * p.q_scales_stride.head;
    for (int64_t c = 0; c < D; ++c)
      qt[c * H + h] =
          lut[qc[c * p.q_codes_stride.dim]] * qs[(c / kIndexerBlock) * p.q_scales_stride.dim];
  }
}

// Scores of keys [s0, s1) for query row (b, t); acc [H] and kv [D] scratch.
void indexer_scores_fast(const IndexerParams& p, int64_t b, int64_t t, const float* qt, int64_t s0,
                         int64_t s1, float* acc, float* dot, float* kv, float* score) {
  const float* lut = fp8_table();
  const Loops fns = loops();
  const int64_t H = p.n_heads, D = p.head_dim;
  const float* w = p.weights + b * p.weights_stride.batch + t * p.weights_stride.row;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* kc = p.k_codes + b * p.k_codes_stride.batch + s * p.k_codes_stride.row;
    const float* ks = p.k_scales + b * p.k_scales_stride.batch + s * p.k_scales_stride.row;
    for (int64_t c = 0; c < D; ++c) kv[c] = lut[kc[c * p.k_codes_stride.col]];
    fns.indexer_key(qt, kv, ks, p.k_scales_stride.col, H, D, acc, dot);
    float total = 0.0f;
    for (int64_t h = 0; h < H; ++h) total += w[h * p.weights_stride.col] * std::max(dot[h], 0.0f);
    score[s] = finite_or_lowest(total);
  }
}

void finish_row_fast(const IndexerParams& p, int64_t b, int64_t t, const float* score,
                     int32_t* order) {
  const int64_t S = p.seqlen_k, visible = S - p.seqlen_q + t + 1;
  if (p.scores) {
    float* row = p.scores + b * p.scores_stride.batch + t * p.scores_stride.row;
    for (int64_t s = 0; s < S; ++s)
      row[s * p.scores_stride.col] =
          s < visible ? score[s] : -std::numeric_limits<float>::infinity();
  }
  select_topk(score, visible, p.topk, order,
              p.indices + b * p.indices_stride.batch + t * p.indices_stride.row,
              p.indices_stride.col);
}

template <class T>
bool alloc(std::unique_ptr<T[]>* buf, int64_t n) {
  buf->reset(new (std::nothrow) T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
  return *buf != nullptr;
}

Status no_memory(const char* what) {
  return resource_exhausted(std::string("lightning indexer / sparse attention: cannot allocate ") +
                            what);
}

}  // namespace

void indexer_quantize_row(const float* x, int64_t stride, int64_t n, bool ue8m0, uint8_t* codes,
                          float* scales) {
  for (int64_t c0 = 0; c0 < n; c0 += kIndexerBlock) {
    float amax = 1e-4f;  // DeepSeek's floor, so a block of zeros divides safely
    for (int64_t c = c0; c < c0 + kIndexerBlock; ++c)
      amax = std::max(amax, std::fabs(x[c * stride]));
    float scale = amax / static_cast<float>(kFp8Max);
    // ue8m0: the smallest power of two >= amax / 448, so x / scale <= 448.
    if (ue8m0) scale = std::exp2(std::ceil(std::log2(scale)));
    scales[c0 / kIndexerBlock] = scale;
    for (int64_t c = c0; c < c0 + kIndexerBlock; ++c)
      codes[c] = float_to_fp8_e4m3(x[c * stride] / scale);
  }
}

void hadamard_inplace(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

Status run_indexer(const IndexerParams& p, Backend backend) {
  const int64_t rows = p.batch * p.seqlen_q, S = p.seqlen_k, H = p.n_heads, D = p.head_dim;
  if (rows == 0) return Status::Ok();
  const int threads = resolve_num_threads(p.num_threads);
  if (resolve_backend(backend) == Backend::kReference) {
    std::unique_ptr<double[]> score;
    std::unique_ptr<int32_t[]> order;
    if (!alloc(&score, S) || !alloc(&order, S)) return no_memory("the reference's scores");
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t t = 0; t < p.seqlen_q; ++t) indexer_row_ref(p, b, t, score.get(), order.get());
    return Status::Ok();
  }
  // Per worker: qt [D, H], acc [H], dot [H], kv [D], score [S], order [S].
  const int64_t per = D * H + 2 * H + D;
  std::unique_ptr<float[]> fbuf, score;
  std::unique_ptr<int32_t[]> order;
  if (!alloc(&fbuf, per * threads) || !alloc(&score, S * threads) || !alloc(&order, S * threads))
    return no_memory("the indexer's scratch");
  const auto slot = [&](int w) { return fbuf.get() + static_cast<int64_t>(w) * per; };
  if (rows >= threads) {
    // Prefill (or a batch of decodes): whole rows per task, longest first.
    parallel_for(rows, threads, [&](int64_t task, int worker) {
      const int64_t r = rows - 1 - task, b = r / p.seqlen_q, t = r % p.seqlen_q;
      float* qt = slot(worker);
      float* sc = score.get() + static_cast<int64_t>(worker) * S;
      load_query_transposed(p, b, t, qt);
      indexer_scores_fast(p, b, t, qt, 0, S - p.seqlen_q + t + 1, qt + D * H, qt + D * H + H,
                          qt + D * H + 2 * H, sc);
      finish_row_fast(p, b, t, sc, order.get() + static_cast<int64_t>(worker) * S);
    });
    return Status::Ok();
  }
  // Fewer rows than threads (a decode step): split each row's keys.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / p.seqlen_q, t = r % p.seqlen_q, visible = S - p.seqlen_q + t + 1;
    float* qt = slot(0);
    load_query_transposed(p, b, t, qt);
    const int64_t chunk = std::max<int64_t>(256, (visible + 4 * threads - 1) / (4 * threads));
    const int64_t tasks = (visible + chunk - 1) / chunk;
    parallel_for(tasks, threads, [&](int64_t task, int worker) {
      float* own = slot(worker);
      const int64_t s0 = task * chunk, s1 = std::min(visible, s0 + chunk);
      indexer_scores_fast(p, b, t, qt, s0, s1, own + D * H, own + D * H + H, own + D * H + 2 * H,
                          score.get());
    });
    finish_row_fast(p, b, t, score.get(), order.get());
  }
  return Status::Ok();
}

// ---- attention over key indices --------------------------------------------

namespace {

const float* q_ptr(const AttentionParams& p, int64_t b, int64_t i, int64_t h) {
  return p.q + b * p.q_stride.batch + p.q_row(b, i) * p.q_stride.row + h * p.q_stride.head;
}
float* out_ptr(const AttentionParams& p, int64_t b, int64_t i, int64_t h) {
  return p.out + b * p.out_stride.batch + p.q_row(b, i) * p.out_stride.row + h * p.out_stride.head;
}
void write_lse(const AttentionParams& p, int64_t b, int64_t i, int64_t h, double value) {
  if (p.lse)
    p.lse[b * p.lse_stride_batch + h * p.lse_stride_head + p.q_row(b, i) * p.lse_stride_row] =
        static_cast<float>(value);
}

double capped(const AttentionParams& p, double s) {
  return p.softcap > 0.0f ? p.softcap * std::tanh(s / p.softcap) : s;
}

void sparse_ref(const AttentionParams& p, const KeyIndices& idx, double* s, double* acc) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.rows_of(b); ++i) {
      const int32_t* sel = idx.data + b * idx.stride.batch + i * idx.stride.row;
      for (int64_t h = 0; h < p.num_heads; ++h) {
        const int64_t kvh = h / group;
        const float* q = q_ptr(p, b, i, h);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t n = 0; n < idx.topk; ++n) {
          const int32_t j = sel[n * idx.stride.col];
          s[n] = -std::numeric_limits<double>::infinity();
          if (j < 0) continue;
          const int64_t r = p.key_row(b, j);
          const int64_t base = b * p.k_stride.batch + r * p.k_stride.row + kvh * p.k_stride.head;
          double dot = 0.0;
          for (int64_t c = 0; c < p.head_dim; ++c)
            dot += static_cast<double>(q[c * p.q_stride.dim]) *
                   kv_element(p, false, base + c * p.k_stride.dim, b, r, kvh, c);
          s[n] = capped(p, dot * p.scale);
          m = std::max(m, s[n]);
        }
        std::fill(acc, acc + p.head_dim_v, 0.0);
        double sum = 0.0;
        if (m > -std::numeric_limits<double>::infinity()) {
          for (int64_t n = 0; n < idx.topk; ++n) {
            const int32_t j = sel[n * idx.stride.col];
            if (j < 0) continue;
            const double e = std::exp(s[n] - m);
            sum += e;
            const int64_t r = p.key_row(b, j);
            const int64_t base = b * p.v_stride.batch + r * p.v_stride.row + kvh * p.v_stride.head;
            for (int64_t c = 0; c < p.head_dim_v; ++c)
              acc[c] += e * kv_element(p, true, base + c * p.v_stride.dim, b, r, kvh, c);
          }
        }
        float* o = out_ptr(p, b, i, h);
        for (int64_t c = 0; c < p.head_dim_v; ++c)
          o[c * p.out_stride.dim] = sum > 0.0 ? static_cast<float>(acc[c] / sum) : 0.0f;
        write_lse(p, b, i, h,
                  sum > 0.0 ? m + std::log(sum) : -std::numeric_limits<double>::infinity());
      }
    }
}

// Row r of k (value = false) or v for kv head kvh as fp32: in place when the
// cache is fp32 with unit channel stride, else widened into buf.
const float* load_row(const AttentionParams& p, bool value, int64_t b, int64_t r, int64_t kvh,
                      int64_t n, float* buf) {
  const Strides4& st = value ? p.v_stride : p.k_stride;
  const int64_t base = b * st.batch + r * st.row + kvh * st.head;
  if (p.kv_dtype == DType::kF32 && st.dim == 1)
    return static_cast<const float*>(value ? p.v : p.k) + base;
  for (int64_t c = 0; c < n; ++c)
    buf[c] = static_cast<float>(kv_element(p, value, base + c * st.dim, b, r, kvh, c));
  return buf;
}

}  // namespace

Status run_sparse_attention(const AttentionParams& p, const KeyIndices& idx, Backend backend) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return Status::Ok();
  const int64_t D = p.head_dim, Dv = p.head_dim_v, K = std::max<int64_t>(idx.topk, 1);
  if (resolve_backend(backend) == Backend::kReference) {
    std::unique_ptr<double[]> s, acc;
    if (!alloc(&s, K) || !alloc(&acc, Dv)) return no_memory("the reference's scores");
    sparse_ref(p, idx, s.get(), acc.get());
    return Status::Ok();
  }
  const int threads = resolve_num_threads(p.num_threads);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t units = p.batch * p.seqlen_q * p.num_kv_heads;
  // Split the heads of a group until there are a few tasks per thread (a
  // decode step of MLA's absorbed form has one kv head and 128 heads).
  int64_t hc = group;
  while (hc > 8 && units * ((group + hc - 1) / hc) < 4 * threads) hc = (hc + 1) / 2;
  const int64_t chunks = (group + hc - 1) / hc;
  // Per worker: s [hc, K], acc [hc, Dv], qf [hc, D] (q with unit stride),
  // rows [4, max(D, Dv)] (key or value rows widened to fp32, when not fp32).
  const int64_t per = hc * K + hc * Dv + hc * D + 4 * std::max(D, Dv);
  std::unique_ptr<float[]> buf;
  if (!alloc(&buf, per * threads)) return no_memory("the sparse attention's scratch");
  const Loops fns = loops();
  parallel_for(units * chunks, threads, [&](int64_t task, int worker) {
    const int64_t chunk = task % chunks, u = task / chunks;
    const int64_t kvh = u % p.num_kv_heads, bi = u / p.num_kv_heads;
    const int64_t b = bi / p.seqlen_q, i = bi % p.seqlen_q;
    if (i >= p.rows_of(b)) return;
    const int64_t h0 = kvh * group + chunk * hc, nh = std::min(hc, (kvh + 1) * group - h0);
    float* s = buf.get() + static_cast<int64_t>(worker) * per;
    float* acc = s + hc * K;
    float* qf = acc + hc * Dv;
    float* row = qf + hc * D;
    for (int64_t g = 0; g < nh; ++g) {
      const float* q = q_ptr(p, b, i, h0 + g);
      for (int64_t c = 0; c < D; ++c) qf[g * D + c] = q[c * p.q_stride.dim];
    }
    const int32_t* sel = idx.data + b * idx.stride.batch + i * idx.stride.row;
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < idx.topk; ++n) {
      const int32_t j = sel[n * idx.stride.col];
      if (j < 0) {
        for (int64_t g = 0; g < nh; ++g) s[g * K + n] = ninf;
        continue;
      }
      const float* k = load_row(p, false, b, p.key_row(b, j), kvh, D, row);
      fns.score_heads(qf, k, D, nh, K, p.scale, s + n);
      if (p.softcap > 0.0f)
        for (int64_t g = 0; g < nh; ++g)
          s[g * K + n] = p.softcap * std::tanh(s[g * K + n] / p.softcap);
    }
    std::fill(acc, acc + nh * Dv, 0.0f);
    float sums[8];
    for (int64_t g0 = 0; g0 < nh; g0 += 8) {
      const int64_t gn = std::min<int64_t>(8, nh - g0);
      float m[8];
      for (int64_t g = 0; g < gn; ++g) {
        m[g] = ninf;
        for (int64_t n = 0; n < idx.topk; ++n) m[g] = std::max(m[g], s[(g0 + g) * K + n]);
        sums[g] = 0.0f;
        for (int64_t n = 0; n < idx.topk; ++n) {
          float& e = s[(g0 + g) * K + n];
          e = m[g] == ninf ? 0.0f : std::exp(e - m[g]);
          sums[g] += e;
        }
        write_lse(p, b, i, h0 + g0 + g,
                  sums[g] > 0.0f
                      ? static_cast<double>(m[g]) + std::log(static_cast<double>(sums[g]))
                      : -std::numeric_limits<double>::infinity());
      }
      for (int64_t g = 0; g < gn; ++g) {
        // Normalise the weights now, so the output is the plain weighted sum.
        const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;
        for (int64_t n = 0; n < idx.topk; ++n) s[(g0 + g) * K + n] *= inv;
      }
    }
    // Values four keys at a time (each head's accumulator row is then
    // read and written once per four keys), the remainder one by one.
    const float* vrows[4];
    const float* wcols[4];
    int held = 0;
    for (int64_t n = 0; n < idx.topk; ++n) {
      const int32_t j = sel[n * idx.stride.col];
      if (j < 0) continue;
      vrows[held] = load_row(p, true, b, p.key_row(b, j), kvh, Dv, row + held * std::max(D, Dv));
      wcols[held] = s + n;
      if (++held == 4) {
        fns.accumulate_heads4(wcols, K, vrows, Dv, nh, acc);
        held = 0;
      }
    }
    for (int r = 0; r < held; ++r) fns.accumulate_heads(wcols[r], K, vrows[r], Dv, nh, acc);
    for (int64_t g = 0; g < nh; ++g) {
      float* o = out_ptr(p, b, i, h0 + g);
      for (int64_t c = 0; c < Dv; ++c) o[c * p.out_stride.dim] = acc[g * Dv + c];
    }
  });
  return Status::Ok();
}

}  // namespace attnkit::kernels
