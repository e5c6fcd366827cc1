// The fast CPU attention kernel against its reference twin (attention_ref,
// float64 loops) on seeded random inputs: every compiled SIMD target, many
// tilings and split sizes, 1/2/3/7 threads, edge sizes around the tiles,
// every mask, ring buffers, strided views, MLA's V-inside-K view, NaN in
// keys a row may not see, and bit-exact determinism across thread counts.
//
// Tolerances are derived per output row from fp32's unit roundoff u, the
// reduction lengths and the input magnitudes (see bounds_for_row); a
// failure prints the worst element, both values and the bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "attnkit/attention.h"
#include "common/emulated_kernels.h"
#include "core/cpu_features.h"
#include "kernels/amx.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/task_plan.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/dispatch.h"
#include "kernels/ref/attention_ref.h"
#include "ops/kv_quant.h"

namespace attnkit::kernels {
namespace {

constexpr double kU = 0x1p-24;     // fp32 unit roundoff
constexpr double kUBf16 = 0x1p-8;  // bf16 unit roundoff
// A float split into two bf16 parts, bf16(x) + bf16(x - bf16(x)): within
// 2^-17 of |x| (AMX's queries and weights over 8-bit K/V, decode_amx.h).
constexpr double kUBf16Split = 0x1p-16;
constexpr float kSentinel = 1234.5f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

enum class MaskKind { kNone, kBool, kAdd };

struct Case {
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, kv_heads = 1, d = 8, dv = 8;
  DType kv = DType::kF32;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool seqlens = false;    // random valid-key count per batch item
  bool q_offsets = false;  // explicit query positions per batch item
  MaskKind mask = MaskKind::kNone;
  bool mask_broadcast = false;
  SparsePattern sparse;
  int64_t chunk_size = 0;  // chunked local attention, 0 = off
  float sink = 0.0f;       // != 0: head h's sink logit is sink + h / 4 (strided when strided)
  bool ring = false;
  int64_t page_size = 0;    // > 0: K/V rows in shuffled pages behind a block table
  bool ragged = false;      // each batch item has 0..seqlen_q query rows, packed
  bool strided = false;     // padded strides everywhere, non-unit q/out dim strides
  bool mla_view = false;    // V is the first dv columns of K's rows (dv <= d)
  double poison = 0.0;      // fraction of (batch, kv row, kv head) K/V rows set to NaN
  bool inexact_q = false;   // bf16 K/V: leave q and the scale arbitrary (see Problem)
  int64_t scale_block = 0;  // 8-bit K/V: channels per scale, 0 = one per head row
  uint64_t seed = 1;

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " sq=" << seqlen_q << " sk=" << seqlen_k << " h=" << heads << "/"
      << kv_heads << " d=" << d << "/" << dv << " kv=" << dtype_name(kv) << " causal=" << causal
      << " window=(" << window_left << "," << window_right << ") softcap=" << softcap
      << " seqlens=" << seqlens << " q_offsets=" << q_offsets << " mask=" << static_cast<int>(mask)
      << (mask_broadcast ? "b" : "") << " sparse=" << static_cast<int>(sparse.kind) << "/"
      << sparse.block_size << "/" << sparse.stride << "/" << sparse.summary
      << " chunk=" << chunk_size << " sink=" << sink << " ring=" << ring
      << " page_size=" << page_size << " ragged=" << ragged << " strided=" << strided
      << " mla_view=" << mla_view << " poison=" << poison << " scale_block=" << scale_block
      << " seed=" << seed;
    return s.str();
  }
};

// Owns the inputs of one case and builds AttentionParams over them.
class Problem {
 public:
  explicit Problem(const Case& c) : c_(c), rng_(c.seed) {
    const int64_t pad = c.strided ? 3 : 0;
    // Layout choices draw from their own stream, so that the values of a
    // case do not depend on them.
    std::mt19937_64 layout_rng(c.seed ^ 0x9e3779b97f4a7c15ull);
    // Ragged queries: item b's rows are rows q_start_[b] ... of one packed
    // [rows, heads, d] tensor (batch strides 0).
    int64_t q_rows = c.batch * c.seqlen_q;
    if (c.ragged) {
      std::uniform_int_distribution<int64_t> len(0, c.seqlen_q);
      q_rows = 0;
      for (int64_t b = 0; b < c.batch; ++b) {
        q_start_.push_back(static_cast<int32_t>(q_rows));
        q_len_.push_back(static_cast<int32_t>(len(layout_rng)));
        q_rows += q_len_.back();
      }
    }
    // q [batch, seqlen_q, heads, d]; dim stride 2 when strided.
    qs_.dim = c.strided ? 2 : 1;
    qs_.head = c.d * qs_.dim + pad;
    qs_.row = c.heads * qs_.head + pad;
    qs_.batch = c.ragged ? 0 : c.seqlen_q * qs_.row + pad;
    // k, v [batch, seqlen_k, kv_heads, d / dv]; rows contiguous (dim stride 1).
    ks_.head = c.d + pad;
    ks_.row = c.kv_heads * ks_.head + pad;
    ks_.batch = c.seqlen_k * ks_.row + pad;
    vs_ = ks_;
    if (!c.mla_view) {
      vs_.head = c.dv + pad;
      vs_.row = c.kv_heads * vs_.head + pad;
      vs_.batch = c.seqlen_k * vs_.row + pad;
    }
    // Paged K/V: every item's keys in pages of page_size rows, the pages of
    // all items (and two spare ones, never referenced) in shuffled order.
    int64_t kv_rows = c.batch * c.seqlen_k;
    if (c.page_size > 0) {
      pages_per_item_ = (c.seqlen_k + c.page_size - 1) / c.page_size;
      const int64_t pages = c.batch * pages_per_item_ + 2;
      for (int64_t x = 0; x < pages; ++x) block_table_.push_back(static_cast<int32_t>(x));
      // Shuffled pages, or (one case in three) runs of consecutive pages
      // as a fresh pool hands them out, which the kernel reads as one run.
      if (c.seed % 3 == 0) {
        for (size_t x = 0; x + 3 < block_table_.size(); x += 3)
          if (layout_rng() % 2) std::swap(block_table_[x], block_table_[x + 3]);
      } else {
        std::shuffle(block_table_.begin(), block_table_.end(), layout_rng);
      }
      block_table_.resize(static_cast<size_t>(c.batch * pages_per_item_));
      kv_rows = pages * c.page_size;
      ks_.batch = vs_.batch = 0;
    }
    os_.dim = c.strided ? 3 : 1;
    os_.head = c.dv * os_.dim + pad;
    os_.row = c.heads * os_.head + pad;
    os_.batch = c.ragged ? 0 : c.seqlen_q * os_.row + pad;
    lse_head_ = (c.ragged ? q_rows : c.seqlen_q) + pad;
    lse_batch_ = c.ragged ? 0 : c.heads * lse_head_ + pad;
    q_elems_ = c.ragged ? q_rows * qs_.row + pad : c.batch * qs_.batch;
    out_elems_ = c.ragged ? q_rows * os_.row + pad : c.batch * os_.batch;
    lse_elems_ = c.ragged ? c.heads * lse_head_ : c.batch * lse_batch_;

    // bf16 K/V: q is made bf16-exact and the scale a power of two, so that
    // the vdpbf16ps path rounds nothing on the query side and the bound
    // below can stay tight (unless the case asks for inexact q).
    const bool bf16_q = c.kv == DType::kBF16 && !c.inexact_q;
    scale_ = bf16_q ? std::ldexp(1.0f, -static_cast<int>(std::round(
                                           std::log2(std::sqrt(static_cast<double>(c.d))))))
                    : static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    q_.resize(static_cast<size_t>(q_elems_), kNaN);
    for_each_q([&](int64_t at) { q_[at] = value(2.0f, bf16_q); });

    const int64_t k_elems = c.page_size > 0 ? kv_rows * ks_.row + pad : c.batch * ks_.batch;
    const int64_t v_elems =
        c.mla_view ? 0 : (c.page_size > 0 ? kv_rows * vs_.row + pad : c.batch * vs_.batch);
    // Padding between rows and heads (strided layouts) holds NaN: a kernel
    // that reads past a row, even to multiply by 0, makes its output NaN.
    std::vector<float> k(static_cast<size_t>(k_elems), kNaN), v(static_cast<size_t>(v_elems), kNaN);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t r = 0; r < c.seqlen_k; ++r)
        for (int64_t g = 0; g < c.kv_heads; ++g) {
          for (int64_t x = 0; x < c.d; ++x) k[krow(b, r) + g * ks_.head + x] = value(2.0f, false);
          if (!c.mla_view)
            for (int64_t x = 0; x < c.dv; ++x)
              v[vrow(b, r) + g * vs_.head + x] = value(2.0f, false);
        }
    if (c.kv == DType::kBF16) {
      for (float x : k) kb_.push_back(float_to_bf16(x));
      for (float x : v) vb_.push_back(float_to_bf16(x));
    } else if (is_kv_quantized(c.kv)) {
      quantize(c, k, v, pad);
    } else {
      kf_ = std::move(k);
      vf_ = std::move(v);
    }
    poisoned_.assign(static_cast<size_t>(c.batch * c.seqlen_k * c.kv_heads), 0);
    std::bernoulli_distribution poison(c.poison);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t r = 0; r < c.seqlen_k; ++r)
        for (int64_t g = 0; g < c.kv_heads; ++g)
          if (poison(rng_)) poison_row(b, r, g);

    std::uniform_int_distribution<int64_t> len(0, c.seqlen_k);
    if (c.seqlens)
      for (int64_t b = 0; b < c.batch; ++b) k_len_.push_back(static_cast<int32_t>(len(rng_)));
    std::uniform_int_distribution<int64_t> off(-c.seqlen_q, c.seqlen_k);
    if (c.q_offsets)
      for (int64_t b = 0; b < c.batch; ++b) q_off_.push_back(off(rng_));
    if (c.ring) {
      std::uniform_int_distribution<int64_t> start(0, c.seqlen_k - 1);
      ring_start_ = start(rng_);
    }

    if (c.sink != 0.0f) {
      // Strided sinks leave NaN between them: reading a neighbour shows.
      sinks_stride_ = c.strided ? 2 : 1;
      sinks_.assign(static_cast<size_t>(c.heads * sinks_stride_), kNaN);
      for (int64_t h = 0; h < c.heads; ++h)
        sinks_[h * sinks_stride_] = c.sink + 0.25f * static_cast<float>(h);
    }

