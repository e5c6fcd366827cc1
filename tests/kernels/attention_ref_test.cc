// sdpa with Backend::kReference against the float64 oracle in
// tests/common/attention_f64.h, on seeded random inputs across shapes, head
// groupings, masks, sparse patterns, strided views, bf16 K/V and the
// NaN/Inf/fully-masked edge cases; plus merge_attention_states.
//
// Error bound (derivation). Both sides see bit-identical inputs: q/k/v are
// fp32 (or bf16, which converts to fp32 exactly) and every such value is
// exact in double. The reference kernel accumulates in double, so the only
// differences are
//   (a) the final rounding of out/lse/probs to fp32: <= u|x|, u = 2^-24;
//   (b) the default softmax_scale: the kernel multiplies by the fp32 value of
//       1/sqrt(head_dim), the oracle by the double one, so every score moves
//       by <= u|s| <= u*S (S = max |score|). Softmax is shift invariant, so
//       each probability moves by a relative <= 2uS, out by <= 2uS * max|v|,
//       lse by <= uS. An explicit softmax_scale is the same fp32 value on
//       both sides and costs nothing;
//   (c) double rounding in dot products (length head_dim) and sums (length
//       seqlen_k): <= (head_dim + seqlen_k) * 2^-53 relative, first order.
// Hence rel = 2 * (u (1 + 2S) + 4 (head_dim + seqlen_k) 2^-53), a factor 2 of
// margin for second-order terms, and |out - ref| <= rel (max|v| + |ref|),
// |lse - ref| <= rel (1 + S + |ref|), |probs - ref| <= rel |ref| + 2^-149
// (the last term is half a subnormal ulp). With |q|,|k| < 1 and
// S <= scale * head_dim <= sqrt(head_dim) <= 8 this is < 2.1e-6, well under
// the 1e-5 the project allows for fp32, and every case asserts rel <= 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"
#include "common/attention_f64.h"
#include "common/random.h"

namespace {

using attnkit::Backend;
using attnkit::bf16;
using attnkit::DType;
using attnkit::SparsePattern;
using attnkit::TensorView;
using attnkit_test::all_close;
using attnkit_test::OracleOptions;
using attnkit_test::OracleResult;
using attnkit_test::Rng;
using attnkit_test::Tolerance;

constexpr double kU32 = 0x1p-24;
constexpr double kU64 = 0x1p-53;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kOutSentinel = -777.0f;  // unwritten output shows up as this

// Worst error seen across the whole file, as a fraction of the derived bound
// and as a relative error; printed once at the end of the run.
struct Worst {
  double ratio = 0.0;
  double rel = 0.0;
  std::string where;
};
Worst g_worst;

class WorstReporter : public ::testing::Environment {
 public:
  void TearDown() override {
    if (g_worst.where.empty()) return;
    std::printf("[ attention_ref_test ] worst error: %.3g of the bound, relative %.3g (%s)\n",
                g_worst.ratio, g_worst.rel, g_worst.where.c_str());
  }
};
[[maybe_unused]] ::testing::Environment* const g_reporter =
    ::testing::AddGlobalTestEnvironment(new WorstReporter);

void note_worst(double ratio, double rel, const std::string& where) {
  if (ratio > g_worst.ratio) g_worst = {ratio, ratio * rel, where};
}

// ---------------------------------------------------------------------------
// Buffers whose logical elements sit at arbitrary strides inside a larger
// allocation. The gaps hold a sentinel: NaN for inputs (a stray read poisons
// the result), kOutSentinel for outputs (a stray write is detected).

template <typename T>
struct Strided {
  std::vector<T> storage;
  TensorView view;

  int64_t offset(std::array<int64_t, 4> idx) const {
    int64_t off = 0;
    for (int d = 0; d < view.rank; ++d) off += idx[size_t(d)] * view.strides[size_t(d)];
    return off;
  }
  T& at(std::array<int64_t, 4> idx) { return storage[size_t(offset(idx))]; }
};

// `order` lists the dims from outermost to innermost in memory, `pad` adds
// unused elements to each dim's extent, and the innermost dim advances by
// `step` elements (step > 1 interleaves with unused slots).
template <typename T>
Strided<T> make_strided(DType dtype, int rank, std::array<int64_t, 4> shape,
                        std::array<int, 4> order, std::array<int64_t, 4> pad, int64_t step,
                        T fill) {
  Strided<T> s;
  s.view.dtype = dtype;
  s.view.rank = rank;
  int64_t running = step;
  for (int n = rank - 1; n >= 0; --n) {
    const int d = order[size_t(n)];
    s.view.shape[size_t(d)] = shape[size_t(d)];
    s.view.strides[size_t(d)] = running;
    running *= shape[size_t(d)] + pad[size_t(d)];
  }
  s.storage.assign(size_t(std::max<int64_t>(running, 1)), fill);
  s.view.data = s.storage.data();
  return s;
}

template <typename T>
Strided<T> make_contiguous(DType dtype, int rank, std::array<int64_t, 4> shape, T fill) {
  return make_strided<T>(dtype, rank, shape, {0, 1, 2, 3}, {0, 0, 0, 0}, 1, fill);
}

// Calls f(idx) for every logical index of a rank-4 (or rank-3) shape.
void for_each_index(int rank, std::array<int64_t, 4> shape,
                    const std::function<void(std::array<int64_t, 4>)>& f) {
  if (rank == 3) shape[3] = 1;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) f({a, b, c, d});
}

