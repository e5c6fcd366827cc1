// libFuzzer target: the attention entry points (sdpa, KVCache::attend,
// merge_attention_states) on fuzzer-chosen shapes, strides, dtypes, masks,
// options, thread counts and SIMD targets (the AVX-512 ones on emulated
// intrinsics where the CPU lacks them; fuzz/CMakeLists.txt). The input's
// first byte picks a mode:
//
//   sdpa     a valid call, run with Backend::kFast and Backend::kReference;
//            every output row that sees no non-finite input must agree
//            within the bound derived below, fully masked rows must be
//            exactly 0 with lse -inf (with sinks: lse = the head's sink),
//            and nothing outside the output views may change. Chunks and
//            sinks (from -1e30 to 1e30) are drawn like the other options.
//   bad      the same call with exactly one rule broken (rank, dtype, shape,
//            head divisibility, stride, window, seqlens_k, scale, softcap,
//            mask, sparse pattern, backend, threads, overlap, overflow,
//            chunk_size, sinks):
//            it must fail with a message and leave every output byte as it
//            was.
//   cache    a KVCache fed in random chunks (f32, bf16, int8 or fp8_e4m3,
//            with a sliding window, chunks or neither, sinks or not, one
//            bad call in between)
//            against the reference sdpa over the whole history as the cache
//            stores it (8-bit: dequantized by tests/common/kv_quant_f64.h's
//            rule); a failed call must leave the cache and `out` untouched.
//   merge    sdpa over two halves of the keys merged by
//            merge_attention_states (in place, as the cache does) against
//            sdpa over all keys.
//
// Every buffer is allocated at exactly the extent its view addresses, so
// ASan reports any read or write past a view. Values come from a PRNG seeded
// by the input (the bulk) plus up to four fuzzer-placed special values (NaN,
// +-Inf, +-1e30, 3e38, a subnormal, -0).
//
// Tolerance, per output row of the fast kernel against the float64
// reference (the same derivation as tests/kernels/attention_fast_test.cc),
// with u = 2^-24, n = visible keys, S = scale * max_j sum_d |q_d k_jd| and
// Vmax = max |v| over the visible keys:
//   score error  E <= (d + 4) u S + d 2^-149 (Kmax + 1)      (subnormal products)
//                     + 8 u cap (softcap)  + u (S + max|bias|) (additive mask)
//                     + 2^-8 S + d 2^-126 (scale Qmax + Kmax + 1) on avx512bf16
//                       with bf16 K/V (q rounded to bf16; vdpbf16ps treats
//                       subnormal inputs and products as 0)
//   out error      <= Vmax (expm1(2E) + (3n + 48) u + n 2^-126)   (exp flushes
//                     below e^-87.3) + (3n + 32) 2^-149
//                     + Vmax 2^-8 + 2^-125 on avx512bf16 (bf16 weights, DAZ)
// 8-bit caches: the reference reads the dequantized values rounded to
// fp32 (u relative), and the fast kernel may dequantize tiles to bf16 on
// avx512bf16 (E + 2^-8 S more, out + Vmax 2^-8 more), round int8 decode's
// queries to int16 (E + scale Qmax d Kmax / 58714) and its weights to int16
// (out + Vmax 2^-10; src/kernels/cpu/kernel_table.h).
//   lse error      <= E + (3n + 48) u + 4 u |lse|
// Rows are compared only where fp32 can hold the computation: S, max|scale
// q|, max|bias| and n * Vmax below 1e37 (docs/RELIABILITY.md states this
// range; beyond it the fast kernel may give +-Inf or NaN where the float64
// reference is finite).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"
#include "common/emulated_kernels.h"
#include "common/kv_quant_f64.h"
#include "common/views.h"
#include "core/cpu_features.h"
#include "kernels/dispatch.h"

namespace {

using attnkit::AttentionOptions;
using attnkit::Backend;
using attnkit::DType;
using attnkit::SparsePattern;
using attnkit::Status;
using attnkit::TensorView;

constexpr double kU = 0x1p-24;
constexpr double kRange = 1e37;  // fp32 headroom below FLT_MAX (3.4e38)
constexpr float kSentinel = -7777.25f;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The current case in words, printed with a failure.
std::string g_case;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "attention_fuzz: %s\n  case: %s\n", what.c_str(), g_case.c_str());
  std::abort();
}

// ---- views over exactly-sized buffers ------------------------------------

// A rank-4 layout: logical shape, element strides, and the buffer size that
// holds exactly its addressed extent (at least 1, so data is never null).
struct Layout {
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> strides{};
  size_t elems = 1;

  int64_t at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3];
  }
};

// Strides in a fuzzer-chosen physical order (row-major, heads-major, or with
// the last dim not innermost), each padded by 0..3 elements; `unit_last`
// forces the last dim innermost with stride 1 (the fast kernel's K/V rows).
// `allow_zero` lets one dim of an input broadcast with stride 0.
Layout make_layout(FuzzedDataProvider& fdp, std::array<int64_t, 4> shape, bool unit_last,
                   bool allow_zero) {
  static constexpr int kOrders[4][4] = {{3, 2, 1, 0}, {3, 1, 2, 0}, {3, 2, 0, 1}, {2, 3, 1, 0}};
  Layout l;
  l.shape = shape;
  const int* order = kOrders[unit_last ? fdp.ConsumeIntegralInRange<int>(0, 2)
                                       : fdp.ConsumeIntegralInRange<int>(0, 3)];
  const bool padded = fdp.ConsumeBool();
  // Last-dim step 2 (with unit_last off): K/V then take the reference path.
  const int64_t step = !unit_last && fdp.ConsumeBool() ? 2 : 1;
  int64_t running = 1;
  for (int r = 0; r < 4; ++r) {
    const int axis = order[r];
    l.strides[axis] = running * (axis == 3 ? step : 1);
    const int64_t pad = padded ? fdp.ConsumeIntegralInRange<int64_t>(0, 3) : 0;
    running = l.strides[axis] * std::max<int64_t>(shape[axis], 1) + pad;
  }
  if (allow_zero && fdp.ConsumeIntegralInRange<int>(0, 15) == 0)
    l.strides[fdp.ConsumeIntegralInRange<int>(0, 2)] = 0;
  int64_t extent = 0;
  bool empty = false;
  for (int i = 0; i < 4; ++i) {
    if (shape[i] == 0) empty = true;
    extent += (std::max<int64_t>(shape[i], 1) - 1) * l.strides[i];
  }
  l.elems = empty ? 1 : static_cast<size_t>(extent + 1);
  return l;
}

TensorView view(void* data, DType dtype, const Layout& l, int rank = 4) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = rank;
  for (int i = 0; i < rank; ++i) {
    v.shape[i] = l.shape[i];
    v.strides[i] = l.strides[i];
  }
  return v;
}

// f32 storage, or bf16 storage (K/V only) holding bf16-exact values.
struct Buffer {
  DType dtype = DType::kF32;
  std::vector<float> f;
  std::vector<attnkit::bf16> h;

