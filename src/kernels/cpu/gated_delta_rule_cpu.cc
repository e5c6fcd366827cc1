#include "kernels/cpu/gated_delta_rule_cpu.h"

#include <algorithm>
#include <array>
#include <chrono>
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
// The chunked form's tiles use each target's own width (see its tiles).
typedef float V8 __attribute__((vector_size(32), aligned(4)));
typedef float V4 __attribute__((vector_size(16), aligned(4)));
template <class V>
inline constexpr int lanes = static_cast<int>(sizeof(V) / sizeof(float));
// Loads and stores of V at any alignment: as a template argument V loses
// the typedefs' aligned(4) (GCC drops attributes there), so a plain
// dereference would assume full alignment.
template <class V>
[[gnu::always_inline]] inline void ldv(V& v, const float* p) {
  __builtin_memcpy(&v, p, sizeof(V));
}
template <class V>
[[gnu::always_inline]] inline void stv(float* p, const V& v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

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
    const float* q = p.q + row * p.q_stride + kh * dk;
    const float* k = p.k + row * p.k_stride + kh * dk;
    const float* v = p.v + row * p.v_stride + h * dv + c0;
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

// ---- The chunked form ----
//
// Its products run on register tiles of R rows x NV vectors V of L = 16,
// 8 or 4 floats by target (tile_mma), written here rather than called in
// oneDNN: at 64 x 128 x 128 a library call's fixed cost (primitive lookup,
// memory descriptors) was a third of the time, and a tile can apply the
// steps around a product (decays, the triangular solve, the state update)
// while its sums are still in registers. Every operand the tiles read as B
// lives in this worker's scratch, padded to dvp = dv rounded up to 16
// columns with zeros, so that no tile needs a column tail; only the stores
// to `out` stop at dv.

// acc[r][u] += sum over k < depth of a[r * lda + k] * b[k * ldb + L u ..].
template <class V, int R, int NV>
ATTNKIT_GDR_INLINE void tile_mma(V (&acc)[R][NV], const float* a, int64_t lda, const float* b,
                                 int64_t ldb, int64_t depth) {
  for (int64_t k = 0; k < depth; ++k) {
    V bv[NV];
    for (int u = 0; u < NV; ++u) ldv(bv[u], b + k * ldb + u * lanes<V>);
    for (int r = 0; r < R; ++r) {
      const float ar = a[r * lda + k];
      for (int u = 0; u < NV; ++u) acc[r][u] += ar * bv[u];
    }
  }
}

// `width` floats of v at dst (all of them when width >= lanes<V>, none
// when <= 0).
template <class V>
ATTNKIT_GDR_INLINE void store(float* dst, const V& v, int64_t width) {
  if (width >= lanes<V>) {
    stv(dst, v);
    return;
  }
  for (int64_t j = 0; j < width; ++j) dst[j] = v[j];
}

// One product of the chunked form, C = keep * C + [row_scale *] (A1 B1) + A2 B2:
//   A1 [rows, depth1] (row stride lda1), B1 [depth1, 16 nvec] (ldb1)
//   A2 [rows, depth2] (lda2), B2 [depth2, 16 nvec] (ldb2); optional. With
//      lower_a2, row i reads columns j <= i of A2 only (lower triangular).
//   C  [rows, width] (ldc): written (or, with keep != 0, kept scaled by keep
//      and added to; then width must be 16 nvec, C being scratch).
struct Product {
  const float* a1 = nullptr;
  int64_t lda1 = 0;
  const float* b1 = nullptr;
  int64_t ldb1 = 0, depth1 = 0;
  const float* row_scale = nullptr;  // [rows] or none
  const float* a2 = nullptr;
  int64_t lda2 = 0;
  const float* b2 = nullptr;
  int64_t ldb2 = 0, depth2 = 0;
  bool lower_a2 = false;
  float* c = nullptr;
  int64_t ldc = 0, width = 0;
  float keep = 0.0f;
};

template <class V, int R, int NV>
ATTNKIT_GDR_INLINE void product_tile(const Product& p, int64_t i0, int64_t u0) {
  constexpr int L = lanes<V>;
  V acc[R][NV] = {};
  const int64_t c0 = u0 * L;
  tile_mma<V, R, NV>(acc, p.a1 + i0 * p.lda1, p.lda1, p.b1 + c0, p.ldb1, p.depth1);
  if (p.row_scale)
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < NV; ++u) acc[r][u] *= p.row_scale[i0 + r];
  if (p.a2 && !p.lower_a2)
    tile_mma<V, R, NV>(acc, p.a2 + i0 * p.lda2, p.lda2, p.b2 + c0, p.ldb2, p.depth2);
  if (p.a2 && p.lower_a2) {
    // Columns below the tile's first row in one pass; then the diagonal
    // block row by row, each row stopping at its own column, so that a row
    // never meets a later row of B (not even times 0: a later token's
    // non-finite values must not reach an earlier token's output).
    tile_mma<V, R, NV>(acc, p.a2 + i0 * p.lda2, p.lda2, p.b2 + c0, p.ldb2, std::min(p.depth2, i0));
    for (int s = 0; s < R && i0 + s < p.depth2; ++s) {
      V bs[NV];
      for (int u = 0; u < NV; ++u) ldv(bs[u], p.b2 + (i0 + s) * p.ldb2 + c0 + u * L);
      for (int r = s; r < R; ++r) {
        const float a = p.a2[(i0 + r) * p.lda2 + i0 + s];
        for (int u = 0; u < NV; ++u) acc[r][u] += a * bs[u];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) {
      float* c = p.c + (i0 + r) * p.ldc + c0 + L * u;
      if (p.keep != 0.0f) {
        V old;
        ldv(old, c);
        acc[r][u] += p.keep * old;
      }
      store<V>(c, acc[r][u], p.width - c0 - L * u);
    }
}

// The forward substitution U_i = rhs_i - sum_{j<i} L[i][j] U_j over rows
// [i0, i0 + R) of u ([rows, 16 nvec], row stride ldu, rhs in, U out) and
// column vectors [u0, u0 + NV): the rows above come in as one product
// (nl = -L, [rows, ldl], read below the diagonal only), the R rows of the
// tile then meet each other in registers.
template <class V, int R, int NV>
ATTNKIT_GDR_INLINE void solve_tile(const float* nl, int64_t ldl, float* u, int64_t ldu, int64_t i0,
                                   int64_t u0) {
  V acc[R][NV];
  float* ut = u + i0 * ldu + u0 * lanes<V>;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) ldv(acc[r][v], ut + r * ldu + v * lanes<V>);
  tile_mma<V, R, NV>(acc, nl + i0 * ldl, ldl, u + u0 * lanes<V>, ldu, i0);
  for (int r = 1; r < R; ++r)
    for (int s = 0; s < r; ++s) {
      const float l = nl[(i0 + r) * ldl + i0 + s];
      for (int v = 0; v < NV; ++v) acc[r][v] += l * acc[s][v];
    }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) stv(ut + r * ldu + v * lanes<V>, acc[r][v]);
}