// True when every storage element outside the view still holds `sentinel`.
::testing::AssertionResult gaps_untouched(const std::string& what, const Strided<float>& s,
                                          float sentinel) {
  std::vector<uint8_t> logical(s.storage.size(), 0);
  for_each_index(s.view.rank, s.view.shape,
                 [&](std::array<int64_t, 4> idx) { logical[size_t(s.offset(idx))] = 1; });
  for (size_t i = 0; i < s.storage.size(); ++i)
    if (!logical[i] && std::memcmp(&s.storage[i], &sentinel, sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << what << ": element " << i << " outside the view was overwritten with "
             << s.storage[i];
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------
// One randomized case: shapes, options, layout; run() checks sdpa against the
// oracle and returns both for further checks.

enum class MaskKind { kNone, kBool, kAdditive };

struct Case {
  int64_t batch = 1, seqlen_q = 4, seqlen_k = 4, num_heads = 1, num_kv_heads = 1, head_dim = 8,
          head_dim_v = 8;
  float softmax_scale = 0.0f;
  bool causal = false;
  attnkit::WindowSize window;
  float softcap = 0.0f;
  std::vector<int32_t> seqlens_k;
  MaskKind mask = MaskKind::kNone;
  std::array<bool, 4> mask_full{true, true, true, true};  // false = size-1 broadcast dim
  double mask_keep = 0.75;                                // bool: P(true); additive: P(not -inf)
  bool mask_expanded = false;  // broadcast dims given as full size with stride 0
  SparsePattern sparse;
  int64_t chunk_size = 0;
  std::vector<float> sinks;  // [num_heads]; empty = none
  bool bf16_kv = false;
  bool strided = false;
  bool want_lse = true, want_probs = true;
  int num_threads = 0;
  uint64_t seed = 1;
  // Edits the logical (contiguous) q/k/v before the call.
  std::function<void(std::vector<float>& q, std::vector<float>& k, std::vector<float>& v)> mutate;

  std::string describe() const {
    std::ostringstream s;
    s << "b" << batch << " sq" << seqlen_q << " sk" << seqlen_k << " h" << num_heads << "/"
      << num_kv_heads << " d" << head_dim << "/" << head_dim_v << " scale" << softmax_scale
      << (causal ? " causal" : "") << " win(" << window.left << "," << window.right << ")"
      << " cap" << softcap << " lens[";
    for (int32_t n : seqlens_k) s << n << ",";
    s << "] mask" << int(mask) << "(" << mask_full[0] << mask_full[1] << mask_full[2]
      << mask_full[3] << (mask_expanded ? "e" : "") << ") sparse" << int(sparse.kind) << "/"
      << sparse.block_size << "/" << sparse.stride << "/" << sparse.summary << " chunk"
      << chunk_size << " sinks[";
    for (float x : sinks) s << x << ",";
    s << "]" << (bf16_kv ? " bf16" : "") << (strided ? " strided" : "") << " thr" << num_threads
      << " seed" << seed;
    return s.str();
  }
};

struct Outcome {
  OracleResult ref;
  std::vector<float> out, lse, probs;  // logical contiguous copies of sdpa's outputs
  std::vector<float> q, k, v;          // logical inputs as fed (K/V bf16-rounded if bf16)
  double rel = 0.0;                    // the derived bound
};

double derived_rel(const Case& c, double qmax, double kmax) {
  // S only matters through the default scale's fp32 rounding, see the top.
  const double s_max = c.softmax_scale == 0.0f
                           ? qmax * kmax * double(c.head_dim) / std::sqrt(double(c.head_dim))
                           : 0.0;
  return 2.0 * (kU32 * (1.0 + 2.0 * s_max) + 4.0 * double(c.head_dim + c.seqlen_k) * kU64);
}

double max_abs_finite(const std::vector<float>& x) {
  double m = 0.0;
  for (float e : x)
    if (std::isfinite(e)) m = std::max(m, double(std::fabs(e)));
  return m;
}

OracleOptions oracle_options(const Case& c) {
  OracleOptions o;
  o.batch = c.batch;
  o.seqlen_q = c.seqlen_q;
  o.seqlen_k = c.seqlen_k;
  o.num_heads = c.num_heads;
  o.num_kv_heads = c.num_kv_heads;
  o.head_dim = c.head_dim;
  o.head_dim_v = c.head_dim_v;
  o.softmax_scale = c.softmax_scale;
  o.causal = c.causal;
  o.window_left = c.window.left;
  o.window_right = c.window.right;
  o.softcap = c.softcap;
  o.seqlens_k = c.seqlens_k;
  o.sparse = c.sparse;
  o.chunk_size = c.chunk_size;
  for (float x : c.sinks) o.sinks.push_back(x);
  return o;
}

Outcome run(const Case& c) {
  SCOPED_TRACE(c.describe());
  Outcome res;
  Rng rng(c.seed);
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.num_heads,
                Hkv = c.num_kv_heads, D = c.head_dim, Dv = c.head_dim_v;
  res.q = attnkit_test::uniform_vector(size_t(B * Sq * H * D), rng);
  res.k = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * D), rng);
  res.v = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * Dv), rng);
  if (c.mutate) c.mutate(res.q, res.k, res.v);
  if (c.bf16_kv) {
    for (float& x : res.k) x = attnkit_test::round_bf16(x);
    for (float& x : res.v) x = attnkit_test::round_bf16(x);
  }

  // Mask content over its own (possibly broadcast) shape.
  OracleOptions o = oracle_options(c);
  const std::array<int64_t, 4> full{B, H, Sq, Sk};
  std::array<int64_t, 4> mshape;
  for (size_t d = 0; d < 4; ++d) mshape[d] = c.mask_full[d] ? full[d] : 1;
  const int64_t mcount = mshape[0] * mshape[1] * mshape[2] * mshape[3];
  if (c.mask == MaskKind::kBool) {
    o.mask_shape = mshape;
    o.bool_mask.resize(size_t(mcount));
    for (auto& e : o.bool_mask) e = rng.coin(c.mask_keep) ? 1 : 0;
  } else if (c.mask == MaskKind::kAdditive) {
    o.mask_shape = mshape;
    o.add_mask.resize(size_t(mcount));
    for (auto& e : o.add_mask)
      e = rng.coin(c.mask_keep) ? double(rng.uniform(-2.0f, 2.0f)) : -double(kInf);
  }

  // Layouts: contiguous, or transposed + padded + interleaved views.
  auto layout = [&](int n) -> std::pair<std::array<int, 4>, std::array<int64_t, 4>> {
    if (!c.strided) return {{0, 1, 2, 3}, {0, 0, 0, 0}};
    switch (n) {
      case 0:
        return {{0, 2, 1, 3}, {0, 1, 2, 3}};  // q as [b, h, s, d], padded
      case 1:
        return {{1, 0, 2, 3}, {1, 0, 1, 2}};  // k seq-major
      case 2:
        return {{0, 1, 3, 2}, {0, 1, 0, 1}};  // v with dim outside head
      case 3:
        return {{2, 0, 1, 3}, {0, 0, 1, 1}};  // out heads outermost
      case 4:
        return {{2, 1, 0, 3}, {1, 0, 2, 0}};  // lse (rank 3) reversed
      default:
        return {{0, 2, 1, 3}, {0, 1, 0, 3}};  // probs as [b, q, h, k]
    }
  };
  const int64_t step = c.strided ? 2 : 1;
  auto [qo, qp] = layout(0);
  auto [ko, kp] = layout(1);
  auto [vo, vp] = layout(2);
  auto [oo, op] = layout(3);
  auto [lo, lp] = layout(4);
  auto [po, pp] = layout(5);
  auto q = make_strided<float>(DType::kF32, 4, {B, Sq, H, D}, qo, qp, step, kNaN);
  auto out = make_strided<float>(DType::kF32, 4, {B, Sq, H, Dv}, oo, op, step, kOutSentinel);
  auto lse = make_strided<float>(DType::kF32, 3, {B, H, Sq, 1}, lo, lp, 1, kOutSentinel);
  auto probs = make_strided<float>(DType::kF32, 4, {B, H, Sq, Sk}, po, pp, 1, kOutSentinel);
  for_each_index(4, {B, Sq, H, D}, [&](auto i) {
    q.at(i) = res.q[size_t(((i[0] * Sq + i[1]) * H + i[2]) * D + i[3])];
  });
  Strided<float> kf, vf;
  Strided<bf16> kh, vh;
  TensorView kview, vview;
  if (c.bf16_kv) {
    const bf16 nan16 = attnkit::float_to_bf16(kNaN);
    kh = make_strided<bf16>(DType::kBF16, 4, {B, Sk, Hkv, D}, ko, kp, step, nan16);
    vh = make_strided<bf16>(DType::kBF16, 4, {B, Sk, Hkv, Dv}, vo, vp, step, nan16);
    for_each_index(4, {B, Sk, Hkv, D}, [&](auto i) {
      kh.at(i) =
          attnkit::float_to_bf16(res.k[size_t(((i[0] * Sk + i[1]) * Hkv + i[2]) * D + i[3])]);
    });
    for_each_index(4, {B, Sk, Hkv, Dv}, [&](auto i) {
      vh.at(i) =
          attnkit::float_to_bf16(res.v[size_t(((i[0] * Sk + i[1]) * Hkv + i[2]) * Dv + i[3])]);
    });
    kview = kh.view;
    vview = vh.view;
  } else {
    kf = make_strided<float>(DType::kF32, 4, {B, Sk, Hkv, D}, ko, kp, step, kNaN);
    vf = make_strided<float>(DType::kF32, 4, {B, Sk, Hkv, Dv}, vo, vp, step, kNaN);
    for_each_index(4, {B, Sk, Hkv, D}, [&](auto i) {
      kf.at(i) = res.k[size_t(((i[0] * Sk + i[1]) * Hkv + i[2]) * D + i[3])];
    });
    for_each_index(4, {B, Sk, Hkv, Dv}, [&](auto i) {
      vf.at(i) = res.v[size_t(((i[0] * Sk + i[1]) * Hkv + i[2]) * Dv + i[3])];
    });
    kview = kf.view;
    vview = vf.view;
  }

  // The mask as sdpa sees it: size-1 dims, or (expanded) full dims with
  // stride 0, in a padded buffer when strided.
  std::vector<uint8_t> mask_u8;
  std::vector<float> mask_f32;
  TensorView mask_view;
  if (c.mask != MaskKind::kNone) {
    std::array<int64_t, 4> st;
    int64_t running = 1;
    for (int d = 3; d >= 0; --d) {
      st[size_t(d)] = running;
      running *= mshape[size_t(d)] + (c.strided ? 1 : 0);
    }
    mask_view.rank = 4;
    for (size_t d = 0; d < 4; ++d) {
      const bool expand = c.mask_expanded && !c.mask_full[d];
      mask_view.shape[d] = expand ? full[d] : mshape[d];
      mask_view.strides[d] = expand ? 0 : st[d];
    }
    auto place = [&](auto& buf, auto value_of) {
      for_each_index(4, mshape, [&](auto i) {
        const int64_t src = ((i[0] * mshape[1] + i[1]) * mshape[2] + i[2]) * mshape[3] + i[3];
        buf[size_t(i[0] * st[0] + i[1] * st[1] + i[2] * st[2] + i[3] * st[3])] = value_of(src);
      });
    };
    if (c.mask == MaskKind::kBool) {
      mask_u8.assign(size_t(running), 0xAB);
      place(mask_u8, [&](int64_t s) { return o.bool_mask[size_t(s)]; });
      mask_view.dtype = DType::kBool;
      mask_view.data = mask_u8.data();
    } else {
      mask_f32.assign(size_t(running), kNaN);
      place(mask_f32, [&](int64_t s) { return float(o.add_mask[size_t(s)]); });
      mask_view.dtype = DType::kF32;
      mask_view.data = mask_f32.data();
    }
  }

  // Sinks: contiguous, or every third float of a NaN-padded buffer.
  std::vector<float> sinks_buf;
  TensorView sinks_view;
  if (!c.sinks.empty()) {
    const int64_t stride = c.strided ? 3 : 1;
    sinks_buf.assign(size_t(H * stride), kNaN);
    for (int64_t h = 0; h < H; ++h) sinks_buf[size_t(h * stride)] = c.sinks[size_t(h)];
    sinks_view.dtype = DType::kF32;
    sinks_view.rank = 1;
    sinks_view.shape[0] = H;
    sinks_view.strides[0] = stride;
    sinks_view.data = sinks_buf.data();
  }

  attnkit::AttentionOptions opt;
  opt.softmax_scale = c.softmax_scale;
  opt.causal = c.causal;
  opt.window_size = c.window;
  opt.softcap = c.softcap;
  opt.seqlens_k = c.seqlens_k;
  opt.mask = mask_view;
  opt.sparse = c.sparse;
  opt.chunk_size = c.chunk_size;
  opt.sinks = sinks_view;
  opt.backend = Backend::kReference;
  opt.num_threads = c.num_threads;
  const attnkit::Status st =
      attnkit::sdpa(q.view, kview, vview, out.view, opt, c.want_lse ? lse.view : TensorView{},
                    c.want_probs ? probs.view : TensorView{});
  EXPECT_TRUE(st.ok()) << st.to_string();

  res.ref = attnkit_test::attention_f64(o, attnkit_test::widen(res.q), attnkit_test::widen(res.k),
                                        attnkit_test::widen(res.v));
  res.out.resize(res.ref.out.size());
  for_each_index(4, {B, Sq, H, Dv}, [&](auto i) {
    res.out[size_t(((i[0] * Sq + i[1]) * H + i[2]) * Dv + i[3])] = out.at(i);
  });
  res.lse.resize(res.ref.lse.size());
  for_each_index(3, {B, H, Sq, 1},
                 [&](auto i) { res.lse[size_t((i[0] * H + i[1]) * Sq + i[2])] = lse.at(i); });
  res.probs.resize(res.ref.probs.size());
  for_each_index(4, {B, H, Sq, Sk}, [&](auto i) {
    res.probs[size_t(((i[0] * H + i[1]) * Sq + i[2]) * Sk + i[3])] = probs.at(i);
  });

  const double rel = derived_rel(c, max_abs_finite(res.q), max_abs_finite(res.k));
  res.rel = rel;
  EXPECT_LE(rel, 1e-5);
  const double vmax = std::max(max_abs_finite(res.v), 1e-30);
  const double s_max = c.softmax_scale == 0.0f ? std::sqrt(double(D)) : 0.0;
  double ratio = 0.0;
  EXPECT_TRUE(all_close("out", res.out, res.ref.out, Tolerance{rel * vmax, rel}, &ratio));
  note_worst(ratio, rel, "out " + c.describe());
  EXPECT_TRUE(gaps_untouched("out", out, kOutSentinel));
  if (c.want_lse) {
    EXPECT_TRUE(all_close("lse", res.lse, res.ref.lse, Tolerance{rel * (1.0 + s_max), rel}));
    EXPECT_TRUE(gaps_untouched("lse", lse, kOutSentinel));
  } else {
    EXPECT_TRUE(std::all_of(lse.storage.begin(), lse.storage.end(),
                            [](float x) { return x == kOutSentinel; }));
  }
  if (c.want_probs) {
    EXPECT_TRUE(all_close("probs", res.probs, res.ref.probs, Tolerance{0x1p-149, rel}, &ratio));
    note_worst(ratio, rel, "probs " + c.describe());
    EXPECT_TRUE(gaps_untouched("probs", probs, kOutSentinel));
  }
  return res;
}