    if (c.mask != MaskKind::kNone) {
      const int64_t mb = c.mask_broadcast ? 1 : c.batch, mh = c.mask_broadcast ? 1 : c.heads;
      ms_.dim = 1;
      ms_.row = c.seqlen_k + 1;
      ms_.head = c.seqlen_q * ms_.row;
      ms_.batch = mh * ms_.head;
      const size_t n = static_cast<size_t>(mb * ms_.batch);
      std::bernoulli_distribution keep(0.8), ninf(0.1);
      if (c.mask == MaskKind::kBool) {
        bool_mask_.resize(n);
        for (auto& x : bool_mask_) x = keep(rng_);
      } else {
        add_mask_.resize(n);
        for (auto& x : add_mask_) x = ninf(rng_) ? -INFINITY : value(2.0f, false);
      }
      if (c.mask_broadcast) {
        ms_.batch = 0;
        ms_.head = 0;
      }
    }
  }

  const Case& spec() const { return c_; }

  // Fills the K and V row of (batch b, physical row r, kv head g) with NaN
  // (8-bit K/V: as quantize_kv stores a row holding NaN, scales NaN).
  void poison_row(int64_t b, int64_t r, int64_t g) {
    s_max_.clear();
    poisoned_[(b * c_.seqlen_k + r) * c_.kv_heads + g] = 1;
    if (is_kv_quantized(c_.kv)) {
      for (int64_t x = 0; x < blocks(c_.d); ++x) kscale_[kscale_at(b, r, g) + x] = kNaN;
      if (!c_.mla_view)
        for (int64_t x = 0; x < blocks(c_.dv); ++x) vscale_[vscale_at(b, r, g) + x] = kNaN;
      return;
    }
    const bf16 nan16 = float_to_bf16(kNaN);
    for (int64_t x = 0; x < c_.d; ++x) {
      const int64_t at = krow(b, r) + g * ks_.head + x;
      if (c_.kv == DType::kBF16)
        kb_[at] = nan16;
      else
        kf_[at] = kNaN;
    }
    if (c_.mla_view) return;
    for (int64_t x = 0; x < c_.dv; ++x) {
      const int64_t at = vrow(b, r) + g * vs_.head + x;
      if (c_.kv == DType::kBF16)
        vb_[at] = nan16;
      else
        vf_[at] = kNaN;
    }
  }

  // 8-bit K/V: every code at its largest magnitude with random signs (and,
  // for fp8, every third one subnormal), each key row's scales spread over
  // 2^-6 .. 2^6 (keys) and 2^-12 .. 2^12 (values).
  void saturate_rows() {
    s_max_.clear();
    std::uniform_int_distribution<int> sign(0, 1), shift(-12, 12);
    auto fill = [&](std::vector<uint8_t>& codes, int64_t at, int64_t n) {
      for (int64_t x = 0; x < n; ++x) {
        const bool neg = sign(rng_) == 1;
        uint8_t code = c_.kv == DType::kI8 ? static_cast<uint8_t>(neg ? -127 : 127) : 0x7e;
        if (c_.kv == DType::kFp8E4M3) code = (x % 3 == 2 ? 0x05 : 0x7e) | (neg ? 0x80 : 0);
        codes[at + x] = code;
      }
    };
    for (int64_t b = 0; b < c_.batch; ++b)
      for (int64_t r = 0; r < c_.seqlen_k; ++r)
        for (int64_t g = 0; g < c_.kv_heads; ++g) {
          fill(kq_, krow(b, r) + g * ks_.head, c_.d);
          for (int64_t x = 0; x < blocks(c_.d); ++x)
            kscale_[kscale_at(b, r, g) + x] = std::ldexp(0.01f, shift(rng_) / 2) / 127;
          if (c_.mla_view) continue;
          fill(vq_, vrow(b, r) + g * vs_.head, c_.dv);
          for (int64_t x = 0; x < blocks(c_.dv); ++x)
            vscale_[vscale_at(b, r, g) + x] = std::ldexp(1.0f, shift(rng_)) / 127;
        }
  }

  // Params writing to `out` / `lse` (laid out as out_elems() / lse_elems()).
  AttentionParams params(float* out, float* lse) const {
    AttentionParams p;
    p.batch = c_.batch;
    p.seqlen_q = c_.seqlen_q;
    p.seqlen_k = c_.seqlen_k;
    p.num_heads = c_.heads;
    p.num_kv_heads = c_.kv_heads;
    p.head_dim = c_.d;
    p.head_dim_v = c_.dv;
    p.q = q_.data();
    p.q_stride = qs_;
    p.kv_dtype = c_.kv;
    if (is_kv_quantized(c_.kv)) {
      p.k = kq_.data();
      p.v = c_.mla_view ? kq_.data() : vq_.data();
      p.k_scale = kscale_.data();
      p.k_scale_stride = kss_;
      p.v_scale = c_.mla_view ? kscale_.data() : vscale_.data();
      p.v_scale_stride = c_.mla_view ? kss_ : vss_;
      p.scale_block = c_.scale_block;
    } else if (c_.kv == DType::kBF16) {
      p.k = kb_.data();
      p.v = c_.mla_view ? static_cast<const void*>(kb_.data()) : vb_.data();
    } else {
      p.k = kf_.data();
      p.v = c_.mla_view ? static_cast<const void*>(kf_.data()) : vf_.data();
    }
    p.k_stride = ks_;
    p.v_stride = vs_;
    p.out = out;
    p.out_stride = os_;
    p.lse = lse;
    p.lse_stride_batch = lse_batch_;
    p.lse_stride_head = lse_head_;
    p.lse_stride_row = 1;
    p.scale = scale_;
    p.softcap = c_.softcap;
    p.k_len = k_len_.empty() ? nullptr : k_len_.data();
    p.q_offset = q_off_.empty() ? nullptr : q_off_.data();
    p.causal = c_.causal;
    p.window_left = c_.window_left;
    p.window_right = c_.window_right;
    p.sparse = c_.sparse;
    p.chunk_size = c_.chunk_size;
    p.sinks = sinks_.empty() ? nullptr : sinks_.data();
    p.sinks_stride = sinks_stride_;
    p.bool_mask = bool_mask_.empty() ? nullptr : bool_mask_.data();
    p.add_mask = add_mask_.empty() ? nullptr : add_mask_.data();
    p.mask_stride = ms_;
    p.ring_capacity = c_.ring ? c_.seqlen_k : 0;
    p.ring_start = ring_start_;
    if (c_.page_size > 0) {
      p.block_table = block_table_.data();
      p.block_table_stride = pages_per_item_;
      p.page_size = c_.page_size;
    }
    if (c_.ragged) {
      p.q_start = q_start_.data();
      p.q_len = q_len_.data();
    }
    return p;
  }

  // Query rows of batch item b.
  int64_t rows(int64_t b) const { return c_.ragged ? q_len_[b] : c_.seqlen_q; }
  int64_t out_elems() const { return out_elems_; }
  int64_t lse_elems() const { return lse_elems_; }
  int64_t out_index(int64_t b, int64_t i, int64_t h, int64_t c) const {
    return b * os_.batch + q_row(b, i) * os_.row + h * os_.head + c * os_.dim;
  }
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return b * lse_batch_ + h * lse_head_ + q_row(b, i);
  }

  // Error bounds for row (b, i, h) of the fast kernel against the exact
  // result, for `target`. With u = 2^-24, n = keys, S = scale * max over
  // keys of sum_d |q_d k_d| and Vmax = max |v|:
  //   score error    E <= (d + 4) u S  (+ 8 u cap for softcap's tanh,
  //                                     + u (S + max|bias|) for the bias,
  //                                     + 2^-8 S where vdpbf16ps rounds a
  //                                     q that is not bf16-exact)
  //   weights        relative error <= expm1(2E) + 8u (exp is ~2 ulp)
  //   output         <= Vmax (expm1(2E) + (3n + 32) u)  — sums of n terms
  //                     rescaled once per tile — plus Vmax 2^-8 where
  //                     vdpbf16ps rounds the weights to bf16
  //   lse            <= E + (3n + 32) u + 4u |lse|
  struct Bounds {
    double out, lse;
  };
  //
  // 8-bit K/V (the reference reads the dequantized values exactly): the
  // fp32 terms above, with the keys' and values' dequantization (one
  // rounding, u) inside them, plus per path:
  //   int8 keys, 1-4 rows (qk_rows_i8): q rounded to int16 in steps of
  //     qf = max_c |scale q_c| / qmax: E += qf / 2 * max_j sum_c |k_jc|
  //   weights times the value scale (pv_i8 / pv_fp8): 2u Vmax
  //   copies as bf16 (`dot`: the vdpbf16ps kernels): q and k rounded to
  //     bf16, E += 2^-8 S; values and weights rounded, 2 * 2^-8 Vmax
  //   fp8 keys decoded exactly to bf16 for AMX (`amx_q`, decode_amx.h): q
  //     rounded to bf16, E += 2^-8 S; int8 keys on AMX-INT8 (`amx_i8`): as
  //     qk_rows_i8 with qmax at most 127 * 256 + 127; P V on AMX (`amx_w`):
  //     values exact, weights rounded to bf16, 2^-8 Vmax
  Bounds bounds_for_row(int64_t b, int64_t i, int64_t h, SimdTarget target, bool dot, bool amx_q,
                        bool amx_i8, bool amx_w) const {
    if (s_max_.empty()) compute_row_maxima();
    const int64_t row = (b * c_.seqlen_q + i) * c_.heads + h;
    const double s_max = s_max_[row];
    const double v_max = v_max_[b * c_.kv_heads + h / (c_.heads / c_.kv_heads)];
    const bool q8 = is_kv_quantized(c_.kv);
    double e = (c_.d + 4) * kU * s_max;
    if (c_.softcap > 0.0f) e += 8 * kU * c_.softcap;
    if (c_.mask == MaskKind::kAdd) e += kU * (s_max + 2.0);
    if (c_.inexact_q && c_.kv == DType::kBF16 && target == SimdTarget::kAvx512Bf16)
      e += kUBf16 * s_max;
    if (c_.kv == DType::kI8) {
      const double qmax =
          std::min(amx_i8 ? 32639.0 : 32767.0, std::floor(2147483647.0 / (127.0 * double(c_.d))));
      e += 0.5 * q_amax_[row] / qmax * k1_max_[b * c_.kv_heads + h / (c_.heads / c_.kv_heads)];
    }
    // AMX's queries over fp8 keys are split into two bf16 parts (2^-17),
    // not rounded to one: a bound from what the path rounds, tight enough
    // that a 1 % error in the key scales fails it.
    if (q8 && dot) e += kUBf16 * s_max;
    if (q8 && amx_q) e += kUBf16Split * s_max;
    const double n = static_cast<double>(c_.seqlen_k);
    double out = v_max * (std::expm1(2 * e) + 8 * kU + (3 * n + 32) * kU);
    if (c_.kv == DType::kBF16 && target == SimdTarget::kAvx512Bf16) out += v_max * kUBf16;
    // AMX's weights over 8-bit values: two bf16 parts, as the queries.
    if (q8) out += v_max * (dot ? 2 * kUBf16 : amx_w ? kUBf16Split + 2 * kU : 2 * kU);
    return {out + 1e-30, e + (3 * n + 32) * kU};
  }

  // 8-bit K/V: a Problem's inputs are the float K/V, quantized per (batch
  // item, row, kv head) as the caches quantize them (ops/kv_quant.h), with
  // the scales in arrays of their own, [rows, kv heads, blocks] per batch
  // item (padded like the data when strided). Padding codes decode to
  // large values and padding scales are NaN: a kernel reading past a row
  // or a scale shows.
  int64_t blocks(int64_t dim) const {
    return c_.scale_block > 0 ? (dim + c_.scale_block - 1) / c_.scale_block : 1;
  }

 private:
  // S (per row) and Vmax (per batch item and kv head) of bounds_for_row,
  // over the keys that are not NaN; for int8 keys also max_c |scale q_c|
  // per row and max_j sum_c |k_jc| per batch item and kv head.
  void compute_row_maxima() const {
    const int64_t group = c_.heads / c_.kv_heads;
    s_max_.assign(static_cast<size_t>(c_.batch * c_.seqlen_q * c_.heads), 0.0);
    q_amax_.assign(s_max_.size(), 0.0);
    v_max_.assign(static_cast<size_t>(c_.batch * c_.kv_heads), 0.0);
    k1_max_.assign(v_max_.size(), 0.0);
    std::vector<double> kabs(static_cast<size_t>(c_.d));
    for (int64_t b = 0; b < c_.batch; ++b)
      for (int64_t g = 0; g < c_.kv_heads; ++g)
        for (int64_t r = 0; r < c_.seqlen_k; ++r) {
          if (poisoned_[(b * c_.seqlen_k + r) * c_.kv_heads + g]) continue;
          double k1 = 0.0;
          for (int64_t x = 0; x < c_.d; ++x) {
            kabs[x] = std::fabs(kv_at(true, b, r, g, x));
            k1 += kabs[x];
          }
          k1_max_[b * c_.kv_heads + g] = std::max(k1_max_[b * c_.kv_heads + g], k1);
          double& vm = v_max_[b * c_.kv_heads + g];
          for (int64_t x = 0; x < c_.dv; ++x)
            vm = std::max(vm, std::fabs(kv_at(false, b, r, g, x)));
          for (int64_t i = 0; i < rows(b); ++i)
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float* q = q_.data() + b * qs_.batch + q_row(b, i) * qs_.row + h * qs_.head;
              double dot = 0.0, qa = 0.0;
              for (int64_t x = 0; x < c_.d; ++x) {
                dot += std::fabs(q[x * qs_.dim]) * kabs[x];
                qa = std::max(qa, std::fabs(double(scale_ * q[x * qs_.dim])));
              }
              double& sm = s_max_[(b * c_.seqlen_q + i) * c_.heads + h];
              sm = std::max(sm, scale_ * dot);
              q_amax_[(b * c_.seqlen_q + i) * c_.heads + h] = qa;
            }
        }
  }

  void quantize(const Case& c, const std::vector<float>& k, const std::vector<float>& v,
                int64_t pad) {
    kq_.assign(k.size(), 0x7e);  // padding: +448 (fp8) or 126 (int8)
    vq_.assign(v.size(), 0x7e);
    // Scales [rows, kv heads, blocks] per batch item (paged: one array of
    // every page's rows, batch stride 0, as the data).
    auto strides = [&](int64_t dim) {
      Strides4 st;
      st.dim = 1;
      st.head = blocks(dim) + (c.strided ? 1 : 0);
      st.row = c.kv_heads * st.head + pad;
      st.batch = c.page_size > 0 ? 0 : c.seqlen_k * st.row + pad;
      return st;
    };
    kss_ = strides(c.d);
    vss_ = strides(c.dv);
    const int64_t rows_total = c.page_size > 0
                                   ? static_cast<int64_t>(block_table_.size() + 2) * c.page_size
                                   : c.batch * c.seqlen_k;
    kscale_.assign(static_cast<size_t>(rows_total * kss_.row + c.batch * pad + 1), kNaN);
    vscale_.assign(static_cast<size_t>(rows_total * vss_.row + c.batch * pad + 1), kNaN);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t r = 0; r < c.seqlen_k; ++r)
        for (int64_t g = 0; g < c.kv_heads; ++g) {
          const int64_t k0 = krow(b, r) + g * ks_.head;
          quantize_kv(k.data() + k0, 1, c.d, c.kv, c.scale_block, kq_.data() + k0,
                      kscale_.data() + kscale_at(b, r, g));
          if (c.mla_view) continue;
          const int64_t v0 = vrow(b, r) + g * vs_.head;
          quantize_kv(v.data() + v0, 1, c.dv, c.kv, c.scale_block, vq_.data() + v0,
                      vscale_.data() + vscale_at(b, r, g));
        }
  }
  int64_t kscale_at(int64_t b, int64_t r, int64_t g) const {
    return b * kss_.batch + kv_row(b, r) * kss_.row + g * kss_.head;
  }
  int64_t vscale_at(int64_t b, int64_t r, int64_t g) const {
    return b * vss_.batch + kv_row(b, r) * vss_.row + g * vss_.head;
  }

  template <class F>
  void for_each_q(F f) {
    for (int64_t b = 0; b < c_.batch; ++b)
      for (int64_t i = 0; i < rows(b); ++i)
        for (int64_t h = 0; h < c_.heads; ++h)
          for (int64_t x = 0; x < c_.d; ++x)
            f(b * qs_.batch + q_row(b, i) * qs_.row + h * qs_.head + x * qs_.dim);
  }
  int64_t q_row(int64_t b, int64_t i) const { return c_.ragged ? q_start_[b] + i : i; }
  // Offset of the first element of item b's key (value) row r.
  int64_t krow(int64_t b, int64_t r) const { return kv_row(b, r) * ks_.row + b * ks_.batch; }
  int64_t vrow(int64_t b, int64_t r) const { return kv_row(b, r) * vs_.row + b * vs_.batch; }
  int64_t kv_row(int64_t b, int64_t r) const {
    if (c_.page_size == 0) return r;
    return block_table_[b * pages_per_item_ + r / c_.page_size] * c_.page_size + r % c_.page_size;
  }
  float value(float range, bool bf16_exact) {
    std::uniform_real_distribution<float> u(-range, range);
    const float x = u(rng_);
    return bf16_exact ? bf16_to_float(float_to_bf16(x)) : x;
  }
  // Element x of the K (key) or V row of (b, logical row r, kv head g), as
  // the reference reads it (8-bit: dequantized, exactly).
  double kv_at(bool key, int64_t b, int64_t r, int64_t g, int64_t x) const {
    const bool from_k = key || c_.mla_view;
    const int64_t index = from_k ? krow(b, r) + g * ks_.head + x : vrow(b, r) + g * vs_.head + x;
    if (is_kv_quantized(c_.kv)) {
      const int64_t block = c_.scale_block > 0 ? x / c_.scale_block : 0;
      const float scale =
          from_k ? kscale_[kscale_at(b, r, g) + block] : vscale_[vscale_at(b, r, g) + block];
      return double(kv_code_value(c_.kv, from_k ? kq_[index] : vq_[index])) * scale;
    }
    if (c_.kv == DType::kBF16) return bf16_to_float(from_k ? kb_[index] : vb_[index]);
    return from_k ? kf_[index] : vf_[index];
  }

  Case c_;
  std::mt19937_64 rng_;
  Strides4 qs_, ks_, vs_, os_, ms_;
  int64_t lse_head_ = 0, lse_batch_ = 0, ring_start_ = 0, pages_per_item_ = 0;
  int64_t q_elems_ = 0, out_elems_ = 0, lse_elems_ = 0;
  std::vector<int32_t> block_table_, q_start_, q_len_;
  float scale_ = 1.0f;
  std::vector<float> q_, kf_, vf_, add_mask_;
  std::vector<bf16> kb_, vb_;
  std::vector<uint8_t> kq_, vq_;        // 8-bit codes, laid out as kf_ / vf_
  std::vector<float> kscale_, vscale_;  // their scales
  Strides4 kss_, vss_;
  std::vector<uint8_t> bool_mask_, poisoned_;
  std::vector<int32_t> k_len_;
  std::vector<int64_t> q_off_;
  std::vector<float> sinks_;
  int64_t sinks_stride_ = 1;
  mutable std::vector<double> s_max_, v_max_, q_amax_, k1_max_;
};