// Runs tile T<R', NV'> over rows [0, rows) and column vectors [0, nvec):
// panels of NV vectors then single vectors; full tiles of R rows, then one
// of the rows left. Rows ascend within a panel (the solve needs it).
template <int R, int NV, class T>
ATTNKIT_GDR_INLINE void rows_left(const T& tile, int64_t left, int64_t i0, int64_t u0) {
  if constexpr (R > 0) {
    if (left == R)
      tile.template run<R, NV>(i0, u0);
    else
      rows_left<R - 1, NV>(tile, left, i0, u0);
  }
}

template <int R, int NV, class T>
ATTNKIT_GDR_INLINE void panel(const T& tile, int64_t rows, int64_t u0) {
  int64_t i0 = 0;
  for (; i0 + R <= rows; i0 += R) tile.template run<R, NV>(i0, u0);
  if (i0 < rows) rows_left<R - 1, NV>(tile, rows - i0, i0, u0);
}

template <int R, int NV, class T>
ATTNKIT_GDR_INLINE void for_tiles(const T& tile, int64_t rows, int64_t nvec) {
  int64_t u0 = 0;
  for (; u0 + NV <= nvec; u0 += NV) panel<R, NV>(tile, rows, u0);
  for (; u0 < nvec; ++u0) panel<R, 1>(tile, rows, u0);
}

