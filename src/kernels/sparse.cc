// DeepSeek sparse attention kernels (kernels/sparse.h). The fast forms run
// the dense attention's microkernels (kernels/cpu/kernel_table.h, one table
// per SIMD target) on tiles of gathered rows.
//
// Indexer, fast forms. On the avx512bf16 target, with AMX and 128-feature
// rows (DeepSeek-V3.2's), kernels/indexer_amx.h: the fp8 codes of 16 keys
// at a time become bf16 by byte table lookups (kernels/cpu/fp8_bf16.h) and
// tdpbf16ps multiplies them with the query's codes, all heads per key read.
// Otherwise one query row's indexer heads are packed transposed (heads
// along the vector lanes, as the dense kernels pack a tile's query rows),
// and each tile of 64 consecutive keys is decoded once from its fp8
// codes and block scales into fp32 in registers (dequant_f32, an L1-sized
// buffer), then qk_f32 scores every head against it: each key value is
// broadcast against all heads at once. ReLU and the per-head weights then
// reduce each key's row of head scores. A decode step (one query row, or
// fewer rows than threads) splits its keys over the threads; prefill gives
// each thread whole rows.
//
// Top-k: the reference runs std::nth_element over the visible keys'
// indices under a total order (higher score first, equal scores by lower
// index), then sorts the chosen by index; the fast forms find the same set
// by a radix select on the scores' bits (select_topk_scores), O(visible)
// in two passes over the scores (in a decode step the first, a histogram,
// runs on the scoring threads as they go), its output in index order as
// it is found. The chosen set is a function of the scores alone.
//
// Sparse attention, fast form: a task is (batch item, query row, kv head,
// block of that group's query heads); the heads are the rows of one tile
// (all 128 of absorbed MLA's, in prefill), so each chosen key row is read
// once for all of them. The chosen rows are read where they lie
// (params.key_row(), pages included) and copied, widened to fp32 where the
// cache is not, 64 at a time into a scratch tile that stays in L2; on it
// run S = K Q^T, softcap, the online softmax and O += P V of the dense
// path. Values that are the keys' leading features (MLA's latent rows)
// come from the same tile. No copy of the whole selection is made.
#include "kernels/sparse.h"

#include "attnkit/sparse_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/fp8_bf16.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/task_plan.h"
#include "kernels/dispatch.h"
#include "kernels/indexer_amx.h"
#include "kernels/kv_load.h"
#include "kernels/scratch.h"
#include "kernels/topk_order.h"