struct Outputs {
  std::vector<float> out, lse;
};

Outputs run_reference(const Problem& pr) {
  Outputs r{std::vector<float>(static_cast<size_t>(pr.out_elems()), kSentinel),
            std::vector<float>(static_cast<size_t>(pr.lse_elems()), kSentinel)};
  const AttentionParams p = pr.params(r.out.data(), r.lse.data());
  std::vector<double> scratch(attention_ref_scratch(p));
  attention_ref(p, scratch.data());
  return r;
}

Outputs run_fast(const Problem& pr, const cpu::Plan& plan) {
  Outputs r{std::vector<float>(static_cast<size_t>(pr.out_elems()), kSentinel),
            std::vector<float>(static_cast<size_t>(pr.lse_elems()), kSentinel)};
  const AttentionParams p = pr.params(r.out.data(), r.lse.data());
  EXPECT_TRUE(cpu::supports(p));
  std::vector<char> scratch(cpu::scratch_bytes(p, plan));
  cpu::attention(p, plan, scratch.data());
  return r;
}

std::vector<SimdTarget> available_targets() {
  std::vector<SimdTarget> out;
  for (SimdTarget t : kAllSimdTargets)
    if (simd_target_available(t)) out.push_back(t);
  return out;
}

std::string target_str(const cpu::Plan& plan) {
  return std::string(simd_target_name(plan.target)) + (plan.kernels ? " (emulated)" : "");
}