// Fraction of (b, h, i) rows with at least one visible key, so sweeps can
// assert they are not vacuous.
double visible_row_fraction(const Outcome& r) {
  size_t n = 0;
  for (double x : r.ref.lse) n += std::isfinite(x) ? 1 : 0;
  return r.ref.lse.empty() ? 0.0 : double(n) / double(r.ref.lse.size());
}

// ---------------------------------------------------------------------------
// Helpers of the helpers: the oracle and bf16 rounding checked against hand
// values and the library, so that a wrong oracle cannot bless a wrong kernel.

TEST(SdpaRefOracle, HandComputedSoftmax) {
  // Two keys, scores 1 and 0: weights e/(e+1) and 1/(e+1).
  OracleOptions o;
  o.head_dim = 2;
  o.head_dim_v = 2;
  o.seqlen_k = 2;
  o.softmax_scale = 1.0;
  const std::vector<double> q{1, 0}, k{1, 0, 0, 0}, v{1, 2, 3, 4};
  const OracleResult r = attnkit_test::attention_f64(o, q, k, v);
  const double w = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_DOUBLE_EQ(r.out[0], w * 1 + (1 - w) * 3);
  EXPECT_DOUBLE_EQ(r.out[1], w * 2 + (1 - w) * 4);
  EXPECT_DOUBLE_EQ(r.lse[0], std::log(std::exp(1.0) + 1.0));
  EXPECT_DOUBLE_EQ(r.probs[1], 1 - w);
}

TEST(SdpaRefOracle, HandComputedSink) {
  // Scores 1 and 0 and a sink of 0.5: the denominator is e + 1 + e^0.5,
  // and the sink's share belongs to no value.
  OracleOptions o;
  o.head_dim = 2;
  o.head_dim_v = 2;
  o.seqlen_k = 2;
  o.softmax_scale = 1.0;
  o.sinks = {0.5};
  const std::vector<double> q{1, 0}, k{1, 0, 0, 0}, v{1, 2, 3, 4};
  const OracleResult r = attnkit_test::attention_f64(o, q, k, v);
  const double denom = std::exp(1.0) + 1.0 + std::exp(0.5);
  EXPECT_DOUBLE_EQ(r.out[0], (std::exp(1.0) * 1 + 3) / denom);
  EXPECT_DOUBLE_EQ(r.out[1], (std::exp(1.0) * 2 + 4) / denom);
  EXPECT_DOUBLE_EQ(r.lse[0], std::log(denom));
  EXPECT_DOUBLE_EQ(r.probs[0] + r.probs[1], (std::exp(1.0) + 1.0) / denom);
  // No visible key: out 0, lse = the sink.
  o.seqlens_k = {0};
  const OracleResult e = attnkit_test::attention_f64(o, q, k, v);
  EXPECT_EQ(e.out[0], 0.0);
  EXPECT_EQ(e.lse[0], 0.5);
}

TEST(SdpaRefOracle, BF16RoundingMatchesLibrary) {
  Rng rng(7);
  std::vector<float> xs{1.0f,    1.00390625f, 1.01171875f, -2.7182818f, 3.0e-39f, 1e-45f,
                        FLT_MAX, -FLT_MAX,    0.0f,        -0.0f,       kInf};
  for (int i = 0; i < 20000; ++i) xs.push_back(rng.normal(0.0f, 100.0f));
  for (int i = 0; i < 2000; ++i) {  // exact ties: 9 significant bits ending in 1
    const float m = float(256 + 2 * rng.integer(0, 127) + 1);
    xs.push_back(std::ldexp(m, int(rng.integer(-140, 100))));
  }
  for (float x : xs) {
    const float lib = attnkit::bf16_to_float(attnkit::float_to_bf16(x));
    const float ours = attnkit_test::round_bf16(x);
    ASSERT_EQ(std::memcmp(&lib, &ours, sizeof(float)), 0) << x << ": " << lib << " vs " << ours;
  }
  EXPECT_TRUE(std::isnan(attnkit_test::round_bf16(kNaN)));
}

TEST(SdpaRefOracle, CompareHelperFailsOnRealDifference) {
  const std::vector<float> a{1.0f, 2.0f, 3.0f};
  const std::vector<double> e{1.0, 2.0, 3.001};
  const auto r = all_close("x", a, e, Tolerance{0.0, 1e-5});
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("[2]"), std::string::npos) << r.message();
  EXPECT_NE(std::string(r.message()).find("bound"), std::string::npos) << r.message();
  EXPECT_FALSE(all_close("x", std::vector<float>{kNaN}, std::vector<double>{1.0}, {1, 1}));
  EXPECT_FALSE(all_close("x", std::vector<float>{1.0f}, std::vector<double>{-HUGE_VAL}, {1, 1}));
  EXPECT_TRUE(all_close("x", std::vector<float>{kNaN}, std::vector<double>{NAN}, {0, 0}));
}

// ---------------------------------------------------------------------------
// The pictures of include/attnkit/attention.h and docs/CONVENTIONS.md,
// checked on both the kernel's and the oracle's probs: an anchor that does
// not depend on either implementation.