  void allocate(DType dt, size_t n) {
    dtype = dt;
    if (dt == DType::kBF16)
      h.assign(n, attnkit::float_to_bf16(kSentinel));
    else
      f.assign(n, kSentinel);
  }
  void* data() { return dtype == DType::kBF16 ? static_cast<void*>(h.data()) : f.data(); }
  size_t bytes() const { return dtype == DType::kBF16 ? h.size() * 2 : f.size() * 4; }
  void set(int64_t i, float x) {
    if (dtype == DType::kBF16)
      h[static_cast<size_t>(i)] = attnkit::float_to_bf16(x);
    else
      f[static_cast<size_t>(i)] = x;
  }
  double get(int64_t i) const {
    return dtype == DType::kBF16 ? attnkit::bf16_to_float(h[static_cast<size_t>(i)])
                                 : f[static_cast<size_t>(i)];
  }
};

float special_value(int kind) {
  switch (kind) {
    case 0:
      return kNaN;
    case 1:
      return kInf;
    case 2:
      return -kInf;
    case 3:
      return 1e30f;
    case 4:
      return -1e30f;
    case 5:
      return 3e38f;
    case 6:
      return 1e-40f;  // subnormal
    default:
      return -0.0f;
  }
}

Backend pick_backend(FuzzedDataProvider& fdp) {
  return fdp.ConsumeBool() ? Backend::kFast : Backend::kAuto;
}

// The target the fast calls run now (compare() derives its bound from it):
// one the CPU has, or an AVX-512 one it lacks on emulated intrinsics where
// this build links them (fuzz/CMakeLists.txt).
attnkit::kernels::TestedTarget g_target{attnkit::SimdTarget::kScalar, nullptr};

void pick_simd_target(FuzzedDataProvider& fdp) {
  static const std::vector<attnkit::kernels::TestedTarget> targets =
      attnkit::kernels::tested_targets();
  g_target = targets[fdp.ConsumeIntegralInRange<size_t>(0, targets.size() - 1)];
  if (g_target.kernels == nullptr) attnkit::set_simd_target(g_target.target);
  attnkit::kernels::set_kernels_for_testing(g_target.target, g_target.kernels);
  g_case += std::string(" target=") + attnkit::simd_target_name(g_target.target) +
            (g_target.kernels ? "(emulated)" : "");
}

// ---- one sdpa problem ----------------------------------------------------

enum class MaskKind { kNone, kBool, kAdd };

struct Problem {
  int64_t batch = 1, sq = 1, sk = 1, heads = 1, kv_heads = 1, d = 1, dv = 1;
  DType kv = DType::kF32;
  AttentionOptions opt;
  std::vector<int32_t> seqlens;
  std::vector<float> sinks;  // [heads] behind opt.sinks, or empty
  MaskKind mask = MaskKind::kNone;
  std::array<int64_t, 4> mask_shape{1, 1, 1, 1};
  Layout ql, kl, vl, ol, ml;
  std::vector<float> q, mask_add;
  std::vector<uint8_t> mask_bool;
  Buffer k, v;
  bool want_lse = false, want_probs = false;
  std::vector<std::array<int64_t, 5>> poisons;  // tensor (0 q, 1 k, 2 v, 3 mask), indices

  double scale() const {
    return opt.softmax_scale > 0.0f
               ? static_cast<double>(opt.softmax_scale)
               : static_cast<double>(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  }
  TensorView qv() { return view(q.data(), DType::kF32, ql); }
  TensorView kv_view(bool key) { return key ? view(k.data(), kv, kl) : view(v.data(), kv, vl); }
  int64_t mask_index(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const auto& s = mask_shape;
    return ml.at(s[0] == 1 ? 0 : b, s[1] == 1 ? 0 : h, s[2] == 1 ? 0 : i, s[3] == 1 ? 0 : j);
  }
};

int64_t pick_size(FuzzedDataProvider& fdp, int64_t small_max, int64_t large_max) {
  // Mostly small (fast to check), sometimes past a tile (64 keys) or a
  // decode split (512 keys).
  return fdp.ConsumeIntegralInRange<int>(0, 7) == 0
             ? fdp.ConsumeIntegralInRange<int64_t>(0, large_max)
             : fdp.ConsumeIntegralInRange<int64_t>(0, small_max);
}

int64_t pick_chunk(FuzzedDataProvider& fdp) {
  static constexpr int64_t kChunks[] = {1,  2,  3,  7,    16,
                                        63, 64, 65, 1000, std::numeric_limits<int64_t>::max()};
  return kChunks[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kChunks) - 1)];
}

// One sink logit per query head, from far below to far above any score
// (e^88.8 overflows fp32; 1e30 overflows everything).
std::vector<float> pick_sinks(FuzzedDataProvider& fdp, int64_t heads) {
  static constexpr float kSinks[] = {0.0f, -1.0f, 2.5f, -30.0f, 40.0f, 88.8f, 1e30f, -1e30f};
  std::vector<float> sinks(static_cast<size_t>(heads));
  for (float& x : sinks) x = kSinks[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kSinks) - 1)];
  return sinks;
}

int64_t pick_window(FuzzedDataProvider& fdp) {
  static constexpr int64_t kWindows[] = {-1,
                                         -1,
                                         0,
                                         1,
                                         2,
                                         3,
                                         7,
                                         64,
                                         1000,
                                         std::numeric_limits<int64_t>::max() / 2,
                                         std::numeric_limits<int64_t>::max()};
  return kWindows[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kWindows) - 1)];
}