namespace attnkit::kernels {
namespace {

namespace cpu = kernels::cpu;

// Keys per tile of both fast forms: the indexer's decoded tile (64 x 128
// fp32, 32 KiB) stays in L1; a sparse tile of MLA latent rows (64 x 576
// fp32, 144 KiB) in L2 beside its scores.
constexpr int64_t kTileKeys = 64;

int64_t align16(int64_t floats) { return cpu::round_up(floats, 16); }

// qt in the kernel tables' layout, [cols / w][d][w] for cols = m rounded up
// to w: qt[(x / w) * d * w + c * w + x % w] = value(x, c) for x < m, 0 past.
template <class Value>
void pack_transposed(int64_t m, int64_t d, int64_t w, Value value, float* qt) {
  const int64_t cols = cpu::round_up(m, w);
  for (int64_t x0 = 0; x0 < cols; x0 += w) {
    float* block = qt + x0 * d;
    for (int64_t c = 0; c < d; ++c)
      for (int64_t x = 0; x < w; ++x) block[c * w + x] = x0 + x < m ? value(x0 + x, c) : 0.0f;
  }
}

const cpu::KernelTable& active_kernels() { return *cpu::kernel_table(simd_target()); }

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

// One worker's scratch of the fast indexer, in floats from `base`.
struct IndexerScratch {
  float* qt;    // [round_up(H, w) / w][D][w]: query row, dequantized, transposed
  float* w;     // [H]: the row's head weights, contiguous
  float* keys;  // [kTileKeys][d_pad]: a tile of keys, decoded
  float* s;     // [kTileKeys][ss]: their scores per head
  int64_t d_pad, m_pad, ss;
  // AMX form (uses_amx): qt holds the query's codes as bf16 in AMX tiles
  // (indexer_amx_query_index), w the weights times q's scales, keys the
  // scratch of indexer_amx_scores.
  bool amx;
};

// AMX on the top SIMD target (ATTNKIT_SIMD=avx512 and below turn it off),
// for rows of one scale block (DeepSeek-V3.2's 128) with unit-stride codes.
bool uses_amx(const IndexerParams& p) {
  return simd_target() == SimdTarget::kAvx512Bf16 && p.head_dim == kAmxIndexerDim &&
         p.k_codes_stride.col == 1 && indexer_amx_available();
}

int64_t indexer_scratch_floats(const cpu::KernelTable& kt, int64_t H, int64_t D) {
  const int64_t m_pad = cpu::round_up(H, kt.lanes);
  return align16(cpu::round_up(H, kt.qk_block_cols) * D) + align16(H) +
         align16(kTileKeys * cpu::round_up(D, kt.lanes)) +
         align16(kTileKeys * cpu::odd_line_stride(m_pad));
}

// (The AMX form's buffers fit in the fp32 form's: its query takes
// round_up(H, 16) * 64 floats, its keys kTileKeys * 64, its scores
// kTileKeys * round_up(H, 16).)
IndexerScratch indexer_scratch(const cpu::KernelTable& kt, const IndexerParams& p, float* base) {
  const int64_t H = p.n_heads, D = p.head_dim;
  IndexerScratch x;
  x.d_pad = cpu::round_up(D, kt.lanes);
  x.m_pad = cpu::round_up(H, kt.lanes);
  x.ss = cpu::odd_line_stride(x.m_pad);
  x.qt = base;
  x.w = x.qt + align16(cpu::round_up(H, kt.qk_block_cols) * D);
  x.keys = x.w + align16(H);
  x.s = x.keys + align16(kTileKeys * x.d_pad);
  x.amx = uses_amx(p);
  return x;
}

// Query row (b, t) dequantized (in the AMX form: its codes) into x.qt and
// its weights into x.w.
void load_query(const cpu::KernelTable& kt, const IndexerParams& p, int64_t b, int64_t t,
                const IndexerScratch& x) {
  const float* lut = fp8_table();
  const uint8_t* qc = p.q_codes + b * p.q_codes_stride.batch + t * p.q_codes_stride.row;
  const float* qs = p.q_scales + b * p.q_scales_stride.batch + t * p.q_scales_stride.row;
  if (x.amx) {
    // Written in the layout's order (indexer_amx_query_index(h, at) for
    // head blocks, steps of 32 features, feature pairs, heads, pair
    // halves), each value one lookup: 8,192 of them at DeepSeek-V3.2's
    // shape, on the calling thread before the scoring threads start.
    static const auto bf16_of = [] {
      std::vector<uint16_t> table(256);
      for (int c = 0; c < 256; ++c)
        table[static_cast<size_t>(c)] =
            float_to_bf16(fp8_e4m3_to_float(static_cast<uint8_t>(c))).bits;
      return table;
    }();
    const int64_t H = p.n_heads, Hp = cpu::round_up(H, 16);
    const int64_t sh = p.q_codes_stride.head, sd = p.q_codes_stride.dim;
    uint16_t* q = reinterpret_cast<uint16_t*>(x.qt);
    for (int64_t h0 = 0; h0 < Hp; h0 += 16)
      for (int64_t at = 0; at < kAmxIndexerDim; at += 2) {
        // The keys' decoded order: features c0 and c1 of this pair.
        const int64_t c0 = cpu::fp8_bf16_feature(at) * sd, c1 = cpu::fp8_bf16_feature(at + 1) * sd;
        for (int64_t h = h0; h < h0 + 16; ++h, q += 2) {
          q[0] = h < H ? bf16_of[qc[h * sh + c0]] : uint16_t{0};
          q[1] = h < H ? bf16_of[qc[h * sh + c1]] : uint16_t{0};
        }
      }
    const float* w = p.weights + b * p.weights_stride.batch + t * p.weights_stride.row;
    for (int64_t h = 0; h < Hp; ++h)
      x.w[h] = h < H ? w[h * p.weights_stride.col] * qs[h * p.q_scales_stride.head] : 0.0f;
    return;
  }
  pack_transposed(
      p.n_heads, p.head_dim, kt.qk_block_cols,
      [&](int64_t h, int64_t c) {
        return lut[qc[h * p.q_codes_stride.head + c * p.q_codes_stride.dim]] *
               qs[h * p.q_scales_stride.head + (c / kIndexerBlock) * p.q_scales_stride.dim];
      },
      x.qt);
  const float* w = p.weights + b * p.weights_stride.batch + t * p.weights_stride.row;
  for (int64_t h = 0; h < p.n_heads; ++h) x.w[h] = w[h * p.weights_stride.col];
}

// True when n contiguous codes hold one of E4M3's NaN codes (0x7f, 0xff).
// The tables' decoders move the bits into binary16, which reads them as
// 480; the reference's score of such a key is NaN, hence -inf. Byte
// arithmetic that vectorizes: (code & 0x7f) + 1 has bit 7 set only for NaN.
bool has_nan_code(const uint8_t* codes, int64_t n) {
  uint8_t any = 0;
  for (int64_t c = 0; c < n; ++c) any |= static_cast<uint8_t>((codes[c] & 0x7f) + 1);
  return (any & 0x80) != 0;
}

// True when the `blocks` scales of each of n rows (row_stride and
// col_stride apart) are finite and > 0: bits - 1 < 0x7f7fffff as unsigned,
// without a branch per scale.
bool scales_positive(const float* ks, int64_t row_stride, int64_t col_stride, int64_t n,
                     int64_t blocks) {
  uint32_t bad = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < blocks; ++c) {
      uint32_t bits;
      std::memcpy(&bits, ks + r * row_stride + c * col_stride, sizeof bits);
      bad |= static_cast<uint32_t>(bits - 1u >= 0x7f7fffffu);
    }
  return bad == 0;
}

// Every key scale of p finite and > 0.
bool all_scales_positive(const IndexerParams& p) {
  for (int64_t b = 0; b < p.batch; ++b)
    if (!scales_positive(p.k_scales + b * p.k_scales_stride.batch, p.k_scales_stride.row,
                         p.k_scales_stride.col, p.seqlen_k, p.head_dim / kIndexerBlock))
      return false;
  return true;
}

// Scores of keys [s0, s1) for the query row in x, into score[s].
// With hist (kTopkHistogram counts), each stretch of scores is added to
// it while it is still in L1. Returns false when p.k_scales_bad is set and
// a scale of those keys is not finite and > 0.
bool indexer_scores_fast(const cpu::KernelTable& kt, const IndexerParams& p, int64_t b,
                         const IndexerScratch& x, int64_t s0, int64_t s1, float* score,
                         uint32_t* hist) {
  const int64_t H = p.n_heads, D = p.head_dim;
  // The table's decoder wants unit-stride codes and, past one block, unit-
  // stride scales; other views take the portable loop.
  const bool dequant =
      p.k_codes_stride.col == 1 && (D == kIndexerBlock || p.k_scales_stride.col == 1);
  const float* lut = fp8_table();
  bool scales_ok = true;
  if (x.amx) {
    // 2,048 keys a call (a call pipelines its 16-key groups). The call
    // counts each score in the histogram as it writes it, and checks the
    // scales it applies whether asked to or not (a compare per 16 keys).
    for (int64_t n0 = s0; n0 < s1; n0 += 2048) {
      const int64_t n = std::min<int64_t>(2048, s1 - n0);
      scales_ok &= indexer_amx_scores(
          p.k_codes + b * p.k_codes_stride.batch + n0 * p.k_codes_stride.row, p.k_codes_stride.row,
          n, reinterpret_cast<const uint16_t*>(x.qt), H, x.w,
          p.k_scales + b * p.k_scales_stride.batch + n0 * p.k_scales_stride.row,
          p.k_scales_stride.row, reinterpret_cast<uint16_t*>(x.keys), x.s, score + n0, hist);
    }
    return scales_ok || p.k_scales_bad == nullptr;
  }
  for (int64_t n0 = s0; n0 < s1; n0 += kTileKeys) {
    const int64_t n = std::min(kTileKeys, s1 - n0);
    const uint8_t* kc = p.k_codes + b * p.k_codes_stride.batch + n0 * p.k_codes_stride.row;
    const float* ks = p.k_scales + b * p.k_scales_stride.batch + n0 * p.k_scales_stride.row;
    if (p.k_scales_bad != nullptr)
      scales_ok &=
          scales_positive(ks, p.k_scales_stride.row, p.k_scales_stride.col, n, D / kIndexerBlock);
    if (dequant) {
      kt.dequant_f32(kc, p.k_codes_stride.row, n, D, ks, p.k_scales_stride.row, kIndexerBlock, true,
                     x.keys, x.d_pad, 0);
    } else {
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < D; ++c)
          x.keys[r * x.d_pad + c] =
              lut[kc[r * p.k_codes_stride.row + c * p.k_codes_stride.col]] *
              ks[r * p.k_scales_stride.row + (c / kIndexerBlock) * p.k_scales_stride.col];
    }
    kt.qk_f32(x.keys, x.d_pad, n, D, x.qt, x.m_pad, x.s, x.ss, 0, nullptr);
    for (int64_t r = 0; r < n; ++r) {
      // sum_h w[h] ReLU(s[r][h]) over 8 independent lanes, so that it
      // vectorizes without reassociating a sum.
      const float* row = x.s + r * x.ss;
      float lanes[8] = {};
      int64_t h = 0;
      for (; h + 8 <= H; h += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += x.w[h + l] * std::max(row[h + l], 0.0f);
      float total = 0.0f;
      for (; h < H; ++h) total += x.w[h] * std::max(row[h], 0.0f);
      for (int l = 0; l < 8; ++l) total += lanes[l];
      score[n0 + r] = dequant && has_nan_code(kc + r * p.k_codes_stride.row, D)
                          ? -std::numeric_limits<float>::infinity()
                          : finite_or_lowest(total);
    }
    if (hist != nullptr) add_topk_histogram(score + n0, n, hist);
  }
  return scales_ok;
}

}  // namespace