std::vector<std::string> picture(const Case& base) {
  Case c = base;
  c.head_dim = 4;
  c.head_dim_v = 2;
  const Outcome r = run(c);
  std::vector<std::string> rows;
  for (int64_t i = 0; i < c.seqlen_q; ++i) {
    std::string row, ref_row;
    for (int64_t j = 0; j < c.seqlen_k; ++j) {
      row += r.probs[size_t(i * c.seqlen_k + j)] > 0.0f ? 'x' : '.';
      ref_row += r.ref.probs[size_t(i * c.seqlen_k + j)] > 0.0 ? 'x' : '.';
    }
    EXPECT_EQ(row, ref_row) << "row " << i;
    rows.push_back(row);
  }
  return rows;
}

using Rows = std::vector<std::string>;

TEST(SdpaRefPictures, CausalBottomRightFewerQueries) {
  Case c;
  c.seqlen_q = 3;
  c.seqlen_k = 5;
  c.causal = true;
  EXPECT_EQ(picture(c), (Rows{"xxx..", "xxxx.", "xxxxx"}));
}

TEST(SdpaRefPictures, CausalBottomRightMoreQueries) {
  Case c;
  c.seqlen_q = 5;
  c.seqlen_k = 3;
  c.causal = true;
  EXPECT_EQ(picture(c), (Rows{"...", "...", "x..", "xx.", "xxx"}));
}

TEST(SdpaRefPictures, WindowInclusive) {
  Case c;
  c.seqlen_q = 3;
  c.seqlen_k = 5;
  c.window = {1, 0};
  EXPECT_EQ(picture(c), (Rows{".xx..", "..xx.", "...xx"}));
  c.window = {0, 1};
  EXPECT_EQ(picture(c), (Rows{"..xx.", "...xx", "....x"}));
  c.window = {0, 0};
  EXPECT_EQ(picture(c), (Rows{"..x..", "...x.", "....x"}));
  c.window = {2, -1};
  EXPECT_EQ(picture(c), (Rows{"xxxxx", ".xxxx", "..xxx"}));
}

// Chunks of 3 keys: a query sees only the keys of its own chunk (causal:
// up to itself), wherever the bottom-right alignment puts it.
TEST(SdpaRefPictures, ChunkedCausal) {
  Case c;
  c.seqlen_q = 7;
  c.seqlen_k = 7;
  c.causal = true;
  c.chunk_size = 3;
  EXPECT_EQ(picture(c),
            (Rows{"x......", "xx.....", "xxx....", "...x...", "...xx..", "...xxx.", "......x"}));
  c.seqlen_q = 2;  // p = 5, 6
  EXPECT_EQ(picture(c), (Rows{"...xxx.", "......x"}));
  c.causal = false;
  EXPECT_EQ(picture(c), (Rows{"...xxx.", "......x"}));
  c.seqlen_q = 9;  // p = -2 .. 6: rows before key 0 see nothing
  EXPECT_EQ(picture(c), (Rows{".......", ".......", "xxx....", "xxx....", "xxx....", "...xxx.",
                              "...xxx.", "...xxx.", "......x"}));
}

// Chunks compose with a window: both rules must hold.
TEST(SdpaRefPictures, ChunkAndWindow) {
  Case c;
  c.seqlen_q = 6;
  c.seqlen_k = 6;
  c.chunk_size = 4;
  c.window = {1, 1};
  EXPECT_EQ(picture(c), (Rows{"xx....", "xxx...", ".xxx..", "..xx..", "....xx", "....xx"}));
}

TEST(SdpaRefPictures, SeqlensKMovesTheAlignment) {
  Case c;
  c.batch = 1;
  c.seqlen_q = 2;
  c.seqlen_k = 6;
  c.causal = true;
  c.seqlens_k = {4};  // rows sit at key positions 2 and 3
  EXPECT_EQ(picture(c), (Rows{"xxx...", "xxxx.."}));
}

TEST(SdpaRefPictures, StridedTokenLevel) {
  Case c;
  c.seqlen_q = c.seqlen_k = 8;
  c.causal = true;
  c.sparse = {SparsePattern::Kind::kStrided, 1, 3, 1};
  EXPECT_EQ(picture(c), (Rows{"x.......", "xx......", "xxx.....", "xxxx....", ".xxxx...",
                              "..xxxx..", "x..xxxx.", ".x..xxxx"}));
}

TEST(SdpaRefPictures, FixedTokenLevel) {
  Case c;
  c.seqlen_q = c.seqlen_k = 8;
  c.causal = true;
  c.sparse = {SparsePattern::Kind::kFixed, 1, 4, 1};
  EXPECT_EQ(picture(c), (Rows{"x.......", "xx......", "xxx.....", "xxxx....", "...xx...",
                              "...xxx..", "...xxxx.", "...xxxxx"}));
}

TEST(SdpaRefPictures, StridedBlockLevel) {
  Case c;
  c.seqlen_q = c.seqlen_k = 8;
  c.causal = true;
  c.sparse = {SparsePattern::Kind::kStrided, 2, 2, 1};
  EXPECT_EQ(picture(c), (Rows{"x.......", "xx......", "xxx.....", "xxxx....", "xxxxx...",
                              "xxxxxx..", "..xxxxx.", "..xxxxxx"}));
}

TEST(SdpaRefPictures, FixedNonCausal) {
  Case c;
  c.seqlen_q = c.seqlen_k = 6;
  c.sparse = {SparsePattern::Kind::kFixed, 1, 3, 1};  // chunks {0,1,2} {3,4,5}, summaries 2, 5
  EXPECT_EQ(picture(c), (Rows{"xxx..x", "xxx..x", "xxx..x", "..xxxx", "..xxxx", "..xxxx"}));
}

// ---------------------------------------------------------------------------
// Mutation checks: the comparisons must be able to fail. A top-left causal
// alignment, an exclusive window, or the wrong GQA head mapping in the
// oracle must disagree with sdpa.

TEST(SdpaRefMutation, TopLeftAlignmentIsCaught) {
  for (auto [sq, sk] : {std::pair<int64_t, int64_t>{3, 7}, {7, 3}}) {
    Case c;
    c.seqlen_q = sq;
    c.seqlen_k = sk;
    c.causal = true;
    c.num_heads = 2;
    const Outcome r = run(c);
    OracleOptions o = oracle_options(c);
    o.q_offset = {0};  // top-left
    const OracleResult wrong = attnkit_test::attention_f64(
        o, attnkit_test::widen(r.q), attnkit_test::widen(r.k), attnkit_test::widen(r.v));
    EXPECT_FALSE(all_close("out", r.out, wrong.out, Tolerance{r.rel, r.rel})) << sq << " " << sk;
  }
}

TEST(SdpaRefMutation, ExclusiveWindowIsCaught) {
  Case c;
  c.seqlen_q = 5;
  c.seqlen_k = 9;
  c.window = {2, 1};
  const Outcome r = run(c);
  OracleOptions o = oracle_options(c);
  o.window_left = 1;
  o.window_right = 0;
  const OracleResult wrong = attnkit_test::attention_f64(
      o, attnkit_test::widen(r.q), attnkit_test::widen(r.k), attnkit_test::widen(r.v));
  EXPECT_FALSE(all_close("out", r.out, wrong.out, Tolerance{r.rel, r.rel}));
}

// GQA equals MHA over K/V repeated per query head with h -> h / group
// (repeat_interleave), and differs from the h -> h % num_kv_heads mapping.
TEST(SdpaRefMutation, GqaHeadMapping) {
  Case c;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.seqlen_q = 3;
  c.seqlen_k = 5;
  c.head_dim = 5;
  c.head_dim_v = 3;
  const Outcome r = run(c);
  for (bool interleave : {true, false}) {
    std::vector<double> k_rep, v_rep;
    for (int64_t j = 0; j < c.seqlen_k; ++j)
      for (int64_t h = 0; h < c.num_heads; ++h) {
        const int64_t g = interleave ? h / 3 : h % 2;
        for (int64_t d = 0; d < c.head_dim; ++d)
          k_rep.push_back(r.k[size_t((j * 2 + g) * c.head_dim + d)]);
        for (int64_t d = 0; d < c.head_dim_v; ++d)
          v_rep.push_back(r.v[size_t((j * 2 + g) * c.head_dim_v + d)]);
      }
    OracleOptions o = oracle_options(c);
    o.num_kv_heads = c.num_heads;
    const OracleResult mha = attnkit_test::attention_f64(o, attnkit_test::widen(r.q), k_rep, v_rep);
    EXPECT_EQ(bool(all_close("out", r.out, mha.out, Tolerance{r.rel, r.rel})), interleave);
  }
}

// ---------------------------------------------------------------------------
// Randomized sweeps against the oracle.