std::string plan_str(const cpu::Plan& plan) {
  return target_str(plan) + " block_q=" + std::to_string(plan.block_q) +
         " block_k=" + std::to_string(plan.block_k) + " split_k=" + std::to_string(plan.split_k) +
         " kv_heads_per_task=" + std::to_string(plan.kv_heads_per_task) +
         " k_then_v=" + std::to_string(plan.k_then_v) +
         " fetch_sweep_ahead=" + std::to_string(plan.fetch_sweep_ahead) +
         " dequant_bf16=" + std::to_string(plan.dequant_bf16) +
         " int8_score_groups=" + std::to_string(plan.int8_score_groups) +
         " amx_qk=" + std::to_string(plan.amx_qk) + " amx_pv=" + std::to_string(plan.amx_pv) +
         " threads=" + std::to_string(plan.num_threads);
}

// Compares fast against reference element by element; NaN must match NaN
// (a row that sees a NaN key is NaN in both), every logical output must be
// written, and the padding between strided outputs must stay untouched.
void expect_close(const Problem& pr, const Outputs& ref, const Outputs& fast,
                  const cpu::Plan& plan) {
  const Case& c = pr.spec();
  // 8-bit K/V copied as bf16 for the vdpbf16ps kernels round them.
  const cpu::Geometry geo = cpu::make_geometry(pr.params(nullptr, nullptr), plan);
  const bool dot = is_kv_quantized(c.kv) && geo.dot_bf16;
  const bool amx_q = is_kv_quantized(c.kv) && geo.amx_qk && !geo.amx_int8;
  const bool amx_w = is_kv_quantized(c.kv) && geo.amx_pv;
  std::vector<uint8_t> logical(ref.out.size(), 0), logical_lse(ref.lse.size(), 0);
  double worst_ratio = 0.0;
  std::string worst;
  int failures = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t i = 0; i < pr.rows(b); ++i)
      for (int64_t h = 0; h < c.heads; ++h) {
        const Problem::Bounds bound =
            pr.bounds_for_row(b, i, h, plan.target, dot, amx_q, geo.amx_int8, amx_w);
        auto check = [&](const char* what, float r, float f, double tol) {
          std::ostringstream where;
          where << what << "[b=" << b << ", i=" << i << ", h=" << h << "]";
          if (std::isnan(r) || std::isnan(f)) {
            if (std::isnan(r) != std::isnan(f)) {
              ++failures;
              worst = where.str() + " ref=" + std::to_string(r) + " fast=" + std::to_string(f);
              worst_ratio = INFINITY;
            }
            return;
          }
          if (std::isinf(r) || std::isinf(f)) {
            if (r != f) {
              ++failures;
              worst = where.str() + " ref=" + std::to_string(r) + " fast=" + std::to_string(f);
              worst_ratio = INFINITY;
            }
            return;
          }
          const double err = std::fabs(static_cast<double>(r) - f), ratio = err / tol;
          if (ratio > 1.0) ++failures;
          if (ratio > worst_ratio) {
            worst_ratio = ratio;
            std::ostringstream m;
            m << where.str() << " ref=" << r << " fast=" << f << " err=" << err << " bound=" << tol;
            worst = m.str();
          }
        };
        for (int64_t x = 0; x < c.dv; ++x) {
          const int64_t at = pr.out_index(b, i, h, x);
          logical[at] = 1;
          check("out", ref.out[at], fast.out[at], bound.out);
        }
        const int64_t at = pr.lse_index(b, h, i);
        logical_lse[at] = 1;
        const float lse_ref = ref.lse[at];
        check("lse", lse_ref, fast.lse[at],
              bound.lse + 4 * kU * (std::isfinite(lse_ref) ? std::fabs(lse_ref) : 0.0));
      }
  for (size_t x = 0; x < logical.size(); ++x)
    if (!logical[x] && std::memcmp(&fast.out[x], &kSentinel, sizeof(float)) != 0) {
      ++failures;
      worst = "out padding element " + std::to_string(x) + " was written";
    }
  for (size_t x = 0; x < logical_lse.size(); ++x)
    if (!logical_lse[x] && std::memcmp(&fast.lse[x], &kSentinel, sizeof(float)) != 0) {
      ++failures;
      worst = "lse padding element " + std::to_string(x) + " was written";
    }
  EXPECT_EQ(failures, 0) << c.describe() << "\n" << plan_str(plan) << "\nworst: " << worst;
}

// Runs `c` on every target with `plan_for` choosing the tiling: called
// with the problem, or with the problem and the target where tile sizes
// may depend on it (make_plan's).
template <class PlanFor>
void check_case(const Case& c, PlanFor plan_for) {
  const Problem pr(c);
  const Outputs ref = run_reference(pr);
  for (const TestedTarget& t : tested_targets()) {
    cpu::Plan plan;
    if constexpr (std::is_invocable_v<PlanFor, const Problem&, SimdTarget>)
      plan = plan_for(pr, t.target);
    else
      plan = plan_for(pr);
    t.apply(plan);
    expect_close(pr, ref, run_fast(pr, plan), plan);
  }
}

cpu::Plan default_plan(const Problem& pr, int threads, SimdTarget target = SimdTarget::kScalar) {
  AttentionParams p = pr.params(nullptr, nullptr);
  return cpu::make_plan(p, target, threads);
}

cpu::Plan tiled(int64_t block_q, int64_t block_k, int64_t split_k, int threads,
                int64_t kv_heads_per_task = 1) {
  cpu::Plan plan;
  plan.block_q = block_q;
  plan.block_k = block_k;
  plan.split_k = split_k;
  plan.kv_heads_per_task = kv_heads_per_task;
  plan.num_threads = threads;
  return plan;
}

// ---- targeted cases ------------------------------------------------------

TEST(AttentionFast, EdgeSizesAroundTiles) {
  uint64_t seed = 100;
  for (int64_t tile : {4, 16})
    for (int64_t sk : {int64_t{1}, tile - 1, tile, tile + 1, 2 * tile + 1})
      for (int64_t sq : {int64_t{1}, tile - 1, tile + 1})
        for (bool causal : {false, true}) {
          Case c;
          c.seqlen_q = sq;
          c.seqlen_k = sk;
          c.heads = 4;
          c.kv_heads = 2;
          c.d = tile == 4 ? 7 : 16;
          c.dv = tile == 4 ? 5 : 17;
          c.causal = causal;
          c.seed = ++seed;
          check_case(c, [&](const Problem&) { return tiled(tile, tile, 0, 2); });
        }
}

TEST(AttentionFast, OddHeadDimsAndGroups) {
  uint64_t seed = 200;
  const int64_t groups[][2] = {{1, 1}, {3, 3}, {4, 1}, {6, 2}, {8, 2}};
  for (const auto& hg : groups)
    for (int64_t d : {1, 2, 3, 17, 33})
      for (DType kv : {DType::kF32, DType::kBF16}) {
        Case c;
        c.seqlen_q = 5;
        c.seqlen_k = 23;
        c.heads = hg[0];
        c.kv_heads = hg[1];
        c.d = d;
        c.dv = d == 33 ? 20 : d + 1;
        c.kv = kv;
        c.causal = d % 2 == 1;
        c.seed = ++seed;
        check_case(c, [&](const Problem&) { return tiled(3, 8, 0, 3); });
      }
}

TEST(AttentionFast, EveryMask) {
  uint64_t seed = 300;
  std::vector<Case> cases;
  auto base = [&] {
    Case c;
    c.batch = 2;
    c.seqlen_q = 19;
    c.seqlen_k = 37;
    c.heads = 4;
    c.kv_heads = 2;
    c.d = 16;
    c.dv = 12;
    c.seed = ++seed;
    return c;
  };
  Case c = base();
  c.causal = true;
  cases.push_back(c);
  c = base();
  c.window_left = 5;
  c.window_right = 2;
  cases.push_back(c);
  c = base();
  c.causal = true;
  c.window_left = 8;
  cases.push_back(c);
  c = base();
  c.window_left = 0;
  c.window_right = 0;
  cases.push_back(c);
  c = base();
  c.seqlens = true;
  c.causal = true;
  cases.push_back(c);
  c = base();
  c.q_offsets = true;
  c.causal = true;
  c.window_left = 6;
  cases.push_back(c);
  c = base();
  c.softcap = 1.5f;
  c.causal = true;
  cases.push_back(c);
  for (MaskKind m : {MaskKind::kBool, MaskKind::kAdd})
    for (bool broadcast : {false, true}) {
      c = base();
      c.mask = m;
      c.mask_broadcast = broadcast;
      c.causal = broadcast;
      cases.push_back(c);
    }
  for (auto kind : {SparsePattern::Kind::kStrided, SparsePattern::Kind::kFixed})
    for (int64_t bs : {1, 3, 8}) {
      c = base();
      c.sparse.kind = kind;
      c.sparse.block_size = bs;
      c.sparse.stride = 3;
      c.sparse.summary = 1;
      c.causal = bs != 3;
      cases.push_back(c);
    }
  c = base();
  c.ring = true;
  c.seqlens = true;
  c.causal = true;
  cases.push_back(c);
  for (const Case& cc : cases)
    for (DType kv : {DType::kF32, DType::kBF16}) {
      Case k = cc;
      k.kv = kv;
      check_case(k, [&](const Problem&) { return tiled(4, 8, 0, 2); });
      check_case(k, [&](const Problem&) { return tiled(19, 16, 8, 3, 2); });
    }
}