namespace {

// The select's passes over every score run on stretches of them that
// depend on `visible` and the SIMD target alone, at most 64: each
// stretch compacts its candidates into its own part of the scratch,
// starting at the stretch's first index, so no stretch waits for another's
// count, and reading the parts in stretch order reads the candidates in
// index order, as one pass over all the scores would. A stretch is long
// enough that handing it to another thread pays: the scalar pass takes ~1
// ns a score, the AVX-512 one ~0.25 ns, a hand-off to a worker that still
// polls after the scoring region a few us (at 131,072 scores, 2 threads,
// four 32K-score stretches took the select from ~124 to ~90 us; before the
// pool's workers polled, 16K-score stretches took it from 35 to 62 us).
constexpr int64_t kMaxStretches = 64;
int64_t stretch_length(int64_t visible, bool vector) {
  return cpu::round_up(
      std::max<int64_t>(vector ? 32768 : 16384, cpu::ceil_div(visible, kMaxStretches)), 64);
}

// Candidates past this many after the first digit are cut down to the
// second digit's bin or above by one more pass on the stretches, before
// the serial rest (two passes over what is left). Scores of one magnitude
// fill few of the first digit's bins (a quarter of a binade each): then
// most scores are candidates.
constexpr int64_t kSerialCandidates = 16384;

// Scores of one magnitude share a few bins, and increments of one counter
// wait on each other through memory: four histograms, summed at the end.
void add_topk_histogram_scalar(const float* score, int64_t n, uint32_t* hist) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++hist[order_key(score[i]) >> 21];
    ++hist[2048 + (order_key(score[i + 1]) >> 21)];
    ++hist[4096 + (order_key(score[i + 2]) >> 21)];
    ++hist[6144 + (order_key(score[i + 3]) >> 21)];
  }
  for (; i < n; ++i) ++hist[order_key(score[i]) >> 21];
}