TEST(SdpaRefRandom, ShapesAndGroups) {
  Rng pick(101);
  const int64_t dims[] = {1, 3, 7, 16, 17, 33, 64};
  int cases = 0;
  for (int64_t H = 1; H <= 8; ++H) {
    for (int64_t Hkv = 1; Hkv <= H; ++Hkv) {
      if (H % Hkv != 0) continue;  // every group size from MHA to MQA
      for (int rep = 0; rep < 2; ++rep) {
        Case c;
        c.num_heads = H;
        c.num_kv_heads = Hkv;
        c.batch = pick.integer(1, 3);
        c.seqlen_q = pick.integer(1, 9);
        c.seqlen_k = pick.integer(1, 11);
        c.head_dim = dims[pick.integer(0, 6)];
        c.head_dim_v = rep == 0 ? c.head_dim : dims[pick.integer(0, 6)];
        c.softmax_scale = pick.coin() ? 0.0f : 0.3f;
        c.num_threads = int(pick.integer(0, 3));
        c.seed = 1000 + uint64_t(cases);
        run(c);
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, 40);
}

TEST(SdpaRefRandom, CausalAndWindows) {
  const std::pair<int64_t, int64_t> lengths[] = {{1, 1}, {4, 4}, {3, 9}, {9, 3}, {1, 12}, {12, 1}};
  const attnkit::WindowSize windows[] = {{-1, -1}, {0, 0},  {2, -1}, {-1, 2},
                                         {3, 1},   {0, -1}, {-1, 0}, {20, 20}};
  uint64_t seed = 2000;
  for (auto [sq, sk] : lengths)
    for (const auto& w : windows)
      for (bool causal : {false, true}) {
        Case c;
        c.batch = 2;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.seqlen_q = sq;
        c.seqlen_k = sk;
        c.head_dim = 7;
        c.head_dim_v = 5;
        c.window = w;
        c.causal = causal;
        c.seed = seed++;
        run(c);
      }
}

TEST(SdpaRefRandom, Softcap) {
  uint64_t seed = 3000;
  for (float cap : {0.5f, 5.0f, 30.0f})
    for (float scale : {0.0f, 4.0f}) {  // 4.0 drives scores well past the cap
      Case c;
      c.batch = 2;
      c.num_heads = 2;
      c.seqlen_q = 5;
      c.seqlen_k = 7;
      c.head_dim = 9;
      c.head_dim_v = 4;
      c.softcap = cap;
      c.softmax_scale = scale;
      c.causal = cap > 1.0f;
      c.mask = cap == 5.0f ? MaskKind::kAdditive : MaskKind::kNone;
      c.seed = seed++;
      run(c);
    }
}

TEST(SdpaRefRandom, SeqlensK) {
  uint64_t seed = 4000;
  for (bool causal : {false, true})
    for (attnkit::WindowSize w : {attnkit::WindowSize{-1, -1}, attnkit::WindowSize{2, 0}})
      for (int64_t sq : {1, 3, 8}) {
        Case c;
        c.batch = 4;
        c.num_heads = 4;
        c.num_kv_heads = 1;
        c.seqlen_q = sq;
        c.seqlen_k = 8;
        c.head_dim = 6;
        c.head_dim_v = 3;
        c.causal = causal;
        c.window = w;
        c.seqlens_k = {0, 8, 3, 5};  // empty, full, partial
        c.seed = seed++;
        const Outcome r = run(c);
        // Batch item 0 has no keys: every one of its rows is empty.
        for (int64_t h = 0; h < c.num_heads; ++h)
          for (int64_t i = 0; i < sq; ++i) EXPECT_EQ(r.lse[size_t(h * sq + i)], -kInf);
      }
}

TEST(SdpaRefRandom, MaskBroadcastCombinations) {
  uint64_t seed = 5000;
  for (MaskKind kind : {MaskKind::kBool, MaskKind::kAdditive})
    for (int bits = 0; bits < 16; ++bits) {
      Case c;
      c.batch = 2;
      c.num_heads = 3;
      c.num_kv_heads = 1;
      c.seqlen_q = 4;
      c.seqlen_k = 6;
      c.head_dim = 5;
      c.head_dim_v = 6;
      c.mask = kind;
      c.mask_full = {bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)};
      c.mask_keep = bits == 0 ? 1.0 : 0.75;  // a single scalar entry must keep
      c.mask_expanded = (bits % 3) == 0;
      c.strided = (bits % 5) == 0;
      c.causal = (bits % 4) == 1;
      c.seed = seed++;
      SCOPED_TRACE(c.describe());
      const Outcome r = run(c);
      EXPECT_GT(visible_row_fraction(r), 0.0);
    }
}

TEST(SdpaRefRandom, SparsePatterns) {
  uint64_t seed = 6000;
  using Kind = SparsePattern::Kind;
  const SparsePattern patterns[] = {
      {Kind::kStrided, 1, 1, 1}, {Kind::kStrided, 1, 3, 1}, {Kind::kStrided, 2, 2, 1},
      {Kind::kStrided, 3, 2, 1}, {Kind::kFixed, 1, 4, 1},   {Kind::kFixed, 1, 3, 3},
      {Kind::kFixed, 2, 3, 2},   {Kind::kFixed, 4, 2, 1},
  };
  for (const SparsePattern& sp : patterns)
    for (bool causal : {false, true})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{13, 13}, {5, 13}, {13, 6}}) {
        Case c;
        c.batch = 2;
        c.num_heads = 2;
        c.num_kv_heads = 1;
        c.seqlen_q = sq;
        c.seqlen_k = sk;
        c.head_dim = 4;
        c.head_dim_v = 3;
        c.sparse = sp;
        c.causal = causal;
        c.seqlens_k = sk == 13 ? std::vector<int32_t>{13, 10} : std::vector<int32_t>{};
        c.seed = seed++;
        run(c);
      }
}

TEST(SdpaRefRandom, StridedViews) {
  uint64_t seed = 7000;
  for (int n = 0; n < 6; ++n) {
    Case c;
    c.strided = true;
    c.batch = 2;
    c.num_heads = 4;
    c.num_kv_heads = n % 2 ? 2 : 4;
    c.seqlen_q = 3 + n;
    c.seqlen_k = 8 - n;
    c.head_dim = 5;
    c.head_dim_v = 7;
    c.causal = n % 3 == 0;
    c.bf16_kv = n >= 4;
    c.seed = seed++;
    run(c);
  }
}

TEST(SdpaRefRandom, OptionalOutputsLeftOut) {
  Case c;
  c.num_heads = 2;
  c.seqlen_q = 3;
  c.seqlen_k = 5;
  c.want_lse = false;
  c.want_probs = false;
  run(c);
  c.want_lse = true;
  run(c);
}

// bf16 K/V: the oracle is fed the same bf16-rounded K/V, so the bound is the
// fp32 one above (the rounding of K/V is an input, not an error of sdpa).
TEST(SdpaRefRandom, Bf16KeysValues) {
  uint64_t seed = 8000;
  for (int n = 0; n < 8; ++n) {
    Case c;
    c.bf16_kv = true;
    c.batch = 1 + n % 2;
    c.num_heads = 4;
    c.num_kv_heads = 1 << (n % 3);
    c.seqlen_q = 1 + 2 * n;
    c.seqlen_k = 15 - n;
    c.head_dim = 3 + 8 * (n % 3);
    c.head_dim_v = 16;
    c.causal = n % 2 == 0;
    c.mask = n == 3 ? MaskKind::kBool : MaskKind::kNone;
    c.seed = seed++;
    run(c);
  }
}

// Every option at once, drawn at random, so that interactions (window with
// seqlens_k, sparse with a mask, softcap with bias, bf16 with strides, ...)
// are covered beyond the one-feature sweeps above.
TEST(SdpaRefRandom, EverythingCombined) {
  Rng pick(12345);
  using Kind = SparsePattern::Kind;
  int nonempty = 0;
  for (int n = 0; n < 300; ++n) {
    Case c;
    c.batch = pick.integer(1, 3);
    c.num_kv_heads = pick.integer(1, 3);
    c.num_heads = c.num_kv_heads * pick.integer(1, 3);
    c.seqlen_q = pick.integer(1, 10);
    c.seqlen_k = pick.integer(1, 12);
    c.head_dim = pick.integer(1, 20);
    c.head_dim_v = pick.integer(1, 20);
    c.softmax_scale = pick.coin() ? 0.0f : 0.25f;
    c.causal = pick.coin();
    c.window = {pick.coin() ? -1 : pick.integer(0, 4), pick.coin() ? -1 : pick.integer(0, 4)};
    c.softcap = pick.coin(0.3) ? 2.0f : 0.0f;
    if (pick.coin(0.4))
      for (int64_t b = 0; b < c.batch; ++b)
        c.seqlens_k.push_back(int32_t(pick.integer(0, c.seqlen_k)));
    c.mask = MaskKind(pick.integer(0, 2));
    for (bool& f : c.mask_full) f = pick.coin();
    c.mask_expanded = pick.coin();
    if (pick.coin(0.4)) {
      const int64_t stride = pick.integer(1, 4);
      c.sparse = {pick.coin() ? Kind::kStrided : Kind::kFixed, pick.integer(1, 3), stride,
                  pick.integer(1, stride)};
    }
    c.bf16_kv = pick.coin(0.3);
    c.strided = pick.coin(0.3);
    c.want_lse = pick.coin(0.8);
    c.want_probs = pick.coin(0.8);
    c.num_threads = int(pick.integer(0, 4));
    if (pick.coin(0.25)) c.chunk_size = pick.integer(1, 6);
    if (pick.coin(0.25))
      for (int64_t h = 0; h < c.num_heads; ++h) c.sinks.push_back(pick.uniform(-3.0f, 3.0f));
    c.seed = 20000 + uint64_t(n);
    nonempty += visible_row_fraction(run(c)) > 0.0 ? 1 : 0;
  }
  EXPECT_GT(nonempty, 200);  // most draws must exercise real softmaxes
}