Problem make_problem(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  Problem p;
  p.batch = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  p.sq = pick_size(fdp, 6, 40);
  p.sk = pick_size(fdp, 20, 700);
  p.kv_heads = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  p.heads = p.kv_heads * fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  p.d = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  p.dv = fdp.ConsumeBool() ? p.d : fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  p.kv = fdp.ConsumeBool() ? DType::kBF16 : DType::kF32;
  // Keep one call's reference work small enough for thousands of runs.
  while (p.batch * p.sq * p.sk * p.heads * (p.d + p.dv) > 3'000'000) p.sk /= 2;

  static constexpr float kScales[] = {0.0f, 0.0f, 0.125f, 1.0f, 3.0f, 0x1p60f, 1e-30f, 1e-40f};
  p.opt.softmax_scale = kScales[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kScales) - 1)];
  static constexpr float kCaps[] = {0.0f, 0.0f, 0.5f, 5.0f, 30.0f, 1e-30f, 0x1p-126f, 1e30f};
  p.opt.softcap = kCaps[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kCaps) - 1)];
  p.opt.causal = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) p.opt.window_size = {pick_window(fdp), pick_window(fdp)};
  if (fdp.ConsumeBool()) {
    p.seqlens.resize(static_cast<size_t>(p.batch));
    for (int32_t& n : p.seqlens)
      n = static_cast<int32_t>(fdp.ConsumeIntegralInRange<int64_t>(0, p.sk));
    p.opt.seqlens_k = p.seqlens;
  }
  const int sparse = fdp.ConsumeIntegralInRange<int>(0, 5);
  if (sparse == 1 || sparse == 2) {
    p.opt.sparse.kind = sparse == 1 ? SparsePattern::Kind::kStrided : SparsePattern::Kind::kFixed;
    p.opt.sparse.block_size = fdp.ConsumeIntegralInRange<int64_t>(1, 8);
    p.opt.sparse.stride = fdp.ConsumeIntegralInRange<int64_t>(1, 5);
    p.opt.sparse.summary = fdp.ConsumeIntegralInRange<int64_t>(1, p.opt.sparse.stride);
  }
  p.opt.num_threads = fdp.ConsumeIntegralInRange<int>(0, 4);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) p.opt.chunk_size = pick_chunk(fdp);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    p.sinks = pick_sinks(fdp, p.heads);
    p.opt.sinks = attnkit::make_view(p.sinks.data(), DType::kF32, {p.heads});
  }
  p.want_lse = fdp.ConsumeBool();
  p.want_probs = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;

  p.ql = make_layout(fdp, {p.batch, p.sq, p.heads, p.d}, false, true);
  p.kl = make_layout(fdp, {p.batch, p.sk, p.kv_heads, p.d},
                     fdp.ConsumeIntegralInRange<int>(0, 5) != 0, true);
  p.vl = make_layout(fdp, {p.batch, p.sk, p.kv_heads, p.dv},
                     fdp.ConsumeIntegralInRange<int>(0, 5) != 0, true);
  p.ol = make_layout(fdp, {p.batch, p.sq, p.heads, p.dv}, false, false);

  const int mask = fdp.ConsumeIntegralInRange<int>(0, 3);
  p.mask = mask == 1 ? MaskKind::kBool : mask == 2 ? MaskKind::kAdd : MaskKind::kNone;
  if (p.mask != MaskKind::kNone) {
    const std::array<int64_t, 4> full{p.batch, p.heads, p.sq, p.sk};
    for (int i = 0; i < 4; ++i) p.mask_shape[i] = fdp.ConsumeBool() ? full[i] : 1;
    p.ml = make_layout(fdp, p.mask_shape, false, false);
  }

  // Values: uniform in [-r, r] with a fuzzer-chosen magnitude per tensor.
  static constexpr float kMagnitudes[] = {1.0f, 4.0f, 30.0f, 1e-3f, 1e4f, 1e-40f};
  auto magnitude = [&] {
    return kMagnitudes[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kMagnitudes) - 1)];
  };
  const float qr = magnitude(), kr = magnitude(), vr = magnitude();
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  p.q.assign(p.ql.elems, kSentinel);
  p.k.allocate(p.kv, p.kl.elems);
  p.v.allocate(p.kv, p.vl.elems);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t s = 0; s < std::max(p.sq, p.sk); ++s) {
      for (int64_t h = 0; h < p.heads && s < p.sq; ++h)
        for (int64_t x = 0; x < p.d; ++x)
          p.q[static_cast<size_t>(p.ql.at(b, s, h, x))] = qr * unit(rng);
      for (int64_t g = 0; g < p.kv_heads && s < p.sk; ++g) {
        for (int64_t x = 0; x < p.d; ++x) p.k.set(p.kl.at(b, s, g, x), kr * unit(rng));
        for (int64_t x = 0; x < p.dv; ++x) p.v.set(p.vl.at(b, s, g, x), vr * unit(rng));
      }
    }
  if (p.mask == MaskKind::kBool) {
    p.mask_bool.assign(p.ml.elems, 0);
    const int keep = fdp.ConsumeIntegralInRange<int>(0, 4);  // in quarters
    for (uint8_t& m : p.mask_bool) {
      const uint64_t r = rng();
      // Any nonzero byte means keep, not just 1.
      m = static_cast<int>(r % 4) < keep ? static_cast<uint8_t>(1 + (r >> 8) % 255) : 0;
    }
  } else if (p.mask == MaskKind::kAdd) {
    p.mask_add.assign(p.ml.elems, 0.0f);
    const float br = magnitude();
    for (float& m : p.mask_add) m = rng() % 5 == 0 ? -kInf : br * unit(rng);
  }

  // Special values at fuzzer-chosen logical positions (in sized tensors).
  const int specials = fdp.ConsumeIntegralInRange<int>(0, 4);
  for (int n = 0; n < specials; ++n) {
    const int tensor = fdp.ConsumeIntegralInRange<int>(0, 3);
    const float x = special_value(fdp.ConsumeIntegralInRange<int>(0, 7));
    std::array<int64_t, 4> shape = tensor == 0   ? p.ql.shape
                                   : tensor == 1 ? p.kl.shape
                                   : tensor == 2 ? p.vl.shape
                                                 : p.mask_shape;
    if (tensor == 3 && p.mask != MaskKind::kAdd) continue;
    std::array<int64_t, 4> idx{};
    bool empty = false;
    for (int i = 0; i < 4; ++i) {
      if (shape[i] == 0) empty = true;
      idx[i] = fdp.ConsumeIntegralInRange<int64_t>(0, std::max<int64_t>(shape[i] - 1, 0));
    }
    if (empty) continue;
    if (tensor == 0) p.q[static_cast<size_t>(p.ql.at(idx[0], idx[1], idx[2], idx[3]))] = x;
    if (tensor == 1) p.k.set(p.kl.at(idx[0], idx[1], idx[2], idx[3]), x);
    if (tensor == 2) p.v.set(p.vl.at(idx[0], idx[1], idx[2], idx[3]), x);
    if (tensor == 3) p.mask_add[static_cast<size_t>(p.ml.at(idx[0], idx[1], idx[2], idx[3]))] = x;
  }
  if (p.mask == MaskKind::kBool) {
    TensorView m = view(p.mask_bool.data(), DType::kBool, p.ml);
    m.shape = p.mask_shape;
    p.opt.mask = m;
  } else if (p.mask == MaskKind::kAdd) {
    TensorView m = view(p.mask_add.data(), DType::kF32, p.ml);
    m.shape = p.mask_shape;
    p.opt.mask = m;
  }
  char buf[600];
  std::snprintf(
      buf, sizeof buf,
      "batch=%lld sq=%lld sk=%lld heads=%lld/%lld d=%lld dv=%lld kv=%s scale=%g "
      "softcap=%g causal=%d window=(%lld,%lld) seqlens=%zu mask=%d(%lld,%lld,%lld,%lld) "
      "sparse=%d/%lld/%lld/%lld chunk=%lld sinks=%g.. threads=%d lse=%d probs=%d "
      "magnitudes=%g/%g/%g specials=%d",
      static_cast<long long>(p.batch), static_cast<long long>(p.sq), static_cast<long long>(p.sk),
      static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
      static_cast<long long>(p.d), static_cast<long long>(p.dv), attnkit::dtype_name(p.kv),
      static_cast<double>(p.opt.softmax_scale), static_cast<double>(p.opt.softcap), p.opt.causal,
      static_cast<long long>(p.opt.window_size.left),
      static_cast<long long>(p.opt.window_size.right), p.seqlens.size(), static_cast<int>(p.mask),
      static_cast<long long>(p.mask_shape[0]), static_cast<long long>(p.mask_shape[1]),
      static_cast<long long>(p.mask_shape[2]), static_cast<long long>(p.mask_shape[3]),
      static_cast<int>(p.opt.sparse.kind), static_cast<long long>(p.opt.sparse.block_size),
      static_cast<long long>(p.opt.sparse.stride), static_cast<long long>(p.opt.sparse.summary),
      static_cast<long long>(p.opt.chunk_size),
      p.sinks.empty() ? 0.0 : static_cast<double>(p.sinks[0]), p.opt.num_threads, p.want_lse,
      p.want_probs, static_cast<double>(qr), static_cast<double>(kr), static_cast<double>(vr),
      specials);
  g_case = buf;
  return p;
}

