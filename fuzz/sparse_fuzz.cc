// libFuzzer target: DeepSeek sparse attention's kernels, fast against the
// reference backend, on fuzzer-chosen shapes, codes, thread counts and
// SIMD targets (include/attnkit/sparse_attention.h, kernels/sparse.h).
//
//   indexer  lightning_indexer_topk over 1-2 batch items, 1-4 query rows,
//            1-200 keys, 1-72 heads, 128 or (up to 24 heads) 256 features
//            (128 takes AMX on the avx512bf16 target where the CPU has it,
//            else fp32 tiles),
//            top 1-64; codes from the input (fp8's NaN codes included),
//            positive scales, finite weights. Every visible key's fast
//            score must agree with the reference's within 1e-5 of the sum
//            of its terms' magnitudes (fp32 against double), a NaN score
//            must be -inf in both, and the fast selection must be a top-k
//            of the reference's scores up to that tolerance: each chosen key
//            scores at least as high as each key left out, less the two
//            keys' bounds; the same count of keys, in increasing order, -1
//            after.
//   sparse   sdpa with key_indices over the indexer's selection: 1-130
//            heads over 1-4 kv heads, head dims 1-80, values the keys'
//            leading features (MLA's latent rows) or their own, f32 or bf16
//            rows, softcap or not; fast outputs and log-sum-exp within 1e-4
//            of the reference (inputs in [-1, 1], scale 1/sqrt(head_dim)).
//
// Every buffer is allocated at exactly the extent its view addresses, so
// ASan reports any read or write past it.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/sparse_attention.h"
#include "core/cpu_features.h"

namespace {

using attnkit::Backend;
using attnkit::DType;
using attnkit::make_view;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "sparse_fuzz: %s\n", what.c_str());
  std::abort();
}

struct Indexer {
  int64_t B, T, S, H, D, topk;
  std::vector<uint8_t> qc, kc;
  std::vector<float> qs, ks, w;
};

Indexer make_indexer(FuzzedDataProvider& fdp) {
  Indexer x;
  x.B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  x.T = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  x.S = fdp.ConsumeIntegralInRange<int64_t>(x.T, 200);
  x.H = fdp.ConsumeIntegralInRange<int64_t>(1, 72);
  // Two scale blocks only with few heads: the float64 loops stay fast.
  x.D = x.H <= 24 && fdp.ConsumeBool() ? 256 : 128;
  x.topk = fdp.ConsumeIntegralInRange<int64_t>(1, 64);
  // A few input bytes seed a generator for the bulk; the rest of the input
  // overrides codes from the start, so the fuzzer steers the first keys.
  uint64_t state = fdp.ConsumeIntegral<uint64_t>() | 1;
  const auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  x.qc.resize(static_cast<size_t>(x.B * x.T * x.H * x.D));
  x.kc.resize(static_cast<size_t>(x.B * x.S * x.D));
  for (auto& c : x.qc) c = static_cast<uint8_t>(next());
  for (auto& c : x.kc) c = static_cast<uint8_t>(next());
  const std::vector<uint8_t> steer = fdp.ConsumeBytes<uint8_t>(x.kc.size() / 4);
  std::copy(steer.begin(), steer.end(), x.kc.begin());
  const auto scale = [&] { return std::ldexp(1.0f, -static_cast<int>(next() % 12)) * 1.5f; };
  x.qs.resize(static_cast<size_t>(x.B * x.T * x.H * x.D / 128));
  x.ks.resize(static_cast<size_t>(x.B * x.S * x.D / 128));
  for (float& s : x.qs) s = scale();
  for (float& s : x.ks) s = scale();
  x.w.resize(static_cast<size_t>(x.B * x.T * x.H));
  for (float& e : x.w) e = static_cast<float>(static_cast<int64_t>(next() % 2001) - 1000) / 1000;
  return x;
}

attnkit::Status run_indexer(const Indexer& x, std::vector<int32_t>* idx, std::vector<float>* sc,
                            Backend backend, int threads) {
  attnkit::IndexerOptions o;
  o.backend = backend;
  o.num_threads = threads;
  return attnkit::lightning_indexer_topk(
      make_view(x.qc.data(), DType::kFp8E4M3, {x.B, x.T, x.H, x.D}),
      make_view(x.qs.data(), DType::kF32, {x.B, x.T, x.H, x.D / 128}),
      make_view(x.w.data(), DType::kF32, {x.B, x.T, x.H}),
      make_view(x.kc.data(), DType::kFp8E4M3, {x.B, x.S, x.D}),
      make_view(x.ks.data(), DType::kF32, {x.B, x.S, x.D / 128}), x.topk,
      make_view(idx->data(), DType::kI32, {x.B, x.T, x.topk}),
      make_view(sc->data(), DType::kF32, {x.B, x.T, x.S}), o);
}