// Sinks of every magnitude (small, large enough to swamp the keys, large
// enough to overflow e^sink in fp32) with chunks of 1, 2, 3 and more than
// the keys, causal or not, GQA, seqlen_q above and below seqlen_k.
TEST(SdpaRefRandom, SinksAndChunks) {
  const std::pair<int64_t, int64_t> lengths[] = {{1, 9}, {5, 5}, {3, 11}, {9, 4}};
  uint64_t seed = 14000;
  int nonempty = 0, cases = 0;
  for (auto [sq, sk] : lengths)
    for (int64_t chunk : {0, 1, 2, 3, 100})
      for (float sink : {0.0f, -40.0f, 1.5f, 30.0f, 200.0f}) {
        if (chunk == 0 && sink == 0.0f) continue;
        Case c;
        c.batch = 2;
        c.num_heads = 6;
        c.num_kv_heads = 2;
        c.seqlen_q = sq;
        c.seqlen_k = sk;
        c.head_dim = 5;
        c.head_dim_v = 3;
        c.causal = (seed % 2) == 0;
        c.chunk_size = chunk;
        if (sink != 0.0f)
          for (int64_t h = 0; h < c.num_heads; ++h)
            c.sinks.push_back(sink + 0.5f * float(h) - 1.0f);
        c.strided = seed % 3 == 0;
        c.seed = seed++;
        nonempty += visible_row_fraction(run(c)) > 0.0 ? 1 : 0;
        ++cases;
      }
  EXPECT_GT(nonempty, cases / 2);
}

// ---------------------------------------------------------------------------
// Edge cases: empty rows, NaN/Inf, huge logits.

void expect_empty_rows_exact(const Outcome& r, const Case& c) {
  int empty = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.num_heads; ++h)
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        const size_t li = size_t((b * c.num_heads + h) * c.seqlen_q + i);
        if (std::isfinite(r.ref.lse[li])) continue;
        ++empty;
        EXPECT_EQ(r.lse[li], -kInf) << b << " " << h << " " << i;
        for (int64_t d = 0; d < c.head_dim_v; ++d)
          EXPECT_EQ(r.out[size_t(((b * c.seqlen_q + i) * c.num_heads + h) * c.head_dim_v + d)],
                    0.0f);
        for (int64_t j = 0; j < c.seqlen_k; ++j)
          EXPECT_EQ(r.probs[li * size_t(c.seqlen_k) + size_t(j)], 0.0f);
      }
  EXPECT_GT(empty, 0) << "case has no fully-masked row";
  for (float x : r.out) EXPECT_FALSE(std::isnan(x));
}

TEST(SdpaRefEdge, FullyMaskedRowsAreZero) {
  std::vector<Case> cases;
  Case c;
  c.batch = 2;
  c.num_heads = 2;
  c.head_dim = 3;
  c.head_dim_v = 4;
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  c.causal = true;  // rows 0..2 sit before key 0
  cases.push_back(c);
  c.causal = false;
  c.seqlen_q = 3;
  c.seqlen_k = 6;
  c.seqlens_k = {0, 4};
  cases.push_back(c);
  c.seqlens_k = {};
  c.window = {0, 0};
  c.seqlens_k = {2, 6};  // p = i - 1 for item 0: row 0 sees nothing
  cases.push_back(c);
  c.window = {-1, -1};
  c.seqlens_k = {};
  c.mask = MaskKind::kBool;
  c.mask_keep = 0.2;
  c.mask_full = {true, true, true, false};  // per-row all-or-nothing
  cases.push_back(c);
  c.mask = MaskKind::kAdditive;  // -inf additive rows
  c.mask_keep = 0.4;
  cases.push_back(c);
  c.mask = MaskKind::kNone;
  c.seqlen_q = 4;
  c.seqlen_k = 4;
  c.causal = true;
  c.sparse = {SparsePattern::Kind::kFixed, 1, 2, 1};
  c.window = {-1, -1};
  c.seqlens_k = {4, 1};
  cases.push_back(c);
  uint64_t seed = 9000;
  for (Case& e : cases) {
    e.seed = seed++;
    expect_empty_rows_exact(run(e), e);
  }
}

// A row that sees no key gets out = 0, probs = 0 and lse = its head's sink.
TEST(SdpaRefEdge, EmptyRowsWithSinksGiveTheSink) {
  Case c;
  c.batch = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 3;
  c.head_dim_v = 4;
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  c.causal = true;  // rows 0..2 sit before key 0
  c.seqlens_k = {3, 0};
  c.sinks = {-2.0f, 0.0f, 3.0f, 80.0f};
  c.seed = 9100;
  const Outcome r = run(c);
  int empty = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.num_heads; ++h)
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        const int64_t p = i + c.seqlens_k[size_t(b)] - c.seqlen_q;
        if (p >= 0) continue;
        ++empty;
        const size_t li = size_t((b * c.num_heads + h) * c.seqlen_q + i);
        EXPECT_EQ(r.lse[li], c.sinks[size_t(h)]);
        for (int64_t d = 0; d < c.head_dim_v; ++d)
          EXPECT_EQ(r.out[size_t(((b * c.seqlen_q + i) * c.num_heads + h) * c.head_dim_v + d)],
                    0.0f);
        for (int64_t j = 0; j < c.seqlen_k; ++j)
          EXPECT_EQ(r.probs[li * size_t(c.seqlen_k) + size_t(j)], 0.0f);
      }
  EXPECT_EQ(empty, 4 * 3 + 4 * 6);
}

// A sink far above every score (e^sink overflows fp32 and double alike)
// leaves out ~ 0 and lse = the sink, never Inf or NaN; one far below
// changes nothing.
TEST(SdpaRefEdge, HugeSinksStayFinite) {
  Case c;
  c.num_heads = 2;
  c.seqlen_q = 3;
  c.seqlen_k = 5;
  c.causal = true;
  c.sinks = {1e30f, -1e30f};
  c.seed = 9200;
  const Outcome r = run(c);
  for (float x : r.out) EXPECT_TRUE(std::isfinite(x));
  for (int64_t i = 0; i < c.seqlen_q; ++i) {
    EXPECT_EQ(r.lse[size_t(i)], 1e30f);
    EXPECT_TRUE(std::isfinite(r.lse[size_t(c.seqlen_q + i)]));
  }
  Case plain = c;
  plain.sinks = {};
  const Outcome p = run(plain);
  for (size_t x = 0; x < r.out.size(); ++x)
    if ((x / size_t(c.head_dim_v)) % 2 == 1) {
      EXPECT_EQ(r.out[x], p.out[x]);
    }
}