// ---- the visibility rules of attention.h, restated ----------------------

int64_t floor_div(int64_t a, int64_t m) {
  int64_t r = a % m;
  if (r < 0) r += m;  // (a % m + m) % m would overflow for m near INT64_MAX
  return (a - r) / m;
}

bool pattern_admits(const SparsePattern& sp, int64_t p, int64_t j) {
  if (sp.kind == SparsePattern::Kind::kNone) return true;
  const int64_t a = floor_div(p, sp.block_size), b = floor_div(j, sp.block_size), l = sp.stride;
  if (sp.kind == SparsePattern::Kind::kStrided) {
    const int64_t dist = a > b ? a - b : b - a;
    return dist < l || (((a - b) % l) + l) % l == 0;
  }
  return floor_div(a, l) == floor_div(b, l) || ((b % l) + l) % l >= l - sp.summary;
}

// Whether key j is visible to row i of (b, h), by attention.h's rules
// (positions compared in 128 bits: windows may be near INT64_MAX).
bool visible(const Problem& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t L = p.seqlens.empty() ? p.sk : p.seqlens[static_cast<size_t>(b)];
  const __int128 pos = static_cast<__int128>(i) + L - p.sq;
  if (j >= L) return false;
  if (p.opt.causal && j > pos) return false;
  if (p.opt.window_size.left >= 0 && j < pos - p.opt.window_size.left) return false;
  if (p.opt.window_size.right >= 0 && j > pos + p.opt.window_size.right) return false;
  if (p.opt.chunk_size > 0 &&
      floor_div(j, p.opt.chunk_size) != floor_div(static_cast<int64_t>(pos), p.opt.chunk_size))
    return false;
  if (!pattern_admits(p.opt.sparse, static_cast<int64_t>(pos), j)) return false;
  if (p.mask == MaskKind::kBool && p.mask_bool[static_cast<size_t>(p.mask_index(b, h, i, j))] == 0)
    return false;
  if (p.mask == MaskKind::kAdd &&
      p.mask_add[static_cast<size_t>(p.mask_index(b, h, i, j))] == -kInf)
    return false;
  return true;
}

// ---- comparison ------------------------------------------------------------

struct Outputs {
  std::vector<float> out, lse, probs;
  Layout lse_l, probs_l;
};

Outputs allocate_outputs(const Problem& p) {
  Outputs o;
  o.out.assign(p.ol.elems, kSentinel);
  o.lse_l.shape = {p.batch, p.heads, p.sq, 1};
  o.lse_l.strides = {p.heads * p.sq + 1, p.sq, 1, 1};  // a gap after each batch item
  o.lse_l.elems = static_cast<size_t>(std::max<int64_t>(1, p.batch * (p.heads * p.sq + 1)));
  o.lse.assign(o.lse_l.elems, kSentinel);
  o.probs_l.shape = {p.batch, p.heads, p.sq, p.sk};
  o.probs_l.strides = {p.heads * p.sq * p.sk, p.sq * p.sk, p.sk, 1};
  o.probs_l.elems = static_cast<size_t>(std::max<int64_t>(1, p.batch * p.heads * p.sq * p.sk));
  o.probs.assign(o.probs_l.elems, kSentinel);
  return o;
}

Status run_sdpa(Problem& p, Outputs& o, Backend backend) {
  AttentionOptions opt = p.opt;
  opt.backend = backend;
  return attnkit::sdpa(p.qv(), p.kv_view(true), p.kv_view(false),
                       view(o.out.data(), DType::kF32, p.ol), opt,
                       p.want_lse ? view(o.lse.data(), DType::kF32, o.lse_l, 3) : TensorView{},
                       p.want_probs ? view(o.probs.data(), DType::kF32, o.probs_l) : TensorView{});
}