// Chunked local attention at chunk sizes 1, tile - 1, tile, tile + 1 and
// beyond the keys, with and without causal, GQA, seqlen_q above and below
// seqlen_k, on whole-key tiles and on split keys; some with sinks.
TEST(AttentionFast, ChunksAroundTiles) {
  uint64_t seed = 700;
  for (int64_t tile : {4, 16})
    for (int64_t chunk : {int64_t{1}, tile - 1, tile, tile + 1, int64_t{1000}})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 3 * tile + 2},
                            {tile + 1, 3 * tile + 2},
                            {2 * tile + 3, tile + 1}})
        for (bool causal : {false, true}) {
          Case c;
          c.batch = 2;
          c.seqlen_q = sq;
          c.seqlen_k = sk;
          c.heads = 6;
          c.kv_heads = 2;
          c.d = tile == 4 ? 7 : 16;
          c.dv = tile == 4 ? 5 : 17;
          c.causal = causal;
          c.chunk_size = chunk;
          c.sink = seed % 3 == 0 ? 1.5f : 0.0f;
          c.seqlens = seed % 4 == 0;
          c.seed = ++seed;
          check_case(c, [&](const Problem&) { return tiled(tile, tile, 0, 2); });
          check_case(c, [&](const Problem&) { return tiled(tile, tile, 2 * tile, 3, 2); });
        }
}

// Sinks from far below to far above the scores (e^200 overflows fp32): on
// whole tasks and on split keys merged afterwards, with rows that see no
// key (lse = the sink), decode and prefill, fp32, bf16 and 8-bit K/V.
TEST(AttentionFast, SinksOfEveryMagnitude) {
  uint64_t seed = 800;
  for (float sink : {-30.0f, -1.0f, 0.5f, 3.0f, 30.0f, 200.0f})
    for (DType kv : {DType::kF32, DType::kBF16, DType::kI8})
      for (int64_t sq : {1, 4, 19}) {
        Case c;
        c.batch = 3;
        c.seqlen_q = sq;
        c.seqlen_k = 70;
        c.heads = 8;
        c.kv_heads = 2;
        c.d = 16;
        c.dv = 16;
        c.kv = kv;
        c.causal = true;
        c.seqlens = true;  // some items may have no key at all
        c.sink = sink;
        c.strided = seed % 2 == 0;
        c.seed = ++seed;
        check_case(c, [&](const Problem&) { return tiled(4, 16, 0, 2); });
        check_case(c, [&](const Problem&) { return tiled(sq, 8, 16, 3, 2); });
        check_case(c, [&](const Problem& p, SimdTarget t) { return default_plan(p, 2, t); });
      }
}

// NaN in keys a row may not see (beyond seqlens_k, in the future, outside
// the window, dropped by a mask) must not reach that row; rows that do see
// one are NaN in both implementations.
TEST(AttentionFast, NonFiniteMaskedKeysDoNotLeak) {
  uint64_t seed = 400;
  for (int variant = 0; variant < 4; ++variant)
    for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = 12;
      c.seqlen_k = 40;
      c.heads = 2;
      c.kv_heads = 1;
      c.d = 8;
      c.dv = 8;
      c.kv = kv;
      c.causal = true;
      c.seqlens = variant == 0;
      c.window_left = variant == 1 ? 3 : -1;
      c.mask = variant == 2 ? MaskKind::kBool : MaskKind::kNone;
      if (variant == 3) {
        c.sparse.kind = SparsePattern::Kind::kStrided;
        c.sparse.block_size = 2;
        c.sparse.stride = 4;
      }
      c.poison = 0.1;
      c.seed = ++seed;
      check_case(c, [&](const Problem&) { return tiled(4, 16, 0, 2); });
      check_case(c, [&](const Problem&) { return tiled(12, 64, 0, 1); });
    }
  // A future key full of NaN under causal masking: only the last row sees it.
  Case c;
  c.seqlen_q = 4;
  c.seqlen_k = 4;
  c.causal = true;
  Problem pr(c);
  pr.poison_row(0, 3, 0);
  for (const TestedTarget& t : tested_targets()) {
    cpu::Plan plan = tiled(4, 4, 0, 1);
    t.apply(plan);
    const Outputs f = run_fast(pr, plan);
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t x = 0; x < c.dv; ++x)
        EXPECT_TRUE(std::isfinite(f.out[pr.out_index(0, i, 0, x)])) << target_str(plan) << i;
    EXPECT_TRUE(std::isnan(f.out[pr.out_index(0, 3, 0, 0)])) << target_str(plan);
  }
}

TEST(AttentionFast, RowsWithoutVisibleKeysAreZero) {
  Case c;
  c.batch = 3;
  c.seqlen_q = 9;
  c.seqlen_k = 5;
  c.heads = 2;
  c.kv_heads = 1;
  c.causal = true;  // the first 4 rows sit before key 0
  c.seqlens = true;
  c.seed = 7;
  const Problem pr(c);
  const Outputs ref = run_reference(pr);
  for (const TestedTarget& t : tested_targets())
    for (int64_t split : {0, 2}) {
      cpu::Plan plan = tiled(3, 2, split, 2);
      t.apply(plan);
      const Outputs f = run_fast(pr, plan);
      expect_close(pr, ref, f, plan);
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t i = 0; i < 4; ++i) {
            EXPECT_EQ(f.lse[pr.lse_index(b, h, i)], -INFINITY);
            for (int64_t x = 0; x < c.dv; ++x) EXPECT_EQ(f.out[pr.out_index(b, i, h, x)], 0.0f);
          }
    }
}

// DeepSeek's absorbed MLA decode: 128 query heads share one latent kv head,
// keys are 576 wide, values are the first 512 columns of the same rows.
TEST(AttentionFast, AbsorbedMlaDecode) {
  uint64_t seed = 500;
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    for (int64_t sq : {1, 2}) {
      Case c;
      c.batch = 1;
      c.seqlen_q = sq;
      c.seqlen_k = 150;
      c.heads = 128;
      c.kv_heads = 1;
      c.d = 576;
      c.dv = 512;
      c.kv = kv;
      c.mla_view = true;
      c.causal = true;
      c.scale_block = kLatentScaleBlock;  // as LatentCache stores 8-bit rows
      c.seed = ++seed;
      check_case(c, [&](const Problem& pr) { return default_plan(pr, 2); });
      check_case(c, [&](const Problem&) { return tiled(1, 32, 64, 3); });
    }
}

// The vdpbf16ps path rounds scaled queries to bf16: its documented bound
// (2^-8 S on the scores) holds for queries and scales that bf16 cannot
// represent, prefill and decode shapes alike.
TEST(AttentionFast, Bf16DotProductsRoundQueriesWithinTheirBound) {
  uint64_t seed = 550;
  for (int64_t sq : {1, 3, 40}) {
    Case c;
    c.batch = 2;
    c.seqlen_q = sq;
    c.seqlen_k = 90;
    c.heads = 8;
    c.kv_heads = 2;
    c.d = 48;
    c.dv = 33;
    c.kv = DType::kBF16;
    c.causal = true;
    c.inexact_q = true;
    c.seed = ++seed;
    check_case(c, [&](const Problem& pr) { return default_plan(pr, 2); });
    check_case(c, [&](const Problem&) { return tiled(5, 16, 32, 3, 2); });
  }
}

// 8-bit K/V through every path the tile loop takes for them: 1-4 packed
// rows read the codes where they lie (qk_rows_i8 / _fp8, pv_i8 / _fp8,
// weights times the value scales), 5-31 rows dequantize K tiles into a copy
// (int8 keys of 5-16 rows: QK by groups of 4 rows where they lie, the plan's
// default, EightBitMultiTokenDecodeByRowGroups) and read V where it lies, more rows (and block
// scales, at any row count) dequantize both (as bf16 where the target has vdpbf16ps). Head dims
// below, at and past the kernels' 16-, 32- and 64-column chunks; masks, softcap, rings, pages,
// strided rows and scales, splits and several kv heads per task. The reference reads the same codes
// and scales, dequantized exactly.
TEST(AttentionFast, EightBitKvEveryPath) {
  uint64_t seed = 800;
  for (DType kv : {DType::kI8, DType::kFp8E4M3})
    for (int64_t d : {8, 33, 64, 128})
      for (int64_t tokens : {1, 2, 9})
        for (int64_t block : {0, 16, 32}) {
          if (block > 0 && d % 16 != 0) continue;
          Case c;
          c.batch = 2;
          c.seqlen_q = tokens;
          c.seqlen_k = 150;
          c.heads = 8;
          c.kv_heads = 2;
          c.d = d;
          c.dv = d == 33 ? 40 : d;
          c.kv = kv;
          c.causal = true;
          c.scale_block = block;
          c.seqlens = tokens != 2;
          c.softcap = tokens == 9 ? 3.0f : 0.0f;
          c.strided = d == 33;
          c.page_size = d == 64 ? 16 : 0;
          c.ring = d == 8 && tokens == 1;
          c.window_left = tokens == 9 ? 70 : -1;
          c.seed = ++seed;
          check_case(c, [&](const Problem& p, SimdTarget t) { return default_plan(p, 2, t); });
          check_case(c, [&](const Problem&) { return tiled(tokens, 16, 48, 3, 2); });
          // Dequantized copies of the other element type than the CPU's
          // vendor picks (tile_policy.h, dequantizes_to_bf16).
          if (tokens == 9 || block > 0)
            check_case(c, [&](const Problem& p, SimdTarget t) {
              cpu::Plan other = default_plan(p, 2, t);
              other.dequant_bf16 = !other.dequant_bf16;
              return other;
            });
        }
  // Masks and sparse patterns over 8-bit keys, with NaN rows behind them.
  for (DType kv : {DType::kI8, DType::kFp8E4M3})
    for (MaskKind m : {MaskKind::kBool, MaskKind::kAdd}) {
      Case c;
      c.batch = 2;
      c.seqlen_q = 3;
      c.seqlen_k = 77;
      c.heads = 4;
      c.kv_heads = 1;
      c.d = c.dv = 48;
      c.kv = kv;
      c.mask = m;
      c.poison = 0.05;
      c.seed = ++seed;
      check_case(c, [&](const Problem& p, SimdTarget t) { return default_plan(p, 2, t); });
      check_case(c, [&](const Problem&) { return tiled(2, 8, 0, 2); });
    }
}