template <class V>
struct ProductTiles {
  const Product& p;
  template <int R, int NV>
  ATTNKIT_GDR_INLINE void run(int64_t i0, int64_t u0) const {
    product_tile<V, R, NV>(p, i0, u0);
  }
};
template <class V>
struct SolveTiles {
  const float* nl;
  int64_t ldl;
  float* u;
  int64_t ldu;
  template <int R, int NV>
  ATTNKIT_GDR_INLINE void run(int64_t i0, int64_t u0) const {
    solve_tile<V, R, NV>(nl, ldl, u, ldu, i0, u0);
  }
};

// The chunked form's scratch, one worker's (one task: the groups of r value
// heads of `task_groups` key heads), carved from one float array; C =
// kGdrChunk.
struct ChunkScratch {
  float* s;   // [task_groups * r, dk, dvp]: the task's states
  float* qp;  // [C, dk]: the chunk's queries of one key head, packed
  float* kp;  // [C, dk]: its keys, packed
  float* kt;  // [dk, C]: the keys transposed (columns past n zero)
  float* kk;  // [C, C]: K K^T, shared by the group
  float* qk;  // [C, C]: Q K^T, shared by the group
  float* nl;  // [C, C]: -L = -(beta_i D[i][j] k_i.k_j), j < i
  float* am;  // [C, C]: D[i][j] q_i.k_j for j <= i (read below the diagonal only)
  float* u;   // [C, dvp]: K S0, then rhs, then U (the deltas), then D[n-1][j] U_j
};

int64_t padded(int64_t dv) { return (dv + 15) / 16 * 16; }

// A task's states stay in scratch from its first chunk to its last; this
// many bytes of them (4 key heads' groups at Qwen3-Next's shape: 512 KiB)
// stay in L2 beside the chunk's operands, and a task still reads its
// groups' q, k and v as runs of several KiB per token row.
constexpr int64_t kGdrTaskStateBytes = int64_t{512} << 10;

// Key heads per task of the chunked form: from the shape alone (never the
// thread count), at least 1, at most half of them, so that one sequence
// makes at least two tasks when it has two key heads.
int64_t task_groups(const GatedDeltaRuleParams& p) {
  const int64_t group_bytes = (p.num_v_heads / p.num_k_heads) * p.key_head_dim *
                              padded(p.value_head_dim) * int64_t{sizeof(float)};
  return std::clamp<int64_t>(kGdrTaskStateBytes / group_bytes, 1, (p.num_k_heads + 1) / 2);
}

size_t chunk_floats(const GatedDeltaRuleParams& p, ChunkScratch* s, float* base) {
  constexpr int64_t C = kGdrChunk;
  const int64_t dk = p.key_head_dim, dvp = padded(p.value_head_dim);
  const int64_t r = p.num_v_heads / p.num_k_heads;
  const int64_t sizes[] = {
      task_groups(p) * r * dk * dvp, C * dk, C * dk, dk * C, C * C, C * C, C * C, C * C, C * dvp};
  float** slots[] = {&s->s, &s->qp, &s->kp, &s->kt, &s->kk, &s->qk, &s->nl, &s->am, &s->u};
  size_t total = 0;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    // 16-float (64-byte) alignment for every block.
    if (base) *slots[i] = base + total;
    total += static_cast<size_t>((sizes[i] + 15) / 16 * 16);
  }
  return total;
}

// Every 64-byte line of floats [p, p + n) towards the caches; kWrite: for
// a store (the line arrives owned, so the store does not wait for it).
template <bool kWrite = false>
ATTNKIT_GDR_INLINE void prefetch_lines(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, kWrite);
  __builtin_prefetch(p + n - 1, kWrite);
}