bool bits_equal(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Checks fast against reference row by row (see the header for the bound).
void compare(const Problem& p, const Outputs& fast, const Outputs& ref, const char* what) {
  const attnkit::SimdTarget target = g_target.target;
  const bool eight_bit = p.kv == DType::kI8 || p.kv == DType::kFp8E4M3;
  const bool dot_bf16 =
      (p.kv == DType::kBF16 || eight_bit) && target == attnkit::SimdTarget::kAvx512Bf16;
  const double scale = p.scale();
  const int64_t group = p.heads / p.kv_heads;
  double max_bias = 0.0;
  if (p.mask == MaskKind::kAdd)
    for (float m : p.mask_add)
      if (std::isfinite(m)) max_bias = std::max(max_bias, std::fabs(static_cast<double>(m)));

  // Logical output positions, so that everything else can be checked to
  // still hold the sentinel.
  std::vector<uint8_t> logical(fast.out.size(), 0);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.sq; ++i)
      for (int64_t h = 0; h < p.heads; ++h) {
        for (int64_t c = 0; c < p.dv; ++c) logical[static_cast<size_t>(p.ol.at(b, i, h, c))] = 1;
        const int64_t g = h / group;
        const size_t lse_at = static_cast<size_t>(b * fast.lse_l.strides[0] + h * p.sq + i);
        // Row statistics over the visible keys.
        bool any = false, poisoned = false;
        double s_max = 0.0, k_max = 0.0, v_max = 0.0, q_max = 0.0, n = 0.0;
        for (int64_t x = 0; x < p.d; ++x) {
          const double qx = p.q[static_cast<size_t>(p.ql.at(b, i, h, x))];
          if (!std::isfinite(qx)) poisoned = true;
          q_max = std::max(q_max, std::fabs(qx));
        }
        for (int64_t j = 0; j < p.sk; ++j) {
          if (!visible(p, b, h, i, j)) continue;
          any = true;
          n += 1.0;
          double dot = 0.0;
          for (int64_t x = 0; x < p.d; ++x) {
            const double kx = p.k.get(p.kl.at(b, j, g, x));
            if (!std::isfinite(kx)) poisoned = true;
            k_max = std::max(k_max, std::fabs(kx));
            dot += std::fabs(p.q[static_cast<size_t>(p.ql.at(b, i, h, x))]) * std::fabs(kx);
          }
          for (int64_t x = 0; x < p.dv; ++x) {
            const double vx = p.v.get(p.vl.at(b, j, g, x));
            if (!std::isfinite(vx)) poisoned = true;
            v_max = std::max(v_max, std::fabs(vx));
          }
          if (p.mask == MaskKind::kAdd &&
              !std::isfinite(p.mask_add[static_cast<size_t>(p.mask_index(b, h, i, j))]))
            poisoned = true;  // +inf or NaN bias (-inf is a mask, not visible)
          s_max = std::max(s_max, scale * dot);
        }
        if (!any) {
          // No visible key: exactly 0 and lse -inf (or the head's sink),
          // from both backends.
          for (const Outputs* o : {&fast, &ref})
            for (int64_t c = 0; c < p.dv; ++c)
              if (!bits_equal(o->out[static_cast<size_t>(p.ol.at(b, i, h, c))], 0.0f))
                fail(std::string(what) + ": a row without visible keys is not +0 (" +
                     (o == &fast ? "fast" : "reference") + ")");
          const float want = p.sinks.empty() ? -kInf : p.sinks[static_cast<size_t>(h)];
          if (p.want_lse && (fast.lse[lse_at] != want || ref.lse[lse_at] != want))
            fail(std::string(what) + ": a row without visible keys has lse != -inf (the sink)");
          continue;
        }
        if (poisoned) continue;  // touches NaN/Inf: may be NaN (docs/RELIABILITY.md)
        if (s_max > kRange || scale * q_max > kRange || max_bias > kRange || n * v_max > kRange)
          continue;  // beyond fp32's range (documented)

        double e = (p.d + 4) * kU * s_max + p.d * 0x1p-149 * (k_max + 1.0);
        if (p.opt.softcap > 0.0f) e += 8 * kU * p.opt.softcap;
        if (p.mask == MaskKind::kAdd) e += kU * (s_max + max_bias);
        // vdpbf16ps also treats subnormal bf16 inputs and products as 0.
        if (dot_bf16) e += 0x1p-8 * s_max + p.d * 0x1p-126 * (scale * q_max + k_max + 1.0);
        if (eight_bit) e += (dot_bf16 ? 0x1p-8 : 0.0) * s_max + 2 * kU * s_max;
        if (p.kv == DType::kI8) e += scale * q_max * p.d * k_max / 58714.0;
        if (e > 20.0) continue;  // the bound says nothing
        double out_bound = v_max * (std::expm1(2 * e) + (3 * n + 48) * kU + n * 0x1p-126) +
                           (3 * n + 32) * 0x1p-149;
        if (dot_bf16) out_bound += v_max * 0x1p-8 + 0x1p-125;
        if (eight_bit) out_bound += v_max * ((dot_bf16 ? 0x1p-8 : 0.0) + 4 * kU);
        if (p.kv == DType::kI8) out_bound += v_max * 0x1p-10;
        for (int64_t c = 0; c < p.dv; ++c) {
          const size_t at = static_cast<size_t>(p.ol.at(b, i, h, c));
          const double r = ref.out[at], f = fast.out[at];
          if (!std::isfinite(r))
            fail(std::string(what) + ": reference output not finite on a finite row");
          if (!(std::fabs(f - r) <= out_bound)) {
            char buf[512];
            std::snprintf(buf, sizeof buf,
                          "%s: out[b=%lld i=%lld h=%lld c=%lld] fast %.9g reference %.9g "
                          "|diff| %.3g > bound %.3g (S %.3g Vmax %.3g n %.0f E %.3g, target %s)",
                          what, static_cast<long long>(b), static_cast<long long>(i),
                          static_cast<long long>(h), static_cast<long long>(c), f, r,
                          std::fabs(f - r), out_bound, s_max, v_max, n, e,
                          attnkit::simd_target_name(target));
            fail(buf);
          }
        }
        if (p.want_lse) {
          const double r = ref.lse[lse_at], f = fast.lse[lse_at];
          const double bound = e + (3 * n + 48) * kU + 4 * kU * std::fabs(r);
          if (!(std::fabs(f - r) <= bound)) {
            char buf[256];
            std::snprintf(buf, sizeof buf, "%s: lse fast %.9g reference %.9g bound %.3g", what, f,
                          r, bound);
            fail(buf);
          }
        }
      }
  for (size_t x = 0; x < logical.size(); ++x)
    if (!logical[x] && (!bits_equal(fast.out[x], kSentinel) || !bits_equal(ref.out[x], kSentinel)))
      fail(std::string(what) + ": wrote outside the out view");
  if (p.want_lse)
    for (int64_t b = 0; b < p.batch; ++b) {
      const size_t gap = static_cast<size_t>(b * fast.lse_l.strides[0] + p.heads * p.sq);
      if (!bits_equal(fast.lse[gap], kSentinel) || !bits_equal(ref.lse[gap], kSentinel))
        fail(std::string(what) + ": wrote outside the lse view");
    }
}

void fuzz_sdpa(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  Problem p = make_problem(fdp, rng);
  pick_simd_target(fdp);
  Outputs fast = allocate_outputs(p), ref = allocate_outputs(p);
  const Status sf = run_sdpa(p, fast, pick_backend(fdp));
  const Status sr = run_sdpa(p, ref, Backend::kReference);
  if (!sf.ok()) fail("sdpa (fast) rejected a valid call: " + sf.to_string());
  if (!sr.ok()) fail("sdpa (reference) rejected a valid call: " + sr.to_string());
  compare(p, fast, ref, "sdpa");
}

// ---- bad inputs ------------------------------------------------------------