// Of i in [i0, i1): those with order_key(score[i]) >= lo, in index order,
// their indices to idx[0 ..) and keys to keys[0 ..); returns how many.
// Writes nothing at or past idx[i1 - i0], keys[i1 - i0].
int64_t compact_keys(const float* score, int64_t i0, int64_t i1, uint32_t lo, int32_t* idx,
                     uint32_t* keys) {
  int64_t c = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const uint32_t key = order_key(score[i]);
    idx[c] = static_cast<int32_t>(i);
    keys[c] = key;
    c += key >= lo;
  }
  return c;
}

#if defined(__x86_64__) || defined(_M_X64)
#define ATTNKIT_TOPK_AVX512 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's own AVX-512 headers trip -W(maybe-)uninitialized (GCC bug
// 105593: the `__m512 __Y = __Y;` idiom behind _mm512_undefined_ps).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define ATTNKIT_TOPK_AVX512_TARGET __attribute__((target("avx512f,popcnt")))

// compact_keys, 16 scores at a time: order_key in lanes and a compress of
// the kept lanes (the scalar loop's every score waits on the previous
// one's count).
ATTNKIT_TOPK_AVX512_TARGET int64_t compact_keys_avx512(const float* score, int64_t i0, int64_t i1,
                                                       uint32_t lo, int32_t* idx, uint32_t* keys) {
  const __m512i low = _mm512_set1_epi32(static_cast<int32_t>(lo)), step = _mm512_set1_epi32(16);
  __m512i at =
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i0)),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  int64_t c = 0, i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512i key = order_keys16(_mm512_loadu_ps(score + i));
    const __mmask16 keep = _mm512_cmpge_epu32_mask(key, low);
    // A full store of the compressed lanes: c <= i - i0, so it ends at or
    // before idx[i + 16 - i0], inside the stretch's part.
    _mm512_storeu_si512(idx + c, _mm512_maskz_compress_epi32(keep, at));
    _mm512_storeu_si512(keys + c, _mm512_maskz_compress_epi32(keep, key));
    c += __builtin_popcount(keep);
    at = _mm512_add_epi32(at, step);
  }
  if (i < i1) {
    const __mmask16 live = static_cast<__mmask16>((1u << (i1 - i)) - 1u);
    const __m512i key = order_keys16(_mm512_maskz_loadu_ps(live, score + i));
    const __mmask16 keep = _mm512_mask_cmpge_epu32_mask(live, key, low);
    _mm512_mask_compressstoreu_epi32(idx + c, keep, at);
    _mm512_mask_compressstoreu_epi32(keys + c, keep, key);
    c += __builtin_popcount(keep);
  }
  return c;
}

// add_topk_histogram_scalar with the keys' first digits made 16 at a time
// (the increments stay scalar; the digits' arithmetic was most of the
// loop).
ATTNKIT_TOPK_AVX512_TARGET void add_topk_histogram_avx512(const float* score, int64_t n,
                                                          uint32_t* hist) {
  alignas(64) uint32_t bin[16];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_store_si512(bin, _mm512_srli_epi32(order_keys16(_mm512_loadu_ps(score + i)), 21));
    for (int l = 0; l < 16; l += 4) {
      ++hist[bin[l]];
      ++hist[2048 + bin[l + 1]];
      ++hist[4096 + bin[l + 2]];
      ++hist[6144 + bin[l + 3]];
    }
  }
  add_topk_histogram_scalar(score + i, n - i, hist);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