// The chunked form's phase clocks: NoClock (the kernel: every mark compiles
// to nothing) and PhaseClock (gated_delta_rule_chunked_timed: the time
// since the previous mark is added to the phase just finished).
struct NoClock {
  ATTNKIT_GDR_INLINE void mark(GdrPhase) {}
};
struct PhaseClock {
  using Steady = std::chrono::steady_clock;
  Steady::time_point last = Steady::now();
  double* seconds;  // [kGdrNumPhases]
  void mark(GdrPhase phase) {
    const Steady::time_point now = Steady::now();
    seconds[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// Below f32's smallest normal a decay is written as 0: its terms are below
// 1e-38 of the others, and denormal operands would slow every product.
constexpr double kMinDecay = 1.1754943508222875e-38;

// One chunk of key head kh: n tokens, their rows from row0 (of the
// sequence's rows b * seq + t). `next_row0`, `next_kh`, `next_n`: the rows the task runs after
// this key head's (the next key head of the chunk, else the task's first
// of the next chunk; next_n = 0 after the last), prefetched meanwhile.
struct Chunk {
  int64_t kh, n, row0;
  int64_t next_row0, next_kh, next_n;
};

// Row i of the next key head's operands towards the caches, one kind per
// call (Prefetch), each from a different loop over the chunk's rows, so
// that the lines are asked for a few at a time between the products rather
// than all at once (which stalls the loop that asks once the line fill
// buffers are full): the rows lie a token's width apart (pages apart at
// Qwen3-Next's shape), which the hardware prefetchers do not follow.
enum class Prefetch { kQueryKeyGates, kValue, kOutput };
template <Prefetch kWhat>
ATTNKIT_GDR_INLINE void prefetch_next(const GatedDeltaRuleParams& p, const Chunk& c, int64_t hi,
                                      int64_t i) {
  if (i >= c.next_n) return;
  const int64_t H = p.num_v_heads, r = H / p.num_k_heads, kh = c.next_kh, h = kh * r + hi;
  const int64_t row = c.next_row0 + i, dk = p.key_head_dim, dv = p.value_head_dim;
  if constexpr (kWhat == Prefetch::kQueryKeyGates) {
    prefetch_lines(p.q + row * p.q_stride + kh * dk, dk);
    prefetch_lines(p.k + row * p.k_stride + kh * dk, dk);
    prefetch_lines(p.g + row * H + kh * r, r);
    prefetch_lines(p.beta + row * H + kh * r, r);
  } else if constexpr (kWhat == Prefetch::kValue) {
    prefetch_lines(p.v + row * p.v_stride + h * dv, dv);
  } else {
    prefetch_lines<true>(p.out + row * p.out_stride + h * dv, dv);
  }
}

// The chunk's queries and keys packed into s.qp and s.kp and the keys
// transposed into s.kt, then the key-only products, once for the key
// head's group of value heads: s.kk = K K^T, s.qk = Q K^T. The rows lie a
// token's width apart in q and k (pages apart at Qwen3-Next's shape): as
// the A operand of a product, 64 of them would share a few L1 sets and
// evict each other; packed, they are 32 KiB in a row.
template <class V, int R, int NV, class Clock>
ATTNKIT_GDR_INLINE void chunk_keys(const GatedDeltaRuleParams& p, const Chunk& c,
                                   const ChunkScratch& s, Clock& clock) {
  constexpr int64_t C = kGdrChunk;
  const int64_t dk = p.key_head_dim;
  const float* q0 = p.q + c.row0 * p.q_stride + c.kh * dk;
  const float* k0 = p.k + c.row0 * p.k_stride + c.kh * dk;
  for (int64_t j = 0; j < c.n; ++j) {
    const float* kj = k0 + j * p.k_stride;
    std::copy(q0 + j * p.q_stride, q0 + j * p.q_stride + dk, s.qp + j * dk);
    std::copy(kj, kj + dk, s.kp + j * dk);
    for (int64_t d = 0; d < dk; ++d) s.kt[d * C + j] = kj[d];
  }
  if (c.n < C)
    for (int64_t d = 0; d < dk; ++d) std::fill(s.kt + d * C + c.n, s.kt + (d + 1) * C, 0.0f);
  clock.mark(kGdrPhasePack);
  Product kk;
  kk.a1 = s.kp;
  kk.lda1 = dk;
  kk.b1 = s.kt;
  kk.ldb1 = C;
  kk.depth1 = dk;
  kk.c = s.kk;
  kk.ldc = kk.width = C;
  for_tiles<R, NV>(ProductTiles<V>{kk}, c.n, C / lanes<V>);
  Product qk = kk;
  qk.a1 = s.qp;
  qk.lda1 = dk;
  qk.c = s.qk;
  for_tiles<R, NV>(ProductTiles<V>{qk}, c.n, C / lanes<V>);
  clock.mark(kGdrPhaseKeyProducts);
}

// Value head h (the hi-th of its group) over the chunk: eg[i] = exp(G_i),
// s.nl = -L, s.am = D * Q K^T (lower-incl), drow = D[n-1][:].
//
// Decays as products of the per-token factors exp(g_t) <= 1 in double, row
// by row: D[i][j] = D[i-1][j] exp(g_i), D[i][i] = 1. Every partial product
// is <= 1, so nothing overflows however fast a head forgets, and an
// entry's relative error is at most ~n double roundings: as exact as the
// authors' log-space cumulative sums, with n exps per chunk instead of
// n^2. A row falls below kMinDecay from the left (its entries shrink as j
// moves away from i), so columns below `lo` are 0 from then on.
//
// The next key head's values of this value head's place go towards the
// caches here, a row per step (prefetch_next).
ATTNKIT_GDR_INLINE void chunk_decays(const GatedDeltaRuleParams& p, const Chunk& c, int64_t hi,
                                     const ChunkScratch& s, float* eg, double* drow) {
  constexpr int64_t C = kGdrChunk;
  const int64_t H = p.num_v_heads, r = H / p.num_k_heads, h = c.kh * r + hi;
  const float* g0 = p.g + c.row0 * H + h;
  const float* beta0 = p.beta + c.row0 * H + h;
  double acc = 1.0;
  int64_t lo = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    prefetch_next<Prefetch::kValue>(p, c, hi, i);
    const double decay = std::exp(static_cast<double>(g0[i * H]));
    acc = acc * decay < kMinDecay ? 0.0 : acc * decay;
    eg[i] = static_cast<float>(acc);
    for (int64_t j = lo; j < i; ++j) drow[j] *= decay;
    drow[i] = 1.0;
    while (lo < i && drow[lo] < kMinDecay) drow[lo++] = 0.0;
    const float bi = beta0[i * H];
    const float* kki = s.kk + i * C;
    const float* qki = s.qk + i * C;
    float* nli = s.nl + i * C;
    float* ami = s.am + i * C;
    for (int64_t j = 0; j < i; ++j) nli[j] = -bi * static_cast<float>(drow[j]) * kki[j];
    for (int64_t j = 0; j <= i; ++j) ami[j] = static_cast<float>(drow[j]) * qki[j];
  }
}

// Value head hi of the group over the chunk, from its state S ([dk, dvp],
// S0 in, the chunk's end out): the deltas U, the outputs O, the new S.
template <class V, int R, int NV, class Clock>
ATTNKIT_GDR_INLINE void chunk_value_head(const GatedDeltaRuleParams& p, const Chunk& c, int64_t hi,
                                         const ChunkScratch& s, float* S, const float* eg,
                                         const double* drow, Clock& clock) {
  constexpr int64_t C = kGdrChunk;
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim, dvp = padded(dv), nv = dvp / lanes<V>;
  const int64_t H = p.num_v_heads, h = c.kh * (H / p.num_k_heads) + hi;
  const float* beta0 = p.beta + c.row0 * H + h;
  // rhs = beta * (V - exp(G) * (K S0)), then U = (I + L)^-1 rhs.
  Product ks;
  ks.a1 = s.kp;
  ks.lda1 = dk;
  ks.b1 = S;
  ks.ldb1 = dvp;
  ks.depth1 = dk;
  ks.c = s.u;
  ks.ldc = ks.width = dvp;
  for_tiles<R, NV>(ProductTiles<V>{ks}, c.n, nv);
  const float* v0 = p.v + c.row0 * p.v_stride + h * dv;
  for (int64_t i = 0; i < c.n; ++i) {
    if (hi == 0) prefetch_next<Prefetch::kQueryKeyGates>(p, c, hi, i);
    const float bi = beta0[i * H], ei = eg[i];
    const float* vi = v0 + i * p.v_stride;
    float* ui = s.u + i * dvp;
    for (int64_t j = 0; j < dv; ++j) ui[j] = bi * (vi[j] - ei * ui[j]);
  }
  clock.mark(kGdrPhaseKS0);
  for_tiles<R, NV>(SolveTiles<V>{s.nl, C, s.u, dvp}, c.n, nv);
  clock.mark(kGdrPhaseSolve);

  // O = exp(G) * (Q S0) + lower-incl(D * Q K^T) U.
  Product o;
  o.a1 = s.qp;
  o.lda1 = dk;
  o.b1 = S;
  o.ldb1 = dvp;
  o.depth1 = dk;
  o.row_scale = eg;
  o.a2 = s.am;
  o.lda2 = C;
  o.b2 = s.u;
  o.ldb2 = dvp;
  o.depth2 = c.n;
  o.lower_a2 = true;
  o.c = p.out + c.row0 * p.out_stride + h * dv;
  o.ldc = p.out_stride;
  o.width = dv;
  for_tiles<R, NV>(ProductTiles<V>{o}, c.n, nv);
  clock.mark(kGdrPhaseOutput);

  // S = exp(G_n-1) S0 + K^T (D[n-1][:] * U).
  for (int64_t j = 0; j < c.n; ++j) {
    prefetch_next<Prefetch::kOutput>(p, c, hi, j);
    const float w = static_cast<float>(drow[j]);
    float* uj = s.u + j * dvp;
    for (int64_t col = 0; col < dvp; ++col) uj[col] *= w;
  }
  Product st;
  st.a1 = s.kt;
  st.lda1 = C;
  st.b1 = s.u;
  st.ldb1 = dvp;
  st.depth1 = c.n;
  st.c = S;
  st.ldc = st.width = dvp;
  st.keep = eg[c.n - 1];  // 0 (total forgetting) overwrites S0
  for_tiles<R, NV>(ProductTiles<V>{st}, dk, nv);
  clock.mark(kGdrPhaseState);
}

// Key heads [kh0, kh1) of sequence b and their value heads, chunk by
// chunk and, within a chunk, key head by key head (a chunk's rows are read
// while they are in the TLB and caches, as runs of the task's heads), their
// states in s.s (padded to dvp columns) meanwhile; R x NV the target's tile.
template <class V, int R, int NV, class Clock>
ATTNKIT_GDR_INLINE void chunked_task_impl(const GatedDeltaRuleParams& p, int64_t b, int64_t kh0,
                                          int64_t kh1, const ChunkScratch& s, Clock& clock) {
  constexpr int64_t C = kGdrChunk;
  const int64_t dk = p.key_head_dim, dv = p.value_head_dim, dvp = padded(dv);
  const int64_t H = p.num_v_heads, r = H / p.num_k_heads;
  // The task's states, [(kh1 - kh0) * r, dk, dv], one after another.
  float* const states = p.state + (b * H + kh0 * r) * dk * dv;
  for (int64_t d = 0; d < (kh1 - kh0) * r * dk; ++d) {
    std::copy(states + d * dv, states + (d + 1) * dv, s.s + d * dvp);
    std::fill(s.s + d * dvp + dv, s.s + (d + 1) * dvp, 0.0f);
  }
  std::array<double, C> drow;  // D[n-1][:] after chunk_decays
  std::array<float, C> eg;     // exp(G_i)
  for (int64_t c0 = 0; c0 < p.seq; c0 += C) {
    const int64_t row0 = b * p.seq + c0, n = std::min(C, p.seq - c0);
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const bool last = kh + 1 == kh1;
      const Chunk c{kh,
                    n,
                    row0,
                    last ? row0 + C : row0,
                    last ? kh0 : kh + 1,
                    last ? std::max<int64_t>(0, std::min(C, p.seq - c0 - C)) : n};
      chunk_keys<V, R, NV>(p, c, s, clock);
      for (int64_t hi = 0; hi < r; ++hi) {
        chunk_decays(p, c, hi, s, eg.data(), drow.data());
        clock.mark(kGdrPhaseDecays);
        chunk_value_head<V, R, NV>(p, c, hi, s, s.s + ((kh - kh0) * r + hi) * dk * dvp, eg.data(),
                                   drow.data(), clock);
      }
    }
  }
  for (int64_t d = 0; d < (kh1 - kh0) * r * dk; ++d)
    std::copy(s.s + d * dvp, s.s + d * dvp + dv, states + d * dv);
  clock.mark(kGdrPhasePack);
}

// Tiles: 8 rows x 2 zmm on AVX-512 (16 sums of its 32 registers; a panel
// of B 128 deep is then 16 KiB, so that the two threads of one core keep
// theirs in its 48 KiB L1 together, where 4 x 4 zmm tiles' 32 KiB panels
// did not); 6 x 2 ymm on AVX2 (12 of its 16 registers); 4 x 2 xmm on the
// baseline (8 of 16). Each target's own vector width: GCC keeps 64-byte
// vectors on AVX2 in memory, and a tile of them ran at a tenth of the
// AVX-512 tile's rate.
template <class Clock>
ATTNKIT_GDR_AVX512 void chunked_task_avx512(const GatedDeltaRuleParams& p, int64_t b, int64_t kh0,
                                            int64_t kh1, const ChunkScratch& s, Clock& clock) {
  chunked_task_impl<V16, 8, 2>(p, b, kh0, kh1, s, clock);
}
template <class Clock>
ATTNKIT_GDR_AVX2 void chunked_task_avx2(const GatedDeltaRuleParams& p, int64_t b, int64_t kh0,
                                        int64_t kh1, const ChunkScratch& s, Clock& clock) {
  chunked_task_impl<V8, 6, 2>(p, b, kh0, kh1, s, clock);
}
template <class Clock>
void chunked_task_scalar(const GatedDeltaRuleParams& p, int64_t b, int64_t kh0, int64_t kh1,
                         const ChunkScratch& s, Clock& clock) {
  chunked_task_impl<V4, 4, 2>(p, b, kh0, kh1, s, clock);
}

bool avx512(SimdTarget t) { return t == SimdTarget::kAvx512 || t == SimdTarget::kAvx512Bf16; }

}  // namespace