// NaN and Inf in every K/V row that no visible pair uses must not reach any
// output; the same case without them is the expected result.
TEST(SdpaRefEdge, NaNInfInMaskedKeysDoNotLeak) {
  std::vector<Case> cases;
  Case c;
  c.batch = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 5;
  c.head_dim_v = 3;
  c.seqlen_q = 4;
  c.seqlen_k = 9;
  c.causal = true;
  c.seqlens_k = {7, 3};
  cases.push_back(c);
  c.causal = false;
  c.seqlens_k = {};
  c.window = {1, 1};
  cases.push_back(c);
  c.window = {-1, -1};
  c.mask = MaskKind::kBool;
  c.mask_full = {true, false, false, true};  // key padding mask
  cases.push_back(c);
  c.mask = MaskKind::kAdditive;
  c.mask_keep = 0.5;
  cases.push_back(c);
  c.mask = MaskKind::kNone;
  c.sparse = {SparsePattern::Kind::kStrided, 2, 2, 1};
  c.seqlen_q = 2;
  c.seqlen_k = 12;
  cases.push_back(c);
  c.bf16_kv = true;
  cases.push_back(c);

  uint64_t seed = 9100;
  for (Case& e : cases) {
    e.seed = seed++;
    SCOPED_TRACE(e.describe());
    const Outcome clean = run(e);
    // A key row (b, j, g) is used iff some head of group g has a nonzero
    // probability on it (scores are bounded, so no visible weight underflows).
    const int64_t group = e.num_heads / e.num_kv_heads;
    std::vector<uint8_t> used(size_t(e.batch * e.seqlen_k * e.num_kv_heads), 0);
    for (int64_t b = 0; b < e.batch; ++b)
      for (int64_t h = 0; h < e.num_heads; ++h)
        for (int64_t i = 0; i < e.seqlen_q; ++i)
          for (int64_t j = 0; j < e.seqlen_k; ++j)
            if (clean.ref.probs[size_t(((b * e.num_heads + h) * e.seqlen_q + i) * e.seqlen_k + j)] >
                0.0)
              used[size_t((b * e.seqlen_k + j) * e.num_kv_heads + h / group)] = 1;
    size_t poisoned = 0;
    for (uint8_t u : used) poisoned += u ? 0 : 1;
    ASSERT_GT(poisoned, 0u) << e.describe();
    Case dirty = e;
    dirty.mutate = [&](std::vector<float>&, std::vector<float>& k, std::vector<float>& v) {
      for (size_t r = 0; r < used.size(); ++r) {
        if (used[r]) continue;
        const float bad = r % 3 == 0 ? kNaN : (r % 3 == 1 ? kInf : -kInf);
        for (int64_t d = 0; d < e.head_dim; ++d) k[r * size_t(e.head_dim) + size_t(d)] = bad;
        for (int64_t d = 0; d < e.head_dim_v; ++d) v[r * size_t(e.head_dim_v) + size_t(d)] = bad;
      }
    };
    const Outcome r = run(dirty);  // vs the oracle, which also never reads them
    EXPECT_TRUE(all_close("out vs clean", r.out, clean.out, Tolerance{0, 0}));
    EXPECT_TRUE(all_close("lse vs clean", r.lse, clean.lse, Tolerance{0, 0}));
    EXPECT_TRUE(all_close("probs vs clean", r.probs, clean.probs, Tolerance{0, 0}));
  }
}

// A NaN in a visible position poisons exactly the rows that read it.
TEST(SdpaRefEdge, UnmaskedNaNPoisonsOnlyItsRows) {
  Case c;
  c.batch = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.head_dim_v = 3;
  c.seqlen_q = 5;
  c.seqlen_k = 5;
  c.causal = true;
  // q NaN at (b0, i1, h3); K NaN at (b1, j2, g0); V NaN at (b0, j4, g1).
  c.mutate = [&](std::vector<float>& q, std::vector<float>& k, std::vector<float>& v) {
    q[size_t(((0 * 5 + 1) * 4 + 3) * 4 + 2)] = kNaN;
    k[size_t(((1 * 5 + 2) * 2 + 0) * 4 + 1)] = kNaN;
    v[size_t(((0 * 5 + 4) * 2 + 1) * 3 + 0)] = kNaN;
  };
  const Outcome r = run(c);
  auto row_nan = [&](int64_t b, int64_t i, int64_t h) {
    return std::isnan(r.out[size_t(((b * 5 + i) * 4 + h) * 3)]);
  };
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t h = 0; h < 4; ++h) {
        bool expect = (b == 0 && i == 1 && h == 3) ||      // its own query
                      (b == 1 && h / 2 == 0 && i >= 2) ||  // rows that see key 2 of group 0
                      (b == 0 && h / 2 == 1 && i == 4);    // only row 4 sees key 4
        EXPECT_EQ(row_nan(b, i, h), expect) << b << " " << i << " " << h;
        // A V NaN only touches the one output element it feeds.
        if (b == 0 && h / 2 == 1 && i == 4) {
          EXPECT_FALSE(std::isnan(r.out[size_t(((b * 5 + i) * 4 + h) * 3 + 1)]));
        }
      }
}

// Scores of +-1e30 (after scaling) must neither overflow nor turn into NaN.
// head_dim 1 and power-of-two scales keep every score exact in double, so
// the oracle and the kernel see identical scores despite the magnitude.
TEST(SdpaRefEdge, HugeLogitsStayFinite) {
  Case c;
  c.batch = 2;
  c.num_heads = 2;
  c.head_dim = 1;
  c.head_dim_v = 4;
  c.seqlen_q = 4;
  c.seqlen_k = 6;
  c.softmax_scale = 0x1p60f;
  for (bool causal : {false, true}) {
    c.causal = causal;
    c.mutate = [](std::vector<float>& q, std::vector<float>& k, std::vector<float>&) {
      // q, k in {+-2^20 * small integers}: scores up to ~ +-1.2e30, with ties.
      for (size_t i = 0; i < q.size(); ++i) q[i] = float(int(i % 3) - 1) * 0x1p20f;
      for (size_t i = 0; i < k.size(); ++i) k[i] = float(int(i % 5) - 2) * 0x1p19f * 0.75f;
    };
    const Outcome r = run(c);
    for (float x : r.out) EXPECT_TRUE(std::isfinite(x));
    for (float x : r.probs) EXPECT_TRUE(std::isfinite(x));
    for (size_t i = 0; i < r.lse.size(); ++i)
      if (std::isfinite(r.ref.lse[i])) {
        EXPECT_TRUE(std::isfinite(r.lse[i]));
      }
  }
}

// A -1e30 additive bias is a (very) negative score, not a mask: a row biased
// entirely by it still averages its values, and a key biased by it in an
// otherwise normal row gets weight exactly 0.
TEST(SdpaRefEdge, HugeNegativeBiasIsNotAMask) {
  Rng rng(9300);
  const auto q = attnkit_test::uniform_vector(2 * 8, rng);
  const auto k = attnkit_test::uniform_vector(3 * 8, rng);
  const auto v = attnkit_test::uniform_vector(3 * 8, rng);
  const std::vector<float> bias{-1e30f, -1e30f, -1e30f, 0.0f, -1e30f, 0.0f};  // [1, 1, 2, 3]
  std::vector<float> out(2 * 8, kOutSentinel), probs(2 * 3, kOutSentinel);
  attnkit::AttentionOptions opt;
  opt.mask = attnkit::make_view(bias.data(), DType::kF32, {1, 1, 2, 3});
  opt.backend = Backend::kReference;
  const attnkit::Status st =
      attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {1, 2, 1, 8}),
                    attnkit::make_view(k.data(), DType::kF32, {1, 3, 1, 8}),
                    attnkit::make_view(v.data(), DType::kF32, {1, 3, 1, 8}),
                    attnkit::make_view(out.data(), DType::kF32, {1, 2, 1, 8}), opt, TensorView{},
                    attnkit::make_view(probs.data(), DType::kF32, {1, 1, 2, 3}));
  ASSERT_TRUE(st.ok()) << st.to_string();
  OracleOptions o;
  o.seqlen_q = 2;
  o.seqlen_k = 3;
  o.head_dim = o.head_dim_v = 8;
  o.mask_shape = {1, 1, 2, 3};
  o.add_mask = std::vector<double>(bias.begin(), bias.end());
  const OracleResult ref = attnkit_test::attention_f64(
      o, attnkit_test::widen(q), attnkit_test::widen(k), attnkit_test::widen(v));
  Case c;
  const double rel = derived_rel(c, 1.0, 1.0);
  EXPECT_TRUE(all_close("out", out, ref.out, Tolerance{rel, rel}));
  EXPECT_TRUE(all_close("probs", probs, ref.probs, Tolerance{0x1p-149, rel}));
  // -1e30 swamps every score in double, so row 0 is a plain average.
  for (int64_t j = 0; j < 3; ++j) EXPECT_FLOAT_EQ(probs[size_t(j)], 1.0f / 3.0f);
  EXPECT_EQ(probs[4], 0.0f);
  EXPECT_GT(probs[3], 0.0f);
}

// ---------------------------------------------------------------------------
// merge_attention_states: attending two disjoint key sets with lse and
// merging equals attending over their union.
//
// Bound: each half's out and lse carry the sdpa error above (rel_a), and the
// merge rounds once more (u). A lse error of e changes a weight by a relative
// e, and shifts out by <= 2e max|v|; lse enters as |lse| * rel_a. So
// rel_merge = 2 (rel_a (2 + 2 max|lse|) + u) against the full attention.

struct Split {
  std::vector<float> out_a, lse_a, out_b, lse_b, out_full, lse_full;
  double rel = 0.0;
  double lse_max = 0.0;
};