bool avx512_select() {
#if defined(ATTNKIT_TOPK_AVX512)
  return simd_target() >= SimdTarget::kAvx512;
#else
  return false;
#endif
}

}  // namespace

void add_topk_histogram(const float* score, int64_t n, uint32_t* hist) {
#if defined(ATTNKIT_TOPK_AVX512)
  if (avx512_select()) return add_topk_histogram_avx512(score, n, hist);
#endif
  add_topk_histogram_scalar(score, n, hist);
}

void select_topk_scores(const float* score, int64_t visible, int64_t topk, const uint32_t* given,
                        int64_t sets, int num_threads, uint32_t* worker_hist, int32_t* scratch,
                        int32_t* out, int64_t out_stride) {
  const int64_t k = std::min(topk, visible);
  for (int64_t n = k; n < topk; ++n) out[n * out_stride] = -1;
  if (k == visible) {
    for (int64_t n = 0; n < k; ++n) out[n * out_stride] = static_cast<int32_t>(n);
    return;
  }
  if (k <= 0) return;
  const bool vector = avx512_select();
  const int64_t stretch = stretch_length(visible, vector);
  const int64_t stretches = cpu::ceil_div(visible, stretch);
  const int threads = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), stretches));
  // Digits of the key, most significant first: bits 21-31, 10-20, 0-9.
  // First digit: a histogram over every score, made here or given.
  uint32_t own[kTopkHistogram];  // zeroed only when used (a decode step gives its own)
  if (given == nullptr) {
    std::fill(own, own + kTopkHistogram, 0u);
    add_topk_histogram(score, visible, own);
    given = own;
    sets = 1;
  }
  uint32_t bins[2048] = {};
  for (int64_t set = 0; set < 4 * sets; ++set)
    for (int b = 0; b < 2048; ++b) bins[b] += given[set * 2048 + b];
  // The k-th key's digit: from the top, the first bin whose count reaches
  // what is still needed (`need`: how many of the keys that share the
  // digits found so far, `prefix`, are chosen).
  int64_t need = k;
  const auto find_bin = [&need](const uint32_t* h, uint32_t top) {
    uint32_t bin = top;
    for (; need > h[bin]; --bin) need -= h[bin];
    return bin;
  };
  const uint32_t first = find_bin(bins, 2047);
  uint32_t prefix = first << 21;
  // One pass keeps the keys of that first digit or above, with their
  // indices: every chosen key is among them. Each stretch then adds the
  // next digit of its candidates in the first digit's bin to its worker's
  // histogram while they are in L1. The rest reads the candidates alone
  // (typically not many more than k).
  int32_t* const idx = scratch;
  uint32_t* const keys = reinterpret_cast<uint32_t*>(scratch + visible);
#if defined(ATTNKIT_TOPK_AVX512)
  const auto compact = vector ? compact_keys_avx512 : compact_keys;
#else
  const auto compact = compact_keys;
#endif
  int64_t count[kMaxStretches];
  std::fill(worker_hist, worker_hist + threads * kTopkWorkerHistogram, 0u);
  parallel_for(stretches, threads, [&](int64_t part, int worker) {
    const int64_t i0 = part * stretch, i1 = std::min(visible, i0 + stretch);
    const int64_t c = compact(score, i0, i1, prefix, idx + i0, keys + i0);
    uint32_t* h = worker_hist + worker * kTopkWorkerHistogram;
    for (int64_t j = i0; j < i0 + c; ++j)
      if ((keys[j] >> 21) == first) ++h[(keys[j] >> 10) & 2047];
    count[part] = c;
  });
  std::fill(bins, bins + 2048, 0u);
  for (int w = 0; w < threads; ++w)
    for (int b = 0; b < 2048; ++b) bins[b] += worker_hist[w * kTopkWorkerHistogram + b];
  prefix |= find_bin(bins, 2047) << 10;
  int64_t total = 0;
  for (int64_t part = 0; part < stretches; ++part) total += count[part];
  if (total > kSerialCandidates) {
    // Each stretch keeps the candidates of the second digit's bin or above
    // (in place: what it keeps moves down, never past what it reads).
    parallel_for(stretches, threads, [&](int64_t part, int) {
      const int64_t i0 = part * stretch;
      int64_t c = 0;
      for (int64_t j = i0; j < i0 + count[part]; ++j) {
        idx[i0 + c] = idx[j];
        keys[i0 + c] = keys[j];
        c += keys[j] >= prefix;
      }
      count[part] = c;
    });
  }
  // The last digit, over the candidates that share the first two.
  std::fill(bins, bins + 1024, 0u);
  for (int64_t part = 0; part < stretches; ++part)
    for (int64_t j = part * stretch; j < part * stretch + count[part]; ++j)
      if ((keys[j] & 0xfffffc00u) == prefix) ++bins[keys[j] & 1023];
  prefix |= find_bin(bins, 1023);
  // prefix is the k-th key: every key above it is chosen, and of those
  // equal to it the `need` lowest indices (the parts in order are the
  // candidates in index order).
  int64_t n = 0, equal = 0;
  for (int64_t part = 0; part < stretches && n < k; ++part)
    for (int64_t j = part * stretch; j < part * stretch + count[part] && n < k; ++j)
      if (keys[j] > prefix || (keys[j] == prefix && equal++ < need))
        out[(n++) * out_stride] = idx[j];
}