void fuzz_bad(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  Problem p = make_problem(fdp, rng);
  pick_simd_target(fdp);
  Outputs o = allocate_outputs(p);
  TensorView q = p.qv(), k = p.kv_view(true), v = p.kv_view(false);
  TensorView out = view(o.out.data(), DType::kF32, p.ol);
  TensorView lse = p.want_lse ? view(o.lse.data(), DType::kF32, o.lse_l, 3) : TensorView{};
  TensorView probs = p.want_probs ? view(o.probs.data(), DType::kF32, o.probs_l) : TensorView{};
  AttentionOptions opt = p.opt;
  opt.backend = pick_backend(fdp);
  std::vector<int32_t> seqlens = p.seqlens;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

  const int rule = fdp.ConsumeIntegralInRange<int>(0, 31);
  std::vector<float> bad_sinks(static_cast<size_t>(p.heads + 1), 0.5f);
  switch (rule) {
    case 0:
      q.rank = 3;
      break;
    case 1:
      k.dtype = DType::kF16;
      v.dtype = DType::kF16;
      break;
    case 2:
      v.dtype = p.kv == DType::kF32 ? DType::kBF16 : DType::kF32;
      break;
    case 3:
      q.dtype = DType::kBF16;
      break;
    case 4:
      out.dtype = DType::kBF16;
      break;
    case 5:
      k.shape[3] = p.d + 1;
      break;
    case 6:
      v.shape[1] = p.sk + 1;
      break;
    case 7:
      k.shape[2] = v.shape[2] = p.heads + 1;
      break;  // cannot divide num_heads
    case 8:
      out.shape[3] = p.dv + 1;
      break;
    case 9:
      q.shape[fdp.ConsumeIntegralInRange<int>(0, 3)] =
          -fdp.ConsumeIntegralInRange<int64_t>(1, kMax);
      break;
    case 10:
      k.strides[fdp.ConsumeIntegralInRange<int>(0, 3)] = -1;
      break;
    case 11:
      (fdp.ConsumeBool() ? q : v).data = nullptr;
      break;
    case 12:
      (fdp.ConsumeBool() ? opt.window_size.left : opt.window_size.right) =
          -fdp.ConsumeIntegralInRange<int64_t>(2, kMax);
      break;
    case 13:
      seqlens.assign(static_cast<size_t>(p.batch + 1), 0);
      opt.seqlens_k = seqlens;
      break;
    case 14:
      if (p.batch == 0) {
        q.rank = 5;
        break;
      }
      seqlens.assign(static_cast<size_t>(p.batch), 0);
      seqlens[fdp.ConsumeIntegralInRange<size_t>(0, seqlens.size() - 1)] =
          fdp.ConsumeBool() ? -1 : static_cast<int32_t>(p.sk + 1);
      opt.seqlens_k = seqlens;
      break;
    case 15: {
      static constexpr float kBad[] = {-1.0f, -1e-30f, kNaN, kInf, -kInf};
      opt.softmax_scale = kBad[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kBad) - 1)];
      break;
    }
    case 16: {
      static constexpr float kBad[] = {-1.0f, -1e-40f, 1e-40f,
                                       kNaN,  kInf,    -kInf};  // 1e-40: subnormal
      opt.softcap = kBad[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kBad) - 1)];
      break;
    }
    case 17:
      if (!opt.mask.present()) {
        opt.mask = view(p.q.data(), DType::kF32, p.ql);  // wrong sizes in general
        opt.mask.shape = {p.batch + 2, 1, 1, 1};
      } else {
        const int axis = fdp.ConsumeIntegralInRange<int>(0, 3);
        const std::array<int64_t, 4> full{p.batch, p.heads, p.sq, p.sk};
        opt.mask.shape[axis] = full[axis] + 1 == 1 ? 2 : full[axis] + 1;
      }
      break;
    case 18:
      if (!opt.mask.present()) opt.mask = view(p.q.data(), DType::kF32, p.ql);
      opt.mask.dtype = DType::kI32;
      break;
    case 19: {
      const int which = fdp.ConsumeIntegralInRange<int>(0, 3);
      opt.sparse.kind = SparsePattern::Kind::kFixed;
      opt.sparse.block_size = 1;
      opt.sparse.stride = 2;
      opt.sparse.summary = 1;
      if (which == 0) opt.sparse.block_size = -fdp.ConsumeIntegralInRange<int64_t>(0, kMax);
      if (which == 1) opt.sparse.stride = 0;
      if (which == 2) opt.sparse.summary = 3;
      if (which == 3) opt.sparse.kind = static_cast<SparsePattern::Kind>(7);
      break;
    }
    case 20:
      opt.backend = static_cast<Backend>(fdp.ConsumeIntegralInRange<int>(3, 255));
      break;
    case 21:
      opt.num_threads = -fdp.ConsumeIntegralInRange<int>(1, 1000);
      break;
    case 22:
      // out aliasing q: a write would clobber an input (or run past q's
      // buffer, which ASan would report). Empty views overlap nothing.
      if (p.batch * p.sq * p.heads == 0) {
        q.rank = 2;
        break;
      }
      out.data = q.data;
      break;
    case 23:
      // An out whose elements share memory; an empty out (any dim 0) has
      // none to share, so break another rule instead.
      if (p.batch * p.sq * p.heads * p.dv == 0) {
        out.rank = 2;
      } else if (p.sq >= 2) {
        out.strides[1] = 0;
      } else if (p.heads >= 2) {
        out.strides[2] = 0;
      } else {
        out.rank = 2;
      }
      break;
    case 24:
      lse = view(o.lse.data(), DType::kF32, o.lse_l, 3);
      lse.shape[2] = p.sq + 1;
      break;
    case 25:
      probs = view(o.probs.data(), DType::kF32, o.probs_l);
      probs.shape[3] = p.sk + 1;
      break;
    case 26:
      // shape * stride past 64-bit offsets (an empty view addresses nothing).
      if (p.batch == 0) {
        k.rank = 3;
        break;
      }
      k.shape[1] = std::max<int64_t>(p.sk, 2);
      k.strides[1] = kMax / 2 + fdp.ConsumeIntegralInRange<int64_t>(0, 1000);
      v.shape[1] = k.shape[1];
      break;
    case 27:
      // lse placed over out's first elements: outputs must not overlap.
      if (p.batch * p.heads * p.sq == 0) {
        q.rank = 1;  // no elements, so no overlap: break another rule instead
        break;
      }
      lse = out;
      lse.rank = 3;
      lse.shape = {p.batch, p.heads, p.sq, 0};
      lse.strides = {p.heads * p.sq, p.sq, 1, 0};
      break;
    case 28:
      if (opt.mask.present()) {
        opt.mask.rank = 3;
      } else {
        opt.mask = view(p.q.data(), DType::kBool, p.ql, 2);
      }
      break;
    case 29:
      opt.chunk_size = -fdp.ConsumeIntegralInRange<int64_t>(1, kMax);
      break;
    case 30: {
      // A non-finite sink, a wrong count, or a wrong dtype.
      const int which = fdp.ConsumeIntegralInRange<int>(0, 2);
      const int64_t n = which == 1 ? p.heads + 1 : p.heads;
      opt.sinks = attnkit::make_view(bad_sinks.data(), which == 2 ? DType::kI32 : DType::kF32, {n});
      if (which == 0)
        bad_sinks[fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(p.heads - 1))] =
            special_value(fdp.ConsumeIntegralInRange<int>(0, 2));
      break;
    }
    default:
      opt.window_size.left = -1 - fdp.ConsumeIntegralInRange<int64_t>(1, 5);
      break;
  }

  const std::vector<float> out_before = o.out, lse_before = o.lse, probs_before = o.probs;
  const std::vector<float> q_before = p.q;
  const Status st = attnkit::sdpa(q, k, v, out, opt, lse, probs);
  if (st.ok()) fail("sdpa accepted a call that breaks rule " + std::to_string(rule));
  if (st.message().empty())
    fail("sdpa: error without a message (rule " + std::to_string(rule) + ")");
  if (std::memcmp(o.out.data(), out_before.data(), o.out.size() * 4) != 0 ||
      std::memcmp(o.lse.data(), lse_before.data(), o.lse.size() * 4) != 0 ||
      std::memcmp(o.probs.data(), probs_before.data(), o.probs.size() * 4) != 0 ||
      std::memcmp(p.q.data(), q_before.data(), p.q.size() * 4) != 0)
    fail("sdpa wrote before failing (rule " + std::to_string(rule) + "): " + st.message());
}

// ---- KVCache -----------------------------------------------------------------