Split attend_split(int64_t B, int64_t Sq, int64_t Sk, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                   int64_t cut, double keep, uint64_t seed) {
  Rng rng(seed);
  auto q = attnkit_test::uniform_vector(size_t(B * Sq * H * D), rng);
  auto k = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * D), rng);
  auto v = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * Dv), rng);
  std::vector<uint8_t> mask(size_t(B * H * Sq * Sk));
  for (auto& m : mask) m = rng.coin(keep) ? 1 : 0;
  Split s;
  s.out_full.assign(size_t(B * Sq * H * Dv), 0.0f);
  s.lse_full.assign(size_t(B * H * Sq), 0.0f);
  s.out_a = s.out_b = s.out_full;
  s.lse_a = s.lse_b = s.lse_full;
  attnkit::AttentionOptions opt;
  opt.backend = Backend::kReference;
  const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, Sq, H, D});
  auto part = [&](int64_t j0, int64_t n, std::vector<float>& out, std::vector<float>& lse) {
    TensorView kv = attnkit::make_view(k.data(), DType::kF32, {B, Sk, Hkv, D});
    TensorView vv = attnkit::make_view(v.data(), DType::kF32, {B, Sk, Hkv, Dv});
    TensorView mv = attnkit::make_view(mask.data(), DType::kBool, {B, H, Sq, Sk});
    kv.data = k.data() + j0 * kv.strides[1];
    vv.data = v.data() + j0 * vv.strides[1];
    mv.data = mask.data() + j0;
    kv.shape[1] = vv.shape[1] = mv.shape[3] = n;
    opt.mask = mv;
    const attnkit::Status st =
        attnkit::sdpa(qv, kv, vv, attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, Dv}), opt,
                      attnkit::make_view(lse.data(), DType::kF32, {B, H, Sq}));
    EXPECT_TRUE(st.ok()) << st.to_string();
  };
  part(0, cut, s.out_a, s.lse_a);
  part(cut, Sk - cut, s.out_b, s.lse_b);
  part(0, Sk, s.out_full, s.lse_full);
  Case c;
  c.head_dim = D;
  c.seqlen_k = Sk;
  const double rel_a = derived_rel(c, 1.0, 1.0);
  s.lse_max = std::max({max_abs_finite(s.lse_a), max_abs_finite(s.lse_b), 1.0});
  s.rel = 2.0 * (rel_a * (2.0 + 2.0 * s.lse_max) + kU32);
  return s;
}

TEST(MergeStates, SplitKeysEqualsFullAttention) {
  uint64_t seed = 11000;
  for (auto [Sk, cut] : {std::pair<int64_t, int64_t>{10, 5}, {9, 1}, {9, 8}, {16, 11}})
    for (double keep : {1.0, 0.5, 0.15}) {
      const int64_t B = 2, Sq = 4, H = 4, Hkv = 2, D = 6, Dv = 5;
      Split s = attend_split(B, Sq, Sk, H, Hkv, D, Dv, cut, keep, seed++);
      std::vector<float> out(s.out_full.size(), kOutSentinel), lse(s.lse_full.size());
      const attnkit::Status st = attnkit::merge_attention_states(
          attnkit::make_view(s.out_a.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(s.lse_a.data(), DType::kF32, {B, H, Sq}),
          attnkit::make_view(s.out_b.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(s.lse_b.data(), DType::kF32, {B, H, Sq}),
          attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(lse.data(), DType::kF32, {B, H, Sq}));
      ASSERT_TRUE(st.ok()) << st.to_string();
      double ratio = 0.0;
      EXPECT_TRUE(all_close("merged out", out, s.out_full, Tolerance{s.rel, s.rel}, &ratio));
      note_worst(ratio, s.rel, "merge out");
      EXPECT_TRUE(all_close("merged lse", lse, s.lse_full, Tolerance{s.rel, s.rel}));
      // Aliased form: out = out_a, lse = lse_a.
      const attnkit::Status st2 = attnkit::merge_attention_states(
          attnkit::make_view(s.out_a.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(s.lse_a.data(), DType::kF32, {B, H, Sq}),
          attnkit::make_view(s.out_b.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(s.lse_b.data(), DType::kF32, {B, H, Sq}),
          attnkit::make_view(s.out_a.data(), DType::kF32, {B, Sq, H, Dv}),
          attnkit::make_view(s.lse_a.data(), DType::kF32, {B, H, Sq}));
      ASSERT_TRUE(st2.ok()) << st2.to_string();
      EXPECT_TRUE(all_close("aliased out", s.out_a, out, Tolerance{0, 0}));
      EXPECT_TRUE(all_close("aliased lse", s.lse_a, lse, Tolerance{0, 0}));
    }
}

TEST(MergeStates, InfiniteLseSides) {
  // Row 0: both sides empty. Row 1: only b. Row 2: only a. Row 3: both.
  // The empty sides carry NaN outputs, which must not leak.
  const std::vector<float> lse_a{-kInf, -kInf, 0.5f, 1.0f}, lse_b{-kInf, 2.0f, -kInf, -1.0f};
  // out [1, 4, 1, 1]: one value per row.
  const std::vector<float> out_a{kNaN, kInf, 7.0f, 1.0f}, out_b{kNaN, 4.0f, -kInf, 5.0f};
  std::vector<float> out(4, kOutSentinel), lse(4, kOutSentinel);
  const attnkit::Status st =
      attnkit::merge_attention_states(attnkit::make_view(out_a.data(), DType::kF32, {1, 4, 1, 1}),
                                      attnkit::make_view(lse_a.data(), DType::kF32, {1, 1, 4}),
                                      attnkit::make_view(out_b.data(), DType::kF32, {1, 4, 1, 1}),
                                      attnkit::make_view(lse_b.data(), DType::kF32, {1, 1, 4}),
                                      attnkit::make_view(out.data(), DType::kF32, {1, 4, 1, 1}),
                                      attnkit::make_view(lse.data(), DType::kF32, {1, 1, 4}));
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(lse[0], -kInf);
  EXPECT_EQ(out[1], 4.0f);
  EXPECT_EQ(lse[1], 2.0f);
  EXPECT_EQ(out[2], 7.0f);
  EXPECT_EQ(lse[2], 0.5f);
  const double wa = 1.0, wb = std::exp(-2.0);
  EXPECT_NEAR(out[3], (wa * 1.0 + wb * 5.0) / (wa + wb), 4 * kU32 * 5.0);
  EXPECT_NEAR(lse[3], 1.0 + std::log1p(wb), 4 * kU32 * 2.0);
}

// A NaN lse (a row poisoned upstream) stays NaN after merging, in that row
// only; it must not be mistaken for an empty row (out 0, lse -inf).
TEST(MergeStates, NaNLsePoisonsOnlyItsRow) {
  const std::vector<float> lse_a{kNaN, 0.0f, 0.25f}, lse_b{0.0f, kNaN, -0.5f};
  const std::vector<float> out_a{1.0f, 2.0f, 3.0f}, out_b{4.0f, 5.0f, 6.0f};
  std::vector<float> out(3, kOutSentinel), lse(3, kOutSentinel);
  ASSERT_TRUE(
      attnkit::merge_attention_states(attnkit::make_view(out_a.data(), DType::kF32, {1, 3, 1, 1}),
                                      attnkit::make_view(lse_a.data(), DType::kF32, {1, 1, 3}),
                                      attnkit::make_view(out_b.data(), DType::kF32, {1, 3, 1, 1}),
                                      attnkit::make_view(lse_b.data(), DType::kF32, {1, 1, 3}),
                                      attnkit::make_view(out.data(), DType::kF32, {1, 3, 1, 1}),
                                      attnkit::make_view(lse.data(), DType::kF32, {1, 1, 3}))
          .ok());
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(lse[0]));
  EXPECT_TRUE(std::isnan(out[1]) && std::isnan(lse[1]));
  const double wa = 1.0, wb = std::exp(-0.75);
  EXPECT_NEAR(out[2], (wa * 3.0 + wb * 6.0) / (wa + wb), 4 * kU32 * 6.0);
  EXPECT_NEAR(lse[2], 0.25 + std::log1p(wb), 4 * kU32);
}

TEST(MergeStates, AllEmptyFromSdpa) {
  // An all-false mask empties both halves: every merged row is out 0,
  // lse -inf.
  Split s = attend_split(1, 3, 6, 2, 1, 4, 4, 3, 0.0, 12000);
  for (float x : s.lse_a) EXPECT_EQ(x, -kInf);
  for (float x : s.lse_b) EXPECT_EQ(x, -kInf);
  std::vector<float> out(s.out_full.size(), kOutSentinel), lse(s.lse_full.size(), 0.0f);
  ASSERT_TRUE(
      attnkit::merge_attention_states(attnkit::make_view(s.out_a.data(), DType::kF32, {1, 3, 2, 4}),
                                      attnkit::make_view(s.lse_a.data(), DType::kF32, {1, 2, 3}),
                                      attnkit::make_view(s.out_b.data(), DType::kF32, {1, 3, 2, 4}),
                                      attnkit::make_view(s.lse_b.data(), DType::kF32, {1, 2, 3}),
                                      attnkit::make_view(out.data(), DType::kF32, {1, 3, 2, 4}),
                                      attnkit::make_view(lse.data(), DType::kF32, {1, 2, 3}))
          .ok());
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -kInf);
}

}  // namespace