// Codes of the largest magnitude in every position and keys whose scales
// differ by orders of magnitude: int8 QK's int16 queries and int32 sums at
// their limits (head_dim 576 takes the smaller int16 range), fp8's largest
// and subnormal codes, and per-key scales applied to the right keys.
TEST(AttentionFast, EightBitKvExtremeCodesAndScales) {
  uint64_t seed = 900;
  for (DType kv : {DType::kI8, DType::kFp8E4M3})
    for (int64_t d : {128, 576}) {
      Case c;
      c.seqlen_q = 1;
      c.seqlen_k = 70;
      c.heads = 4;
      c.kv_heads = 1;
      c.d = d;
      c.dv = 64;
      c.kv = kv;
      c.causal = true;
      c.seed = ++seed;
      Problem pr(c);
      pr.saturate_rows();
      const Outputs ref = run_reference(pr);
      for (const TestedTarget& t : tested_targets()) {
        cpu::Plan plan = default_plan(pr, 2, t.target);
        t.apply(plan);
        expect_close(pr, ref, run_fast(pr, plan), plan);
      }
    }
}

// Multi-token decode over int8 keys (5-16 packed rows per kv head): the
// plan's QK by groups of 4 int16 query rows over the codes where they lie
// (tile_policy.h, scores_int8_in_groups), and the dequantized copy it
// replaces, on every target: random codes behind masks with NaN rows,
// codes and scales at their extremes, rows past a multiple of 4 (5-7 rows:
// a group of pad rows), and a NaN key that only the last query row sees.
TEST(AttentionFast, EightBitMultiTokenDecodeByRowGroups) {
  uint64_t seed = 950;
  for (int64_t tokens : {2, 3, 4})
    for (int64_t group : {2, 4})
      for (int variant = 0; variant < 3; ++variant) {
        Case c;
        c.batch = 2;
        c.seqlen_q = tokens;
        c.seqlen_k = 700;  // split keys, several tiles per split
        c.heads = 3 * group;
        c.kv_heads = 3;
        c.d = variant == 2 ? 72 : 128;
        c.dv = variant == 2 ? 40 : 128;
        c.kv = DType::kI8;
        c.causal = true;
        c.seqlens = variant != 1;
        c.mask = variant == 0 ? MaskKind::kBool : MaskKind::kNone;
        c.poison = variant == 0 ? 0.05 : 0.0;
        c.page_size = variant == 2 ? 16 : 0;
        c.seed = ++seed;
        Problem pr(c);
        if (variant == 1) pr.saturate_rows();
        const Outputs ref = run_reference(pr);
        for (const TestedTarget& t : tested_targets())
          for (bool groups : {true, false}) {
            cpu::Plan plan = default_plan(pr, 2, t.target);
            EXPECT_EQ(plan.int8_score_groups, t.target != SimdTarget::kScalar && tokens * group > 4)
                << c.describe();
            plan.int8_score_groups = groups;
            plan.amx_qk = false;  // AMX's QK: AmxMultiTokenDecode
            t.apply(plan);
            const cpu::Geometry g = cpu::make_geometry(pr.params(nullptr, nullptr), plan);
            EXPECT_EQ(g.qk_groups, groups && tokens * group > 4 && g.kt->qk_rows_i8 != nullptr)
                << c.describe() << "\n"
                << plan_str(plan);
            expect_close(pr, ref, run_fast(pr, plan), plan);
          }
      }
  // A key full of NaN that only the last of 4 query rows sees (causal).
  Case c;
  c.seqlen_q = 4;
  c.seqlen_k = 100;
  c.heads = 8;
  c.kv_heads = 2;
  c.d = c.dv = 64;
  c.kv = DType::kI8;
  c.causal = true;
  c.seed = 999;
  Problem pr(c);
  pr.poison_row(0, 99, 1);
  for (const TestedTarget& t : tested_targets()) {
    cpu::Plan plan = default_plan(pr, 2, t.target);
    t.apply(plan);
    const Outputs f = run_fast(pr, plan);
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t h = 0; h < 8; ++h)
        EXPECT_EQ(std::isnan(f.out[pr.out_index(0, i, h, 0)]), i == 3 && h >= 4)
            << target_str(plan) << " row " << i << " head " << h;
  }
}

// Multi-token decode on AMX tiles (decode_amx.h; tile_policy.h,
// scores_on_amx): 5-16 packed rows per kv head, bf16 / int8 / fp8 K/V, head
// dims 64-256 with head_dim_v apart from head_dim, against the reference:
// causal (bottom-right) with ragged valid-key counts, windows, softcap,
// sinks, boolean masks over NaN rows, saturated codes and scales, paged
// and strided K/V, split and unsplit keys, and the plan with AMX's QK only
// (the FMA / VNNI P V after it). int8 keys go through AMX-INT8 (their codes
// against the int16 queries split in two int8 halves), the others through
// bf16 tiles. fp32 K/V never take it, nor do
// batch-invariant plans, avx512 / avx2 targets or tiles of 1-4 rows.
// Over 8-bit K/V the bound is the one of what this path rounds (queries
// and weights split in two bf16 parts, kUBf16Split), not the vdpbf16ps
// kernels' single bf16 rounding: a 1 % error in the value scales (or the
// key scales) fails it, where the looser bound let it through.
TEST(AttentionFast, AmxMultiTokenDecode) {
  if (!amx_bf16_available() || !simd_target_available(SimdTarget::kAvx512Bf16))
    GTEST_SKIP() << "this CPU (or OS) offers no AMX-BF16 tiles to the avx512bf16 target";
  uint64_t seed = 1400;
  int cases = 0;
  for (DType kv : {DType::kBF16, DType::kI8, DType::kFp8E4M3})
    for (int64_t d : {64, 128, 192, 256})
      for (int64_t tokens : {2, 3, 4}) {
        const int64_t group = d == 64 ? 2 : d == 128 ? 4 : d == 192 ? 5 : 3;
        if (tokens * group <= 4 || tokens * group > 16) continue;
        Case c;
        c.batch = 2;
        c.seqlen_q = tokens;
        c.seqlen_k = d == 128 ? 700 : 150 + 37 * tokens;  // split keys, and a short last tile
        c.heads = 2 * group;
        c.kv_heads = 2;
        c.d = d;
        c.dv = d == 192 ? 128 : d == 64 ? 80 : d;
        c.kv = kv;
        c.seed = ++seed;
        const int variant = cases++ % 5;
        c.causal = variant != 1;
        c.seqlens = variant == 0 || variant == 3;
        if (variant == 1) c.window_left = 40, c.window_right = 3;
        if (variant == 2) c.softcap = 20.0f, c.sink = 0.5f, c.page_size = 16;
        if (variant == 3) c.mask = MaskKind::kBool, c.poison = 0.05, c.strided = true;
        if (variant == 4) c.window_left = 100, c.window_right = 0, c.page_size = 7;
        if (kv == DType::kBF16) c.inexact_q = variant % 2 == 0;
        Problem pr(c);
        if (variant == 4 && kv != DType::kBF16) pr.saturate_rows();
        const Outputs ref = run_reference(pr);
        for (bool pv : {true, false}) {
          cpu::Plan plan = default_plan(pr, 2, SimdTarget::kAvx512Bf16);
          // int8 keys take AMX-INT8 (their codes as they are), from 13
          // rows on; forced here for 5-12 rows too.
          const bool takes = kv != DType::kI8 || amx_int8_available();
          EXPECT_EQ(plan.amx_qk && plan.amx_pv,
                    takes && (kv != DType::kI8 || tokens * group >= cpu::kAmxInt8MinRows))
              << c.describe();
          plan.amx_qk = takes;
          plan.amx_pv = takes && pv;
          const cpu::Geometry g = cpu::make_geometry(pr.params(nullptr, nullptr), plan);
          EXPECT_EQ(g.amx_qk, takes) << c.describe() << "\n" << plan_str(plan);
          EXPECT_EQ(g.amx_pv, takes && pv) << c.describe() << "\n" << plan_str(plan);
          EXPECT_EQ(g.amx_int8, takes && kv == DType::kI8) << c.describe();
          expect_close(pr, ref, run_fast(pr, plan), plan);
        }
      }
  // Never for fp32 K/V, 1-4 rows, batch invariance or the lower targets.
  Case c;
  c.seqlen_q = 4;
  c.seqlen_k = 100;
  c.heads = 8;
  c.kv_heads = 2;
  c.d = c.dv = 64;
  c.kv = DType::kF32;
  EXPECT_FALSE(default_plan(Problem(c), 2, SimdTarget::kAvx512Bf16).amx_qk);
  c.kv = DType::kBF16;
  EXPECT_TRUE(default_plan(Problem(c), 2, SimdTarget::kAvx512Bf16).amx_qk);
  EXPECT_FALSE(default_plan(Problem(c), 2, SimdTarget::kAvx512).amx_qk);
  EXPECT_FALSE(default_plan(Problem(c), 2, SimdTarget::kAvx2).amx_qk);
  c.seqlen_q = 1;
  EXPECT_FALSE(default_plan(Problem(c), 2, SimdTarget::kAvx512Bf16).amx_qk);
  c.seqlen_q = 4;
  Problem invariant(c);
  AttentionParams p = invariant.params(nullptr, nullptr);
  p.batch_invariant = true;
  EXPECT_FALSE(cpu::make_plan(p, SimdTarget::kAvx512Bf16, 2).amx_qk);
}

// ---- randomized sweep ----------------------------------------------------

// Decode with the default plans: tasks walk up to kInterleaveMaxHeads kv
// heads of a batch item together (20 kv heads: a block of 16 and one of
// 4), with split keys (700) and without (300), batch 1 and 3, 1-8 tokens
// (2-16 packed rows per kv head: AVX2 tiles up to kShortTileMaxRows rows
// with 12 or 24 keys, whose splits of kSplitKeys end in a shorter tile).
TEST(AttentionFast, DecodeDefaultPlansOverManyKvHeadsAndBatches) {
  uint64_t seed = 650;
  for (int64_t batch : {1, 3})
    for (int64_t seqlen_k : {300, 700})
      for (int64_t tokens : {1, 4, 8})
        for (DType kv : {DType::kF32, DType::kBF16}) {
          Case c;
          c.batch = batch;
          c.seqlen_q = tokens;
          c.seqlen_k = seqlen_k;
          c.heads = 40;
          c.kv_heads = 20;
          c.d = c.dv = 24;
          c.kv = kv;
          c.causal = true;
          c.seqlens = batch > 1;
          c.seed = ++seed;
          const Problem pr(c);
          const cpu::Plan plan = default_plan(pr, 2);
          EXPECT_EQ(plan.kv_heads_per_task, cpu::kInterleaveMaxHeads) << c.describe();
          EXPECT_EQ(plan.split_k > 0, seqlen_k > cpu::kSplitKeys) << c.describe();
          check_case(c, [&](const Problem& p, SimdTarget t) { return default_plan(p, 2, t); });
          // The other tile walk than the target's default (tile_policy.h).
          check_case(c, [&](const Problem& p, SimdTarget t) {
            cpu::Plan other = default_plan(p, 2, t);
            other.k_then_v = !other.k_then_v;
            return other;
          });
        }
}