namespace {

// hist, sets, threads, worker_hist: as select_topk_scores takes them.
void finish_row_fast(const IndexerParams& p, int64_t b, int64_t t, const float* score,
                     const uint32_t* hist, int64_t sets, int threads, uint32_t* worker_hist,
                     int32_t* order) {
  const int64_t S = p.seqlen_k, visible = S - p.seqlen_q + t + 1;
  if (p.scores) {
    float* row = p.scores + b * p.scores_stride.batch + t * p.scores_stride.row;
    for (int64_t s = 0; s < S; ++s)
      row[s * p.scores_stride.col] =
          s < visible ? score[s] : -std::numeric_limits<float>::infinity();
  }
  select_topk_scores(score, visible, p.topk, hist, sets, threads, worker_hist, order,
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
  const bool reference = resolve_backend(backend) == Backend::kReference;
  // One query row on the fast backend checks its key scales as it scores
  // (below); every other call first, before it writes anything.
  const bool check_first = p.k_scales_bad != nullptr && (reference || rows > 1);
  if (check_first && !all_scales_positive(p)) {
    *p.k_scales_bad = true;
    return Status::Ok();
  }
  if (reference) {
    std::unique_ptr<double[]> score;
    std::unique_ptr<int32_t[]> order;
    if (!alloc(&score, S) || !alloc(&order, S)) return no_memory("the reference's scores");
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t t = 0; t < p.seqlen_q; ++t) indexer_row_ref(p, b, t, score.get(), order.get());
    return Status::Ok();
  }
  const cpu::KernelTable& kt = active_kernels();
  const int64_t per = indexer_scratch_floats(kt, H, D);
  // Kept per calling thread from call to call (kernels/scratch.h): a
  // decode step over 128K keys needs 1 MB of scores and indices, which
  // fresh allocations would map and fault in at every step. The workers
  // use the calling thread's buffers through the pointers taken here (in
  // their code the thread_local names would mean their own, empty ones).
  thread_local Scratch<float> kept_fbuf, kept_score;
  thread_local Scratch<int32_t> kept_order;
  thread_local Scratch<uint32_t> kept_hist;
  if (!kept_fbuf.grow(static_cast<size_t>(per * threads + 16)) ||
      !kept_score.grow(static_cast<size_t>(S * threads)) ||
      !kept_order.grow(static_cast<size_t>(2 * S * threads)) ||
      !kept_hist.grow(static_cast<size_t>((kTopkHistogram + kTopkWorkerHistogram) * threads)))
    return no_memory("the indexer's scratch");
  float* const fbuf = kept_fbuf.get();
  float* const score = kept_score.get();
  int32_t* const order = kept_order.get();
  uint32_t* const hist = kept_hist.get();  // [threads][kTopkHistogram]: the scoring's
  uint32_t* const worker_hist = hist + kTopkHistogram * threads;  // [threads][2048]: the select's
  const auto slot = [&](int w) {
    // On a 64-byte line: every buffer in it starts a multiple of 16 floats
    // in, so none of its vector and tile rows straddles two lines (a 16-
    // byte-aligned base cost the AMX form up to 70 % more time).
    float* base = fbuf + (16 - reinterpret_cast<uintptr_t>(fbuf) / 4 % 16) % 16;
    return indexer_scratch(kt, p, base + static_cast<int64_t>(w) * per);
  };
  if (rows >= threads && rows > 1) {
    // Prefill (or a batch of decodes): whole rows per task, longest first.
    parallel_for(rows, threads, [&](int64_t task, int worker) {
      const int64_t r = rows - 1 - task, b = r / p.seqlen_q, t = r % p.seqlen_q;
      const IndexerScratch x = slot(worker);
      float* sc = score + static_cast<int64_t>(worker) * S;
      load_query(kt, p, b, t, x);
      indexer_scores_fast(kt, p, b, x, 0, S - p.seqlen_q + t + 1, sc, nullptr);
      finish_row_fast(p, b, t, sc, nullptr, 0, 1, worker_hist + kTopkWorkerHistogram * worker,
                      order + static_cast<int64_t>(worker) * 2 * S);
    });
    return Status::Ok();
  }
  // Fewer rows than threads, or one (a decode step): split each row's keys,
  // in whole tiles; each worker adds the scores it computes to its own
  // histogram for the top-k. Up to 64 tasks, whatever the thread count, of
  // at least one AMX call's 2,048 keys (~30 us) or four fp32 tiles: a
  // worker that starts late or is preempted then leaves at most one small
  // task to the end (8 tasks of 16,384 keys, 0.25 ms each on 2 threads,
  // left up to that much).
  const int64_t min_chunk = uses_amx(p) ? 2048 : 4 * kTileKeys;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / p.seqlen_q, t = r % p.seqlen_q, visible = S - p.seqlen_q + t + 1;
    const IndexerScratch first = slot(0);
    load_query(kt, p, b, t, first);
    const int64_t chunk = cpu::round_up(std::max(min_chunk, cpu::ceil_div(visible, 64)), kTileKeys);
    const int64_t tasks = cpu::ceil_div(visible, chunk);
    std::fill(hist, hist + kTopkHistogram * threads, 0u);
    std::atomic<bool> bad_scale{false};
    parallel_for(tasks, threads, [&](int64_t task, int worker) {
      IndexerScratch own = slot(worker);
      own.qt = first.qt;  // the row's query and weights, shared read-only
      own.w = first.w;
      const int64_t s0 = task * chunk, s1 = std::min(visible, s0 + chunk);
      if (!indexer_scores_fast(kt, p, b, own, s0, s1, score, hist + kTopkHistogram * worker))
        bad_scale.store(true, std::memory_order_relaxed);
    });
    // Checked on the scoring threads (rows == 1 here: its visible keys are
    // all of them); no output written yet.
    if (bad_scale.load(std::memory_order_relaxed)) {
      *p.k_scales_bad = true;
      return Status::Ok();
    }
    finish_row_fast(p, b, t, score, hist, threads, threads, worker_hist, order);
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

// Row r of k (value = false) or v, kv head kvh, first n channels, as fp32
// into dst: copied, widened or decoded once for all the heads of a tile.
void load_row(const cpu::KernelTable& kt, const AttentionParams& p, bool value, int64_t b,
              int64_t r, int64_t kvh, int64_t n, float* dst) {
  const Strides4& st = value ? p.v_stride : p.k_stride;
  const int64_t base = b * st.batch + r * st.row + kvh * st.head;
  if (st.dim == 1 && p.kv_dtype == DType::kF32) {
    const float* src = static_cast<const float*>(value ? p.v : p.k) + base;
    std::copy(src, src + n, dst);
  } else if (st.dim == 1 && p.kv_dtype == DType::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(value ? p.v : p.k) + base;
    kt.widen_bf16(src, 0, 1, n, dst, cpu::round_up(n, kt.lanes), 0);
  } else {
    for (int64_t c = 0; c < n; ++c)
      dst[c] = static_cast<float>(kv_element(p, value, base + c * st.dim, b, r, kvh, c));
  }
}

// Values that are the first head_dim_v features of the key rows (MLA's
// absorbed form: value = the latent, key = latent + rope) come from the
// key tile. 8-bit caches, whose value scales lie apart, load both.
bool values_in_keys(const AttentionParams& p) {
  return (p.kv_dtype == DType::kF32 || p.kv_dtype == DType::kBF16) && p.v == p.k &&
         p.head_dim_v <= p.head_dim && p.v_stride.batch == p.k_stride.batch &&
         p.v_stride.row == p.k_stride.row && p.v_stride.head == p.k_stride.head &&
         p.v_stride.dim == p.k_stride.dim;
}

// One worker's scratch of the fast sparse attention, for tasks of at most
// hc heads.
struct SparseScratch {
  float* qt;       // [round_up(hc, w) / w][D][w]: the heads' queries, scaled, transposed
  float* keys;     // [kTileKeys][d_pad]: a tile of chosen key rows
  float* values;   // [kTileKeys][dv_pad]: their value rows (= keys when values_in_keys)
  float* s;        // [kTileKeys][ss]: scores, then weights
  float* o;        // [hc][dv_pad]: unnormalised outputs
  float* row_max;  // [m_pad]
  float* row_sum;  // [m_pad]
  float* alpha;    // [m_pad]
  int64_t d_pad, dv_pad, m_pad, ss, v_stride;
};

// The layout from `base` (nullptr: only the size), its size in *floats.
SparseScratch sparse_scratch(const cpu::KernelTable& kt, const AttentionParams& p, int64_t hc,
                             bool shared_v, float* base, int64_t* floats) {
  SparseScratch x;
  x.d_pad = cpu::round_up(p.head_dim, kt.lanes);
  x.dv_pad = cpu::round_up(p.head_dim_v, kt.lanes);
  x.m_pad = cpu::round_up(hc, kt.lanes);
  x.ss = cpu::odd_line_stride(x.m_pad);
  x.v_stride = shared_v ? x.d_pad : x.dv_pad;
  int64_t at = 0;
  const auto take = [&](int64_t n) {
    float* start = base == nullptr ? nullptr : base + at;
    at += align16(n);
    return start;
  };
  x.qt = take(cpu::round_up(hc, kt.qk_block_cols) * p.head_dim);
  x.keys = take(kTileKeys * x.d_pad);
  x.values = shared_v ? x.keys : take(kTileKeys * x.dv_pad);
  x.s = take(kTileKeys * x.ss);
  x.o = take(hc * x.dv_pad);
  x.row_max = take(x.m_pad);
  x.row_sum = take(x.m_pad);
  x.alpha = take(x.m_pad);
  *floats = at;
  return x;
}

}  // namespace

Status run_sparse_attention(const AttentionParams& p, const KeyIndices& idx, Backend backend) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return Status::Ok();
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  if (resolve_backend(backend) == Backend::kReference) {
    std::unique_ptr<double[]> s, acc;
    if (!alloc(&s, std::max<int64_t>(idx.topk, 1)) || !alloc(&acc, Dv))
      return no_memory("the reference's scores");
    sparse_ref(p, idx, s.get(), acc.get());
    return Status::Ok();
  }
  const cpu::KernelTable& kt = active_kernels();
  const int threads = resolve_num_threads(p.num_threads);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t units = p.batch * p.seqlen_q * p.num_kv_heads;
  // All of a group's heads in one task, unless there are fewer units than
  // threads (a decode step of absorbed MLA: one kv head, 128 heads): then
  // the heads split into one block per thread, whole vectors each. Every
  // block reads all the chosen rows, so no more blocks than that.
  const int64_t blocks =
      std::clamp<int64_t>(cpu::ceil_div(threads, units), 1, cpu::ceil_div(group, kt.lanes));
  const int64_t hc = cpu::round_up(cpu::ceil_div(group, blocks), kt.lanes);
  const int64_t chunks = cpu::ceil_div(group, hc);
  const bool shared_v = values_in_keys(p);
  int64_t per = 0;
  sparse_scratch(kt, p, hc, shared_v, nullptr, &per);
  std::unique_ptr<float[]> buf;
  if (!alloc(&buf, per * threads)) return no_memory("the sparse attention's scratch");
  const float ninf = -std::numeric_limits<float>::infinity();
  parallel_for(units * chunks, threads, [&](int64_t task, int worker) {
    const int64_t chunk = task % chunks, u = task / chunks;
    const int64_t kvh = u % p.num_kv_heads, bi = u / p.num_kv_heads;
    const int64_t b = bi / p.seqlen_q, i = bi % p.seqlen_q;
    if (i >= p.rows_of(b)) return;
    const int64_t h0 = kvh * group + chunk * hc, nh = std::min(hc, (kvh + 1) * group - h0);
    int64_t unused = 0;
    const SparseScratch x = sparse_scratch(kt, p, hc, shared_v,
                                           buf.get() + static_cast<int64_t>(worker) * per, &unused);
    const int64_t m_pad = cpu::round_up(nh, kt.lanes);
    pack_transposed(
        nh, D, kt.qk_block_cols,
        [&](int64_t g, int64_t c) { return q_ptr(p, b, i, h0 + g)[c * p.q_stride.dim] * p.scale; },
        x.qt);
    std::fill(x.o, x.o + nh * x.dv_pad, 0.0f);
    std::fill(x.row_max, x.row_max + m_pad, ninf);
    std::fill(x.row_sum, x.row_sum + m_pad, 0.0f);
    const int32_t* sel = idx.data + b * idx.stride.batch + i * idx.stride.row;
    for (int64_t n = 0; n < idx.topk;) {
      // The next tile of chosen rows (unused slots, -1, skipped).
      int64_t count = 0;
      for (; n < idx.topk && count < kTileKeys; ++n) {
        const int32_t j = sel[n * idx.stride.col];
        if (j < 0) continue;
        const int64_t r = p.key_row(b, j);
        load_row(kt, p, false, b, r, kvh, D, x.keys + count * x.d_pad);
        if (!shared_v) load_row(kt, p, true, b, r, kvh, Dv, x.values + count * x.dv_pad);
        ++count;
      }
      if (count == 0) break;
      kt.qk_f32(x.keys, x.d_pad, count, D, x.qt, m_pad, x.s, x.ss, 0, nullptr);
      if (p.softcap > 0.0f) kt.softcap(x.s, count, m_pad, x.ss, p.softcap);
      kt.softmax(x.s, count, m_pad, x.ss, x.row_max, x.row_sum, x.alpha);
      kt.pv_f32(x.s, count, x.ss, nh, x.values, x.v_stride, Dv, x.o, x.dv_pad, x.alpha, 0, nullptr);
    }
    for (int64_t g = 0; g < nh; ++g) {
      const float sum = x.row_sum[g];
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      float* o = out_ptr(p, b, i, h0 + g);
      for (int64_t c = 0; c < Dv; ++c) o[c * p.out_stride.dim] = x.o[g * x.dv_pad + c] * inv;
      write_lse(p, b, i, h0 + g,
                sum > 0.0f ? static_cast<double>(x.row_max[g]) + std::log(static_cast<double>(sum))
                           : -std::numeric_limits<double>::infinity());
    }
  });
  return Status::Ok();
}

}  // namespace attnkit::kernels