// The tolerance of each score, [B][T][S] (0 past a row's visible keys).
// 1e-5 of the sum over heads and features of |w_h q_c k_c| (fp32's error
// scales with it).
std::vector<double> score_bounds(const Indexer& x) {
  const auto decoded = [](const std::vector<uint8_t>& codes, const std::vector<float>& scales) {
    std::vector<double> v(codes.size());
    for (size_t e = 0; e < codes.size(); ++e)
      v[e] = std::fabs(double(attnkit::fp8_e4m3_to_float(codes[e])) * scales[e / 128]);
    return v;
  };
  const std::vector<double> q = decoded(x.qc, x.qs), k = decoded(x.kc, x.ks);
  std::vector<double> bound(static_cast<size_t>(x.B * x.T * x.S), 0.0);
  for (int64_t b = 0; b < x.B; ++b)
    for (int64_t t = 0; t < x.T; ++t)
      for (int64_t s = 0; s < x.S - x.T + t + 1; ++s) {
        double m = 0.0;
        for (int64_t h = 0; h < x.H; ++h) {
          const double* qr = q.data() + ((b * x.T + t) * x.H + h) * x.D;
          const double* kr = k.data() + (b * x.S + s) * x.D;
          double dot = 0.0;
          for (int64_t c = 0; c < x.D; ++c) dot += qr[c] * kr[c];
          m += std::fabs(x.w[size_t((b * x.T + t) * x.H + h)]) * dot;
        }
        bound[size_t((b * x.T + t) * x.S + s)] = 1e-5 * m + 1e-30;
      }
  return bound;
}

void check_indexer(const Indexer& x, const std::vector<int32_t>& idx, const std::vector<float>& sc,
                   const std::vector<float>& ref, const std::vector<double>& bounds,
                   const std::string& where) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < x.B; ++b)
    for (int64_t t = 0; t < x.T; ++t) {
      const int64_t visible = x.S - x.T + t + 1, row = (b * x.T + t) * x.S;
      const double* bound = bounds.data() + row;
      for (int64_t s = 0; s < visible; ++s) {
        const float got = sc[size_t(row + s)], want = ref[size_t(row + s)];
        const bool both_ninf = got == ninf && want == ninf;
        if (!both_ninf && !(std::fabs(double(got) - want) <= bound[size_t(s)]))
          fail(where + ": score of key " + std::to_string(s) + " of row " + std::to_string(t) +
               " is " + std::to_string(got) + ", the reference's " + std::to_string(want));
      }
      const int32_t* chosen = idx.data() + (b * x.T + t) * x.topk;
      const int64_t k = std::min(x.topk, visible);
      std::vector<char> in(static_cast<size_t>(visible), 0);
      for (int64_t n = 0; n < x.topk; ++n) {
        const int32_t j = chosen[n];
        if (n >= k) {
          if (j != -1) fail(where + ": a slot past min(topk, visible) is not -1");
          continue;
        }
        if (j < 0 || j >= visible || (n > 0 && j <= chosen[n - 1]))
          fail(where + ": chosen keys out of range or not increasing");
        in[size_t(j)] = 1;
      }
      double lowest_in = std::numeric_limits<double>::infinity(), bound_in = 0.0;
      double highest_out = -std::numeric_limits<double>::infinity(), bound_out = 0.0;
      for (int64_t s = 0; s < visible; ++s) {
        const double r = ref[size_t(row + s)];
        if (in[size_t(s)] && r < lowest_in) {
          lowest_in = r;
          bound_in = bound[size_t(s)];
        } else if (!in[size_t(s)] && r > highest_out) {
          highest_out = r;
          bound_out = bound[size_t(s)];
        }
      }
      if (lowest_in < highest_out - bound_in - bound_out)
        fail(where + ": a key left out scores " + std::to_string(highest_out) +
             " above a chosen one's " + std::to_string(lowest_in));
    }
}