// Head dims of real models (64-256) span several of the kernels' 64-column
// blocks and 16-lane vectors; decode tiles (1-4 rows per kv head, the
// rows_qk and bf16 P V kernels) and prefill tiles are checked at the
// dims around those boundaries. (The bf16 decode P V once offset its
// second 64-column block twice; every smaller dim missed it.)
TEST(AttentionFast, HeadDimsAcrossColumnBlocks) {
  uint64_t seed = 700;
  const int64_t dims[][2] = {{64, 63},   {64, 64},   {64, 65},   {96, 96},  {128, 128},
                             {128, 129}, {192, 128}, {256, 200}, {576, 512}};
  for (const auto& dd : dims)
    for (int64_t tokens : {1, 2, 9})
      for (int64_t group : {1, 4})
        for (DType kv : {DType::kF32, DType::kBF16}) {
          Case c;
          c.seqlen_q = tokens;
          c.seqlen_k = 150;
          c.kv_heads = 2;
          c.heads = 2 * group;
          c.d = dd[0];
          c.dv = dd[1];
          c.kv = kv;
          c.causal = true;
          c.seed = ++seed;
          check_case(c, [&](const Problem& p) { return default_plan(p, 2); });
          check_case(c, [&](const Problem&) { return tiled(tokens, 64, 64, 3, 2); });
        }
}

// Keys behind a block table (PagedKVCache's layout) in pages of 1, 3, 16
// and 64 rows, and ragged query rows (sdpa_varlen, a batch that mixes
// prefill chunks and decodes): the runs a page cuts a tile into, the
// prefetch distances into the next tile's pages, and row blocks past a
// short item's rows. Unreferenced pages and the rows between pages hold
// NaN, so reading a wrong page shows as NaN.
TEST(AttentionFast, PagedKeysAndRaggedQueries) {
  uint64_t seed = 750;
  for (int64_t page_size : {1, 3, 16, 64})
    for (bool ragged : {false, true})
      for (int64_t seqlen_q : {1, 4, 19})
        for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
          Case c;
          c.batch = 3;
          c.seqlen_q = seqlen_q;
          c.seqlen_k = seqlen_q == 4 ? 700 : 150;  // 700: split keys in decode plans
          c.heads = 8;
          c.kv_heads = 2;
          c.d = 32;
          c.dv = 24;
          c.kv = kv;
          c.causal = true;
          c.seqlens = true;
          c.page_size = page_size;
          c.ragged = ragged;
          c.window_left = seqlen_q == 19 ? 40 : -1;
          c.seed = ++seed;
          check_case(c, [&](const Problem& p, SimdTarget t) { return default_plan(p, 2, t); });
          check_case(c, [&](const Problem&) { return tiled(5, 16, 48, 3, 2); });
        }
}

Case random_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int64_t> xs) {
    std::uniform_int_distribution<size_t> u(0, xs.size() - 1);
    return *(xs.begin() + u(rng));
  };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  Case c;
  c.seed = seed;
  c.batch = pick({1, 1, 2, 3});
  c.seqlen_q = pick({1, 2, 3, 4, 7, 16, 17, 33});
  c.seqlen_k = pick({1, 5, 16, 31, 64, 65, 80});
  const int64_t heads[][2] = {{1, 1}, {2, 1}, {4, 2}, {6, 3}, {8, 2}, {5, 5}};
  const auto& hg = heads[pick({0, 1, 2, 3, 4, 5})];
  c.heads = hg[0];
  c.kv_heads = hg[1];
  c.d = pick({1, 3, 8, 16, 17, 32, 40});
  c.mla_view = chance(0.15);
  c.dv = c.mla_view ? std::max<int64_t>(1, c.d - pick({0, 1, 5})) : pick({1, 5, 16, 31, 33});
  c.kv = chance(0.3)    ? DType::kBF16
         : chance(0.3)  ? DType::kI8
         : chance(0.25) ? DType::kFp8E4M3
                        : DType::kF32;
  if (is_kv_quantized(c.kv) && c.d % 16 == 0 && c.dv % 16 == 0 && chance(0.3))
    c.scale_block = pick({16, 32});
  c.causal = chance(0.5);
  if (chance(0.3)) {
    c.window_left = pick({-1, 0, 3, 10});
    c.window_right = pick({-1, 0, 2});
  }
  if (chance(0.2)) c.softcap = 2.0f;
  c.seqlens = chance(0.3);
  c.q_offsets = !c.seqlens && chance(0.15);
  const int64_t mask = pick({0, 0, 0, 1, 2});
  c.mask = static_cast<MaskKind>(mask);
  c.mask_broadcast = chance(0.5);
  if (chance(0.2)) {
    c.sparse.kind = chance(0.5) ? SparsePattern::Kind::kStrided : SparsePattern::Kind::kFixed;
    c.sparse.block_size = pick({1, 2, 4});
    c.sparse.stride = pick({1, 2, 3});
    c.sparse.summary = 1;
  }
  c.ring = chance(0.15);
  if (!c.ring && chance(0.25)) c.page_size = pick({1, 3, 16});
  c.ragged = chance(0.25);
  c.strided = chance(0.3);
  c.poison = chance(0.15) ? 0.1 : 0.0;
  if (chance(0.2)) c.chunk_size = pick({1, 3, 8, 16, 17, 100});
  if (chance(0.2)) c.sink = static_cast<float>(pick({-20, -1, 1, 4, 50}));
  return c;
}

TEST(AttentionFast, RandomCasesEveryTargetTilingAndThreadCount) {
  for (uint64_t seed = 1; seed <= 120; ++seed) {
    const Case c = random_case(seed * 7919);
    std::mt19937_64 rng(seed);
    auto pick = [&](std::initializer_list<int64_t> xs) {
      std::uniform_int_distribution<size_t> u(0, xs.size() - 1);
      return *(xs.begin() + u(rng));
    };
    cpu::Plan random_tiling =
        tiled(pick({1, 2, 3, 5, 8, 64}), pick({1, 2, 7, 16, 64}), pick({0, 0, 1, 5, 16, 64}),
              static_cast<int>(pick({1, 2, 3, 7})), pick({1, 1, 2, 3}));
    random_tiling.k_then_v = pick({0, 1}) == 1;
    random_tiling.fetch_sweep_ahead = pick({0, 1}) == 1;
    random_tiling.dequant_bf16 = pick({0, 1}) == 1;
    random_tiling.int8_score_groups = pick({0, 1}) == 1;
    const int threads = static_cast<int>(pick({1, 2, 3, 7}));
    check_case(c, [&](const Problem&) { return random_tiling; });
    check_case(c, [&](const Problem& pr) { return default_plan(pr, threads); });
  }
}

// ---- determinism -----------------------------------------------------------

// Decode-shaped calls split their keys; the split size depends on shapes
// only, so outputs are the same bits for any thread count and every run.
TEST(AttentionFast, DecodeIsBitIdenticalAcrossThreadCounts) {
  uint64_t seed = 600;
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    for (int64_t sq : {1, 4, 16}) {
      Case c;
      c.batch = 3;
      c.seqlen_q = sq;
      c.seqlen_k = 1500;
      c.heads = 8;
      c.kv_heads = 2;
      c.d = 64;
      c.dv = 64;
      c.kv = kv;
      c.causal = true;
      c.seqlens = true;  // caches of different lengths
      c.page_size = sq == 4 ? 16 : 0;
      c.seed = ++seed;
      const Problem pr(c);
      const Outputs ref = run_reference(pr);
      for (const TestedTarget& t : tested_targets()) {
        cpu::Plan plan = default_plan(pr, 1, t.target);
        t.apply(plan);
        ASSERT_GT(plan.split_k, 0) << "decode shapes are expected to split";
        const Outputs first = run_fast(pr, plan);
        expect_close(pr, ref, first, plan);
        for (int threads : {1, 2, 3, 7, 2}) {
          plan.num_threads = threads;
          const Outputs again = run_fast(pr, plan);
          EXPECT_EQ(0, std::memcmp(first.out.data(), again.out.data(), first.out.size() * 4))
              << plan_str(plan) << " " << c.describe();
          EXPECT_EQ(0, std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * 4))
              << plan_str(plan) << " " << c.describe();
        }
      }
    }
}

// ---- dispatch ----------------------------------------------------------------

TensorView view_of(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return make_view(data, dtype, shape);
}

// q, k, v of one call, uniform in [-2, 2).
struct Qkv {
  std::vector<float> q, k, v;
};

Qkv random_qkv(int64_t q_elems, int64_t kv_elems, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2, 2);
  Qkv x{std::vector<float>(q_elems), std::vector<float>(kv_elems), std::vector<float>(kv_elems)};
  for (auto* t : {&x.q, &x.k, &x.v})
    for (float& e : *t) e = u(rng);
  return x;
}