void fuzz_cache(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  attnkit::KVCacheSpec spec;
  spec.batch_size = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  spec.max_seq_len = pick_size(fdp, 24, 600) + 1;
  spec.num_kv_heads = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  spec.head_dim = fdp.ConsumeIntegralInRange<int64_t>(1, 24);
  spec.head_dim_v = fdp.ConsumeBool() ? 0 : fdp.ConsumeIntegralInRange<int64_t>(1, 24);
  static constexpr DType kCacheTypes[] = {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3};
  spec.dtype = kCacheTypes[fdp.ConsumeIntegralInRange<size_t>(0, 3)];
  spec.sliding_window = fdp.ConsumeBool() ? 0 : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  if (spec.sliding_window == 0 && fdp.ConsumeBool())
    spec.chunk_size = fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  // Sometimes K rows of whole 2 KiB, which the cache stores padded.
  if (spec.num_kv_heads != 3 && fdp.ConsumeIntegralInRange<int>(0, 7) == 0)
    spec.head_dim = (spec.dtype == DType::kBF16 ? 1024 : 512) / spec.num_kv_heads;
  const int64_t heads = spec.num_kv_heads * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t B = spec.batch_size, Hkv = spec.num_kv_heads, D = spec.head_dim;
  const int64_t Dv = spec.head_dim_v == 0 ? D : spec.head_dim_v;
  auto cache_r = attnkit::KVCache::create(spec);
  if (!cache_r.ok()) fail("KVCache::create rejected a valid spec: " + cache_r.status().to_string());
  attnkit::KVCache cache = std::move(cache_r).value();
  pick_simd_target(fdp);

  AttentionOptions opt;
  static constexpr float kScales[] = {0.0f, 0.5f, 2.0f};
  opt.softmax_scale = kScales[fdp.ConsumeIntegralInRange<size_t>(0, 2)];
  opt.softcap = fdp.ConsumeBool() ? 0.0f : 3.0f;
  if (spec.sliding_window == 0 && spec.chunk_size == 0 &&
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    opt.sparse.kind = SparsePattern::Kind::kStrided;
    opt.sparse.block_size = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
    opt.sparse.stride = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  }
  opt.backend = pick_backend(fdp);
  opt.num_threads = fdp.ConsumeIntegralInRange<int>(0, 3);
  std::vector<float> sinks;
  if (fdp.ConsumeBool()) {
    sinks = pick_sinks(fdp, heads);
    opt.sinks = attnkit::make_view(sinks.data(), DType::kF32, {heads});
  }

  // The whole history, as the cache stores it (rounded to bf16, or each
  // token's row of each head quantized and dequantized): [B, max_seq_len,
  // Hkv, D] and [.., Dv].
  const int64_t cap = spec.max_seq_len;
  std::vector<float> hist_k(static_cast<size_t>(B * cap * Hkv * D)),
      hist_v(static_cast<size_t>(B * cap * Hkv * Dv));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  auto stored = [&](float x) {
    return spec.dtype == DType::kBF16 ? attnkit::bf16_to_float(attnkit::float_to_bf16(x)) : x;
  };

  // Each round's check (the reference and compare()'s row bounds) visits
  // every (query, key, column) triple, about 10 M a second in the
  // instrumented build; an input that chose the padded 1024-wide rows and
  // 8 rounds took 14 s, past -timeout. Rounds stop once the next would
  // take the input past kMaxCacheWork (the first always runs: at most
  // 2e7).
  constexpr double kMaxCacheWork = 3e7;
  double work = 0.0;
  int64_t len = 0;
  int rounds = 0;
  while (len < cap && fdp.remaining_bytes() > 0 && rounds++ < 12) {
    const int64_t T = std::min<int64_t>(cap - len, fdp.ConsumeIntegralInRange<int64_t>(1, 40));
    const double round_work =
        static_cast<double>(B * T * heads) * static_cast<double>(len + T) * (D + Dv);
    if (rounds > 1 && work + round_work > kMaxCacheWork) break;
    work += round_work;
    // New tokens, contiguous [B, T, heads|Hkv, D|Dv].
    std::vector<float> q(static_cast<size_t>(B * T * heads * D)),
        kn(static_cast<size_t>(B * T * Hkv * D)), vn(static_cast<size_t>(B * T * Hkv * Dv));
    for (float& x : q) x = 2.0f * unit(rng);
    for (float& x : kn) x = 2.0f * unit(rng);
    for (float& x : vn) x = unit(rng);
    std::vector<float> out(static_cast<size_t>(B * T * heads * Dv), kSentinel);
    const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, T, heads, D});
    const TensorView kv = attnkit::make_view(kn.data(), DType::kF32, {B, T, Hkv, D});
    const TensorView vv = attnkit::make_view(vn.data(), DType::kF32, {B, T, Hkv, Dv});
    const TensorView ov = attnkit::make_view(out.data(), DType::kF32, {B, T, heads, Dv});

    // Sometimes a bad call first: it must change nothing.
    const int bad = fdp.ConsumeIntegralInRange<int>(0, 7);
    if (bad > 0) {
      // Every byte the strided keys view spans, row padding included.
      const std::vector<unsigned char> keys_before = attnkit_test::span_bytes(cache.keys());
      AttentionOptions bad_opt = opt;
      TensorView bq = qv, bo = ov;
      std::vector<int32_t> lens(static_cast<size_t>(B), 1);
      int64_t T_over = cap - len + 1;
      std::vector<float> big;
      switch (bad) {
        case 1:
          bad_opt.window_size.left = 3;
          break;
        case 2:
          bad_opt.seqlens_k = lens;
          break;
        case 3:
          bq.shape[3] = D + 1;
          break;
        case 4: {
          // More tokens than the cache has room for.
          big.assign(static_cast<size_t>(B * T_over * heads * std::max(D, Dv)), 0.0f);
          bq = attnkit::make_view(big.data(), DType::kF32, {B, T_over, heads, D});
          break;
        }
        case 5:
          bad_opt.mask = attnkit::make_view(q.data(), DType::kBool, {1, 1, 1, 1});
          break;
        case 6:
          bad_opt.chunk_size = spec.chunk_size + 1;  // not the cache's chunk
          break;
        default:
          // An out whose rows share memory (threads would race on them).
          if (T >= 2)
            bo.strides[1] = 0;
          else if (heads >= 2)
            bo.strides[2] = 0;
          else if (Dv >= 2)
            bo.strides[3] = 0;
          else
            bad_opt.softcap = -1.0f;  // one element cannot overlap itself
          break;
      }
      Status st;
      if (bad == 4) {
        std::vector<float> big_k(static_cast<size_t>(B * T_over * Hkv * D)),
            big_v(static_cast<size_t>(B * T_over * Hkv * Dv)),
            big_o(static_cast<size_t>(B * T_over * heads * Dv));
        st = cache.attend(bq, attnkit::make_view(big_k.data(), DType::kF32, {B, T_over, Hkv, D}),
                          attnkit::make_view(big_v.data(), DType::kF32, {B, T_over, Hkv, Dv}),
                          attnkit::make_view(big_o.data(), DType::kF32, {B, T_over, heads, Dv}),
                          bad_opt);
      } else {
        st = cache.attend(bq, kv, vv, bo, bad_opt);
      }
      if (st.ok()) fail("KVCache::attend accepted bad call " + std::to_string(bad));
      if (cache.length() != len) fail("KVCache::attend: a failed call changed length()");
      if (attnkit_test::span_bytes(cache.keys()) != keys_before)
        fail("KVCache::attend: a failed call changed the stored keys");
      for (float x : out)
        if (!bits_equal(x, kSentinel)) fail("KVCache::attend: a failed call wrote out");
    }

    const Status st = cache.attend(qv, kv, vv, ov, opt);
    if (!st.ok()) fail("KVCache::attend rejected a valid call: " + st.to_string());
    if (cache.length() != len + T) fail("KVCache::attend: length() did not grow by T");
    const bool eight_bit = spec.dtype == DType::kI8 || spec.dtype == DType::kFp8E4M3;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < Hkv; ++g) {
          const float* krow = kn.data() + ((b * T + t) * Hkv + g) * D;
          const float* vrow = vn.data() + ((b * T + t) * Hkv + g) * Dv;
          float* hk = hist_k.data() + ((b * cap + len + t) * Hkv + g) * D;
          float* hv = hist_v.data() + ((b * cap + len + t) * Hkv + g) * Dv;
          if (eight_bit) {
            const std::vector<double> dk = attnkit_test::kv_dequantized(krow, D, spec.dtype);
            const std::vector<double> dv = attnkit_test::kv_dequantized(vrow, Dv, spec.dtype);
            std::copy(dk.begin(), dk.end(), hk);
            std::copy(dv.begin(), dv.end(), hv);
            continue;
          }
          for (int64_t x = 0; x < D; ++x) hk[x] = stored(krow[x]);
          for (int64_t x = 0; x < Dv; ++x) hv[x] = stored(vrow[x]);
        }

    // Reference: sdpa over the history [0, len + T) with the new queries
    // bottom-right aligned, causal, and the cache's window.
    Problem p;
    p.batch = B;
    p.sq = T;
    p.sk = len + T;
    p.heads = heads;
    p.kv_heads = Hkv;
    p.d = D;
    p.dv = Dv;
    p.opt = opt;
    p.opt.causal = true;
    if (spec.sliding_window > 0) p.opt.window_size.left = spec.sliding_window - 1;
    p.opt.chunk_size = spec.chunk_size;
    p.sinks = sinks;
    p.ql.shape = {B, T, heads, D};
    p.ql.strides = {T * heads * D, heads * D, D, 1};
    p.kl.shape = {B, len + T, Hkv, D};
    p.kl.strides = {cap * Hkv * D, Hkv * D, D, 1};
    p.vl.shape = {B, len + T, Hkv, Dv};
    p.vl.strides = {cap * Hkv * Dv, Hkv * Dv, Dv, 1};
    p.ol.shape = {B, T, heads, Dv};
    p.ol.strides = {T * heads * Dv, heads * Dv, Dv, 1};
    p.ql.elems = q.size();
    p.kl.elems = hist_k.size();
    p.vl.elems = hist_v.size();
    p.ol.elems = out.size();
    p.q = q;
    p.kv = spec.dtype;  // for the bound: the storage type's paths (compare())
    p.k.dtype = p.v.dtype = DType::kF32;
    p.k.f = hist_k;
    p.v.f = hist_v;
    Outputs ref = allocate_outputs(p);
    AttentionOptions ro = p.opt;
    ro.backend = Backend::kReference;
    const Status sr = attnkit::sdpa(p.qv(), view(p.k.f.data(), DType::kF32, p.kl),
                                    view(p.v.f.data(), DType::kF32, p.vl),
                                    view(ref.out.data(), DType::kF32, p.ol), ro);
    if (!sr.ok()) fail("reference sdpa over the cache history failed: " + sr.to_string());
    Outputs got;
    got.out = out;
    got.lse = ref.lse;
    got.lse_l = ref.lse_l;
    compare(p, got, ref, "KVCache::attend");
    len += T;
  }
}