void check_sparse(FuzzedDataProvider& fdp, const Indexer& x, const std::vector<int32_t>& idx,
                  int threads) {
  const int64_t KH = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t H = KH * fdp.ConsumeIntegralInRange<int64_t>(1, 130 / KH);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 80);
  const bool in_keys = fdp.ConsumeBool(), bf16 = fdp.ConsumeBool();
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, in_keys ? D : 80);
  const float softcap = fdp.ConsumeBool() ? 0.0f : 3.0f;
  const int64_t B = x.B, T = x.T, S = x.S;
  uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(H * 131 + D);
  const auto value = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(static_cast<int64_t>(state % 2001) - 1000) / 1000;
  };
  std::vector<float> q(static_cast<size_t>(B * T * H * D));
  for (float& e : q) e = value();
  const int64_t vd = in_keys ? D : Dv;
  std::vector<float> kf(static_cast<size_t>(B * S * KH * D)),
      vf(static_cast<size_t>(B * S * KH * vd));
  for (float& e : kf) e = value();
  for (float& e : vf) e = value();
  std::vector<attnkit::bf16> kb(kf.size()), vb(vf.size());
  for (size_t e = 0; e < kf.size(); ++e) kb[e] = attnkit::float_to_bf16(kf[e]);
  for (size_t e = 0; e < vf.size(); ++e) vb[e] = attnkit::float_to_bf16(vf[e]);
  const DType dt = bf16 ? DType::kBF16 : DType::kF32;
  const void* kp = bf16 ? static_cast<const void*>(kb.data()) : kf.data();
  const void* vp = in_keys ? kp : bf16 ? static_cast<const void*>(vb.data()) : vf.data();
  attnkit::TensorView k = make_view(kp, dt, {B, S, KH, D});
  attnkit::TensorView v = make_view(vp, dt, {B, S, KH, Dv});
  if (in_keys) v.strides = k.strides;
  attnkit::AttentionOptions o;
  o.causal = true;
  o.softmax_scale = 1.0f / std::sqrt(static_cast<float>(D));
  o.softcap = softcap;
  o.num_threads = threads;
  o.key_indices = make_view(idx.data(), DType::kI32, {B, T, x.topk});
  const attnkit::TensorView qv = make_view(q.data(), DType::kF32, {B, T, H, D});
  std::vector<float> out[2], lse[2];
  for (int f = 0; f < 2; ++f) {
    o.backend = f == 0 ? Backend::kReference : Backend::kFast;
    out[f].assign(static_cast<size_t>(B * T * H * Dv), NAN);
    lse[f].assign(static_cast<size_t>(B * H * T), NAN);
    const attnkit::Status st =
        attnkit::sdpa(qv, k, v, make_view(out[f].data(), DType::kF32, {B, T, H, Dv}), o,
                      make_view(lse[f].data(), DType::kF32, {B, H, T}));
    if (!st.ok()) fail("sdpa with key_indices refused a valid call: " + st.message());
  }
  for (size_t e = 0; e < out[0].size(); ++e)
    if (!(std::fabs(out[1][e] - out[0][e]) <= 1e-4f))
      fail("sparse attention, " + std::string(attnkit::simd_target_name(attnkit::simd_target())) +
           ": output " + std::to_string(e) + " is " + std::to_string(out[1][e]) +
           ", the reference's " + std::to_string(out[0][e]));
  for (size_t e = 0; e < lse[0].size(); ++e) {
    const bool both_ninf = std::isinf(lse[0][e]) && lse[0][e] < 0 && lse[1][e] == lse[0][e];
    if (!both_ninf && !(std::fabs(lse[1][e] - lse[0][e]) <= 1e-4f * (1.0f + std::fabs(lse[0][e]))))
      fail("sparse attention: log-sum-exp " + std::to_string(e) + " is " +
           std::to_string(lse[1][e]) + ", the reference's " + std::to_string(lse[0][e]));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  const int threads = fdp.ConsumeIntegralInRange<int>(1, 3);
  const Indexer x = make_indexer(fdp);
  std::vector<int32_t> ref_idx(static_cast<size_t>(x.B * x.T * x.topk));
  std::vector<float> ref(static_cast<size_t>(x.B * x.T * x.S));
  const attnkit::Status st = run_indexer(x, &ref_idx, &ref, Backend::kReference, threads);
  if (!st.ok()) fail("the reference indexer refused a valid call: " + st.message());
  const std::vector<double> bounds = score_bounds(x);
  const attnkit::SimdTarget saved = attnkit::simd_target();
  std::vector<int32_t> idx(ref_idx.size());
  std::vector<float> sc(ref.size());
  for (attnkit::SimdTarget target : attnkit::kAllSimdTargets) {
    if (!attnkit::set_simd_target(target)) continue;
    const attnkit::Status fast = run_indexer(x, &idx, &sc, Backend::kFast, threads);
    if (!fast.ok()) fail("the fast indexer refused a valid call: " + fast.message());
    check_indexer(x, idx, sc, ref, bounds,
                  std::string("indexer, ") + attnkit::simd_target_name(target));
  }
  attnkit::set_simd_target(saved);
  // Attention over the selection, on one fuzzer-chosen target.
  const attnkit::SimdTarget target =
      attnkit::kAllSimdTargets[fdp.ConsumeIntegralInRange<size_t>(0, 3)];
  if (attnkit::set_simd_target(target)) check_sparse(fdp, x, idx, threads);
  attnkit::set_simd_target(saved);
  return 0;
}