TEST(AttentionFast, DispatchRoutesBackendsAndFallsBack) {
  const int64_t B = 2, S = 20, H = 4, HKV = 2, D = 16;
  Qkv in = random_qkv(B * S * H * D, B * S * HKV * D, 9);
  auto run = [&](Backend backend, bool with_probs) {
    Outputs r{std::vector<float>(B * S * H * D), std::vector<float>(B * H * S)};
    std::vector<float> probs(with_probs ? B * H * S * S : 0);
    AttentionOptions o;
    o.causal = true;
    o.backend = backend;
    o.num_threads = 3;
    const Status st =
        sdpa(view_of(in.q.data(), DType::kF32, {B, S, H, D}),
             view_of(in.k.data(), DType::kF32, {B, S, HKV, D}),
             view_of(in.v.data(), DType::kF32, {B, S, HKV, D}),
             view_of(r.out.data(), DType::kF32, {B, S, H, D}), o,
             view_of(r.lse.data(), DType::kF32, {B, H, S}),
             with_probs ? view_of(probs.data(), DType::kF32, {B, H, S, S}) : TensorView{});
    EXPECT_TRUE(st.ok()) << st.to_string();
    return r;
  };
  const SimdTarget before = simd_target();
  const Outputs ref = run(Backend::kReference, false);
  for (SimdTarget t : available_targets()) {
    ASSERT_TRUE(set_simd_target(t));
    const Outputs fast = run(Backend::kFast, false), autod = run(Backend::kAuto, false);
    // kAuto and kFast run the same fast kernel (unless ATTNKIT_BACKEND=reference
    // sends kAuto to the reference): the same bits.
    if (resolve_backend(Backend::kAuto) == Backend::kAuto) {
      EXPECT_EQ(fast.out, autod.out) << simd_target_name(t);
    }
    // ...which is not the reference's double-accumulated result bit for bit,
    double worst = 0;
    for (size_t x = 0; x < ref.out.size(); ++x)
      worst = std::max(worst, double(std::fabs(ref.out[x] - fast.out[x])));
    EXPECT_LT(worst, 1e-5) << simd_target_name(t);
    // ...while asking for probabilities falls back to the reference exactly.
    EXPECT_EQ(run(Backend::kAuto, true).out, ref.out) << simd_target_name(t);
  }
  ASSERT_TRUE(set_simd_target(before));

  AttentionParams p;
  p.k_stride.dim = 2;
  EXPECT_FALSE(cpu::supports(p));  // K rows not contiguous: reference
  p.k_stride.dim = 1;
  EXPECT_TRUE(cpu::supports(p));
  float probs;
  p.probs = &probs;
  EXPECT_FALSE(cpu::supports(p));
}

// set_kernels_for_testing: how the fuzzer runs tables the CPU cannot select.
int g_softmax_calls = 0;

void counting_softmax(float* s, int64_t nk, int64_t m_pad, int64_t s_stride, float* row_max,
                      float* row_sum, float* alpha) {
  ++g_softmax_calls;
  cpu::scalar_kernel_table()->softmax(s, nk, m_pad, s_stride, row_max, row_sum, alpha);
}

TEST(AttentionFast, DispatchRunsKernelsSetForTesting) {
  const int64_t B = 1, S = 40, H = 4, HKV = 2, D = 24;
  Qkv in = random_qkv(B * S * H * D, B * S * HKV * D, 12);
  auto run = [&](Backend backend) {
    std::vector<float> out(B * S * H * D);
    AttentionOptions o;
    o.causal = true;
    o.backend = backend;
    o.num_threads = 2;
    const Status st = sdpa(view_of(in.q.data(), DType::kF32, {B, S, H, D}),
                           view_of(in.k.data(), DType::kF32, {B, S, HKV, D}),
                           view_of(in.v.data(), DType::kF32, {B, S, HKV, D}),
                           view_of(out.data(), DType::kF32, {B, S, H, D}), o);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  };
  // However the test ends (an ASSERT returns early), later tests must find
  // the dispatcher as it was.
  struct Restore {
    SimdTarget target = simd_target();
    ~Restore() {
      set_kernels_for_testing(SimdTarget::kScalar, nullptr);
      set_simd_target(target);
    }
  } restore;
  ASSERT_TRUE(set_simd_target(SimdTarget::kScalar));
  const std::vector<float> scalar = run(Backend::kFast);

  // The scalar table with a counting softmax, set while the active target
  // is another one where there is one: the call runs it, whatever is active.
  cpu::KernelTable counting = *cpu::scalar_kernel_table();
  counting.softmax = counting_softmax;
  ASSERT_TRUE(set_simd_target(available_targets().back()));
  set_kernels_for_testing(SimdTarget::kScalar, &counting);
  g_softmax_calls = 0;
  EXPECT_EQ(run(Backend::kFast), scalar);  // the scalar plan and kernels: the same bits
  EXPECT_GT(g_softmax_calls, 0);
  // The reference backend is not affected.
  g_softmax_calls = 0;
  const std::vector<float> ref = run(Backend::kReference);
  EXPECT_EQ(g_softmax_calls, 0);
  set_kernels_for_testing(SimdTarget::kScalar, nullptr);
  run(Backend::kFast);
  EXPECT_EQ(g_softmax_calls, 0);

#if defined(ATTNKIT_TEST_AVX512_EMULATION)
  // Through the public API on the emulated AVX-512 tables (against the
  // reference; fp32 K/V, so vdpbf16ps plays no part).
  for (const cpu::KernelTable* table :
       {cpu::emulated_avx512_kernel_table(), cpu::emulated_avx512bf16_kernel_table()}) {
    set_kernels_for_testing(SimdTarget::kAvx512, table);
    const std::vector<float> emulated = run(Backend::kFast);
    set_kernels_for_testing(SimdTarget::kScalar, nullptr);
    double worst = 0;
    for (size_t x = 0; x < ref.size(); ++x)
      worst = std::max(worst, double(std::fabs(ref[x] - emulated[x])));
    EXPECT_LT(worst, 1e-5);
  }
#endif
}

// Key tiles wholly outside a query block's chunk are never computed: with
// chunks of one tile, causal, each query block's task visits one tile per
// kv head (against 1 + 2 + ... + blocks without chunks).
TEST(AttentionFast, TilesOutsideTheChunkAreSkipped) {
  Case c;
  c.seqlen_q = c.seqlen_k = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.d = c.dv = 8;
  c.causal = true;
  cpu::KernelTable counting = *cpu::scalar_kernel_table();
  counting.softmax = counting_softmax;
  for (int64_t chunk : {0, 16, 32}) {
    c.chunk_size = chunk;
    const Problem pr(c);
    cpu::Plan plan = tiled(16, 16, 0, 1);
    plan.kernels = &counting;
    g_softmax_calls = 0;
    const Outputs fast = run_fast(pr, plan);
    // 4 query blocks of 16 rows; block q sees tiles [q - q % (chunk / 16), q].
    const int64_t per_head = chunk == 0 ? 1 + 2 + 3 + 4 : chunk == 16 ? 4 : 1 + 2 + 1 + 2;
    EXPECT_EQ(g_softmax_calls, per_head * c.kv_heads) << "chunk " << chunk;
    expect_close(pr, run_reference(pr), fast, plan);
  }
}

// The online-softmax step of every target (KernelTable::softmax, whose
// weights the AVX targets compute as 2^((s - max) log2 e)) against exp in
// float64, over score spreads up to 400 (weights down to e^-400, below
// fp32's smallest subnormal), with -inf scores (weights exactly 0), a column
// of none but -inf (alpha 0, sums 0) and running maxima above and below the
// tile's. Each weight within 8 + 2 |s - max| ulp of the true one (the
// difference is rounded to fp32 before any exp), or within the smallest
// normal where the true one is below it (fp32 flushes those toward 0).
TEST(AttentionFast, SoftmaxStepOfEveryTargetOverWideScoreRanges) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (SimdTarget t : available_targets()) {
    const cpu::KernelTable& kt = *cpu::kernel_table(t);
    std::mt19937 rng(11);
    for (int64_t nk : {1, 7, 64}) {
      const int64_t m_pad = 3 * kt.lanes, ss = cpu::odd_line_stride(m_pad);
      // s [nk][ss]: column m spreads its scores over `spread`.
      std::vector<float> s(static_cast<size_t>(nk * ss), 0.0f);
      std::vector<float> row_max(static_cast<size_t>(m_pad)), row_sum(row_max.size(), 0.5f),
          alpha(row_max.size());
      for (int64_t m = 0; m < m_pad; ++m) {
        const float spread = m % 3 == 0 ? 1.0f : m % 3 == 1 ? 40.0f : 400.0f;
        std::uniform_real_distribution<float> u(-spread, spread);
        for (int64_t n = 0; n < nk; ++n)
          s[n * ss + m] = (n + m) % 5 == 4 ? ninf : u(rng) + (m % 4 == 0 ? 80.0f : 0.0f);
        row_max[m] = m % 2 == 0 ? ninf : u(rng);
      }
      for (int64_t n = 0; n < nk; ++n) s[n * ss + 1] = ninf;  // a column with no finite score
      row_max[1] = ninf;
      const std::vector<float> s0 = s, max0 = row_max, sum0 = row_sum;
      kt.softmax(s.data(), nk, m_pad, ss, row_max.data(), row_sum.data(), alpha.data());
      for (int64_t m = 0; m < m_pad; ++m) {
        double mx = max0[m];
        for (int64_t n = 0; n < nk; ++n) mx = std::max(mx, double(s0[n * ss + m]));
        ASSERT_EQ(row_max[m], float(mx)) << simd_target_name(t) << " column " << m;
        const double shift = std::isinf(mx) ? 0.0 : mx;
        double sum = 0;
        for (int64_t n = 0; n < nk; ++n) {
          const double want = std::exp(double(s0[n * ss + m]) - shift);
          const float got = s[n * ss + m];
          sum += got;
          if (s0[n * ss + m] == ninf) {
            ASSERT_EQ(got, 0.0f) << simd_target_name(t) << " key " << n << " column " << m;
            continue;
          }
          // The difference s - max is rounded to fp32 (and scaled by log2
          // e), which costs up to |s - max| ulp of the weight besides exp's
          // few.
          const double diff = std::abs(double(s0[n * ss + m]) - shift);
          const double bound =
              std::max((8 + 2 * diff) * kU * want, double(std::numeric_limits<float>::min()));
          ASSERT_LE(std::abs(got - want), bound)
              << simd_target_name(t) << " nk " << nk << " key " << n << " column " << m
              << ": score " << s0[n * ss + m] << ", max " << mx;
        }
        const double a = std::exp(double(max0[m]) - shift);
        const double alpha_bound =
            a == 0 ? 0.0 : (8 + 2 * std::abs(double(max0[m]) - shift)) * kU * a;
        EXPECT_LE(std::abs(alpha[m] - a), std::max(alpha_bound, 1e-37)) << simd_target_name(t);
        const double want_sum = sum0[m] * a + sum;
        EXPECT_LE(std::abs(row_sum[m] - want_sum), 8 * kU * (want_sum + 1e-30) * nk)
            << simd_target_name(t) << " column " << m;
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::kernels