// ---- merge_attention_states ----------------------------------------------

void fuzz_merge(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 2),
                Sq = fdp.ConsumeIntegralInRange<int64_t>(1, 6),
                Sk = fdp.ConsumeIntegralInRange<int64_t>(0, 80),
                H = fdp.ConsumeIntegralInRange<int64_t>(1, 4),
                D = fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  const int64_t split = fdp.ConsumeIntegralInRange<int64_t>(0, Sk);
  AttentionOptions opt;
  opt.backend = pick_backend(fdp);
  pick_simd_target(fdp);
  std::uniform_real_distribution<float> unit(-3.0f, 3.0f);
  // At least one element each: an empty view still needs a non-null pointer.
  std::vector<float> q(static_cast<size_t>(B * Sq * H * D)),
      k(static_cast<size_t>(std::max<int64_t>(1, B * Sk * H * D))), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = unit(rng);
  // Full attention (reference), and the two halves with the fast kernel,
  // all non-causal: causal alignment is relative to each call's own keys,
  // so halves of a causal call are not causal calls.
  std::vector<float> full(static_cast<size_t>(B * Sq * H * D), kSentinel),
      full_lse(static_cast<size_t>(B * H * Sq)), a(full.size()), a_lse(full_lse.size()),
      b(full.size()), b_lse(full_lse.size());
  auto qv = attnkit::make_view(q.data(), DType::kF32, {B, Sq, H, D});
  auto kv_part = [&](std::vector<float>& x, int64_t lo, int64_t n) {
    TensorView t = attnkit::make_view(x.data(), DType::kF32, {B, Sk, H, D});
    t.data = x.data() + lo * H * D;
    t.shape[1] = n;
    return t;
  };
  auto o = [&](std::vector<float>& x) {
    return attnkit::make_view(x.data(), DType::kF32, {B, Sq, H, D});
  };
  auto l = [&](std::vector<float>& x) {
    return attnkit::make_view(x.data(), DType::kF32, {B, H, Sq});
  };
  AttentionOptions ro = opt;
  ro.backend = Backend::kReference;
  Status st = attnkit::sdpa(qv, kv_part(k, 0, Sk), kv_part(v, 0, Sk), o(full), ro, l(full_lse));
  if (st.ok())
    st = attnkit::sdpa(qv, kv_part(k, 0, split), kv_part(v, 0, split), o(a), opt, l(a_lse));
  if (st.ok())
    st = attnkit::sdpa(qv, kv_part(k, split, Sk - split), kv_part(v, split, Sk - split), o(b), opt,
                       l(b_lse));
  if (st.ok()) st = attnkit::merge_attention_states(o(a), l(a_lse), o(b), l(b_lse), o(a), l(a_lse));
  if (!st.ok()) fail("merge path rejected a valid call: " + st.to_string());
  // Scores are at most S = 9 D / sqrt(D) and |v| < 3. Each half carries
  // the fast kernel's bound (header) and an lse error l; the merge weights
  // then carry a relative error expm1(2 l) each, plus a few roundings.
  const double s_max = 9.0 * D / std::sqrt(static_cast<double>(D));
  const double e = (D + 4) * kU * s_max;
  const double lse_err =
      e + (3.0 * Sk + 48) * kU + 4 * kU * (s_max + std::log(static_cast<double>(Sk) + 1.0));
  const double bound =
      3.0 * (std::expm1(2 * e) + (3.0 * Sk + 48) * kU + 2 * std::expm1(2 * lse_err) + 8 * kU);
  for (size_t x = 0; x < full.size(); ++x)
    if (!(std::fabs(static_cast<double>(a[x]) - full[x]) <= bound)) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "merge: element %zu merged %.9g full %.9g bound %.3g", x,
                    static_cast<double>(a[x]), static_cast<double>(full[x]), bound);
      fail(buf);
    }
  for (size_t x = 0; x < full_lse.size(); ++x) {
    if (std::isinf(full_lse[x])) {
      if (a_lse[x] != full_lse[x]) fail("merge: an empty row's lse is not -inf");
      continue;
    }
    if (!(std::fabs(static_cast<double>(a_lse[x]) - full_lse[x]) <=
          2 * lse_err + 8 * kU * std::fabs(full_lse[x])))
      fail("merge: lse differs beyond the bound");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  g_case.clear();
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 7);
  std::mt19937_64 rng(fdp.ConsumeIntegral<uint64_t>());
  if (mode <= 3)
    fuzz_sdpa(fdp, rng);
  else if (mode <= 5)
    fuzz_bad(fdp, rng);
  else if (mode == 6)
    fuzz_cache(fdp, rng);
  else
    fuzz_merge(fdp, rng);
  return 0;
}