size_t gated_delta_rule_chunked_scratch(const GatedDeltaRuleParams& p) {
  ChunkScratch unused;
  return chunk_floats(p, &unused, nullptr);
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
  } ctx{p, task_fn, scratch, gated_delta_rule_chunked_scratch(p), per_task, tasks_per_seq};
  parallel_for(p.batch * tasks_per_seq, threads, [c = &ctx](int64_t task, int worker) {
    ChunkScratch s;
    chunk_floats(c->p, &s, c->scratch + static_cast<size_t>(worker) * c->per_worker);
    const int64_t kh0 = task % c->tasks_per_seq * c->per_task;
    NoClock clock;
    c->run(c->p, task / c->tasks_per_seq, kh0, std::min(kh0 + c->per_task, c->p.num_k_heads), s,
           clock);
  });
}

void gated_delta_rule_chunked_timed(const GatedDeltaRuleParams& p, SimdTarget target,
                                    float* scratch, double* seconds) {
  auto run = avx512(target)                ? chunked_task_avx512<PhaseClock>
             : target == SimdTarget::kAvx2 ? chunked_task_avx2<PhaseClock>
                                           : chunked_task_scalar<PhaseClock>;
  ChunkScratch s;
  chunk_floats(p, &s, scratch);
  std::fill_n(seconds, kGdrNumPhases, 0.0);
  const int64_t per_task = task_groups(p);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t kh0 = 0; kh0 < p.num_k_heads; kh0 += per_task) {
      PhaseClock clock{.seconds = seconds};
      run(p, b, kh0, std::min(kh0 + per_task, p.num_k_heads), s, clock);
    }
}

const char* gdr_phase_name(GdrPhase phase) {
  static constexpr const char* kNames[kGdrNumPhases] = {"pack (keys transposed, states in/out)",
                                                        "K K^T and Q K^T",
                                                        "decays (D, -L, D*QK^T)",
                                                        "K S0 and the right-hand side",
                                                        "triangular solve (U)",
                                                        "outputs (Q S0 + A U)",
                                                        "state update (K^T U)"};
  return kNames[phase];
}

}  // namespace attnkit::kernels::cpu
