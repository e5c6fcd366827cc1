// KVCache against the float64 oracle: decoding N tokens through the cache in
// any schedule of chunks must equal one causal attention over all N tokens
// (within the window, if any).
//
// Tolerances: common/attention_bounds.h derives them.
#include "attnkit/kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "common/attention_bounds.h"
#include "common/attention_f64.h"
#include "common/kv_quant_f64.h"
#include "common/random.h"
#include "common/views.h"
#include "ops/kv_quant.h"

namespace {

using attnkit::DType;
using attnkit::KVCache;
using attnkit::KVCacheSpec;
using attnkit::StatusCode;
using attnkit::TensorView;
using attnkit_test::Rng;
using attnkit_test::span_bytes;
using attnkit_test::view_at;

// Rows [t0, t0 + T) of a contiguous [batch, n, heads, dim] f32 array, as a
// strided view (not contiguous across the batch when batch > 1).
TensorView rows(std::vector<float>& a, int64_t batch, int64_t n, int64_t heads, int64_t dim,
                int64_t t0, int64_t T) {
  TensorView v = attnkit::make_view(a.data(), DType::kF32, {batch, T, heads, dim});
  v.strides = {n * heads * dim, heads * dim, dim, 1};
  v.data = a.data() + t0 * heads * dim;
  return v;
}

struct Problem {
  int64_t batch = 2, num_heads = 4, num_kv_heads = 2, head_dim = 8, head_dim_v = 8;
  int64_t n = 0;               // total tokens
  std::vector<float> q, k, v;  // [batch, n, heads, dim]

  void fill(Rng& rng) {
    q = attnkit_test::uniform_vector(size_t(batch * n * num_heads * head_dim), rng);
    k = attnkit_test::uniform_vector(size_t(batch * n * num_kv_heads * head_dim), rng);
    v = attnkit_test::uniform_vector(size_t(batch * n * num_kv_heads * head_dim_v), rng);
  }
};

// K or V [batch, n, heads, dim] as a cache of `stored` holds it: rounded to
// bf16, or each token's row of each head quantized and dequantized.
std::vector<double> as_stored(const std::vector<float>& x, int64_t dim, DType stored) {
  std::vector<double> d(x.begin(), x.end());
  if (stored == DType::kBF16)
    for (size_t i = 0; i < x.size(); ++i) d[i] = attnkit_test::round_bf16(x[i]);
  if (stored == DType::kI8 || stored == DType::kFp8E4M3)
    for (size_t i = 0; i < x.size(); i += size_t(dim)) {
      const std::vector<double> row = attnkit_test::kv_dequantized(x.data() + i, dim, stored);
      std::copy(row.begin(), row.end(), d.begin() + int64_t(i));
    }
  return d;
}

// Full causal attention over the problem's n tokens with window W (0 = none),
// in float64, over K/V as a cache of `stored` holds them.
std::vector<double> oracle(const Problem& p, int64_t W, DType stored, double scale = 0.0,
                           double softcap = 0.0, attnkit::SparsePattern sparse = {},
                           int64_t chunk = 0, const std::vector<float>& sinks = {}) {
  attnkit_test::OracleOptions o;
  o.batch = p.batch;
  o.seqlen_q = o.seqlen_k = p.n;
  o.num_heads = p.num_heads;
  o.num_kv_heads = p.num_kv_heads;
  o.head_dim = p.head_dim;
  o.head_dim_v = p.head_dim_v;
  o.causal = true;
  o.window_left = W > 0 ? W - 1 : -1;
  o.softmax_scale = scale;
  o.softcap = softcap;
  o.sparse = sparse;
  o.chunk_size = chunk;
  o.sinks.assign(sinks.begin(), sinks.end());
  return attnkit_test::attention_f64(o, attnkit_test::widen(p.q),
                                     as_stored(p.k, p.head_dim, stored),
                                     as_stored(p.v, p.head_dim_v, stored))
      .out;
}

attnkit_test::Tolerance tolerance(const Problem& p, DType dtype, attnkit::Backend backend,
                                  double scale = 0.0) {
  return attnkit_test::attention_tolerance(p.head_dim, p.n, dtype, backend, scale);
}

// Runs the schedule through a fresh cache; returns out [batch, n, heads, dim_v].
std::vector<float> decode(Problem& p, const KVCacheSpec& spec, const std::vector<int64_t>& chunks,
                          const attnkit::AttentionOptions& opt = {}) {
  auto cache = KVCache::create(spec);
  EXPECT_TRUE(cache.ok()) << cache.status().to_string();
  if (!cache.ok()) return {};
  std::vector<float> out(size_t(p.batch * p.n * p.num_heads * p.head_dim_v), -7.0f);
  int64_t t0 = 0;
  for (int64_t T : chunks) {
    auto st = cache->attend(rows(p.q, p.batch, p.n, p.num_heads, p.head_dim, t0, T),
                            rows(p.k, p.batch, p.n, p.num_kv_heads, p.head_dim, t0, T),
                            rows(p.v, p.batch, p.n, p.num_kv_heads, p.head_dim_v, t0, T),
                            rows(out, p.batch, p.n, p.num_heads, p.head_dim_v, t0, T), opt);
    EXPECT_TRUE(st.ok()) << "chunk at " << t0 << ": " << st.to_string();
    t0 += T;
    EXPECT_EQ(cache->length(), t0);
    EXPECT_EQ(cache->stored(), std::min(t0, cache->slots()));
  }
  return out;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}

struct Heads {
  const char* name;
  int64_t num_heads, num_kv_heads, head_dim, head_dim_v;
};

void decode_matches_full_attention(DType dtype) {
  const Heads heads[] = {{"MHA", 4, 4, 8, 8}, {"GQA", 4, 2, 8, 6}, {"MQA", 4, 1, 8, 8}};
  // Windows: none, 1 (no slots), smaller than every chunk below, smaller
  // than the prompt, larger than everything.
  const int64_t windows[] = {0, 1, 3, 5, 100};
  std::vector<int64_t> singles(6, 1);
  auto cat = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::vector<int64_t>> schedules = {
      cat({11}, singles),    // prefill in one chunk, then decode
      cat({4, 7}, singles),  // prefill in two chunks, then decode
      {3, 5, 2, 4, 3},       // multi-token chunks
      {7, 7, 1, 2},          // chunks larger than the window
  };
  uint64_t seed = 1;
  double worst[2] = {0.0, 0.0};  // largest error / bound: reference, auto
  for (attnkit::Backend backend : {attnkit::Backend::kReference, attnkit::Backend::kAuto})
    for (const Heads& h : heads)
      for (int64_t W : windows)
        for (const auto& chunks : schedules) {
          Problem p;
          p.num_heads = h.num_heads;
          p.num_kv_heads = h.num_kv_heads;
          p.head_dim = h.head_dim;
          p.head_dim_v = h.head_dim_v;
          p.n = std::accumulate(chunks.begin(), chunks.end(), int64_t{0});
          Rng rng(seed++);
          p.fill(rng);
          KVCacheSpec spec{
              p.batch, p.n + (W == 100 ? 0 : 2), p.num_kv_heads, p.head_dim, p.head_dim_v, dtype,
              W};
          SCOPED_TRACE(std::string(h.name) + " window " + std::to_string(W) + " chunks " +
                       join(chunks) +
                       (backend == attnkit::Backend::kReference ? " reference" : " auto"));
          attnkit::AttentionOptions opt;
          opt.backend = backend;
          const std::vector<float> out = decode(p, spec, chunks, opt);
          const attnkit_test::Tolerance tol = tolerance(p, dtype, backend);
          const bool bf16 = dtype == DType::kBF16;
          double ratio = 0.0;
          EXPECT_TRUE(attnkit_test::all_close("out", out, oracle(p, W, dtype), tol, &ratio));
          worst[backend == attnkit::Backend::kAuto] =
              std::max(worst[backend == attnkit::Backend::kAuto], ratio);
          if (bf16) {
            // Against the unrounded oracle: |dk|, |dv| <= 2^-9 relative (RNE
            // to 8 significant bits), so |ds| <= 2^-9 Smax and, to first
            // order, |dout| <= (2 |ds| + 2^-9) Vmax; 1.5x for second order.
            const double smax = double(p.head_dim) / std::sqrt(double(p.head_dim));
            const double b = 1.5 * (2.0 * 0x1p-9 * smax + 0x1p-9) + tol.atol;
            EXPECT_TRUE(attnkit_test::all_close("out vs f32 oracle", out, oracle(p, W, DType::kF32),
                                                {b, 0.0}));
          }
        }
  ::testing::Test::RecordProperty("reference_worst_error_over_bound", std::to_string(worst[0]));
  ::testing::Test::RecordProperty("auto_worst_error_over_bound", std::to_string(worst[1]));
}

TEST(KVCacheDecode, F32MatchesFullCausalAttention) { decode_matches_full_attention(DType::kF32); }

TEST(KVCacheDecode, BF16MatchesOracleOnRoundedKV) { decode_matches_full_attention(DType::kBF16); }

TEST(KVCacheDecode, Int8MatchesOracleOnDequantizedKV) { decode_matches_full_attention(DType::kI8); }

TEST(KVCacheDecode, Fp8MatchesOracleOnDequantizedKV) {
  decode_matches_full_attention(DType::kFp8E4M3);
}

// An 8-bit cache's rows hold what kv_quant_f64.h's rule gives: the codes of
// each token's row of each head, then its scale, in the layout
// kv_cache_view / kv_cache_scales_view describe; a row holding NaN gets a
// NaN scale, and rows of zeros scale 0.
TEST(KVCacheStorage, EightBitRowsHoldCodesThenScales) {
  for (DType dtype : {DType::kI8, DType::kFp8E4M3}) {
    SCOPED_TRACE(attnkit::dtype_name(dtype));
    const int64_t heads = 3, dim = 40, n = 4;
    auto cache = KVCache::create({1, n, heads, dim, 0, dtype, 0});
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    // 120 codes, 4 bytes of alignment, 3 scales: 136 bytes, 160 with the pad to 32.
    EXPECT_EQ(attnkit::kv_token_stride(heads, dim, dtype), 160);
    EXPECT_EQ(cache->keys().strides[1], 160);
    EXPECT_EQ(cache->key_scales().strides[1], 40);
    EXPECT_EQ(static_cast<const char*>(cache->key_scales().data) -
                  static_cast<const char*>(cache->keys().data),
              120);
    EXPECT_EQ(cache->nbytes(), size_t(2 * n * heads * (dim + 4)));
    Rng rng(3);
    std::vector<float> k = attnkit_test::uniform_vector(size_t(n * heads * dim), rng);
    std::vector<float> v = attnkit_test::uniform_vector(k.size(), rng);
    k[size_t(dim + 7)] = NAN;                                         // token 0, head 1
    for (int64_t x = 0; x < dim; ++x) v[size_t(2 * dim + x)] = 0.0f;  // token 0, head 2
    k[size_t(heads * dim + 5)] *= 1000.0f;  // an outlier sets token 1's head 0 scale
    std::vector<float> q(size_t(n * heads * dim), 0.1f), out(q.size());
    ASSERT_TRUE(cache
                    ->attend(attnkit::make_view(q.data(), DType::kF32, {1, n, heads, dim}),
                             attnkit::make_view(k.data(), DType::kF32, {1, n, heads, dim}),
                             attnkit::make_view(v.data(), DType::kF32, {1, n, heads, dim}),
                             attnkit::make_view(out.data(), DType::kF32, {1, n, heads, dim}))
                    .ok());
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<float>& src = kind == 0 ? k : v;
      const TensorView& codes = kind == 0 ? cache->keys() : cache->values();
      const TensorView& scales = kind == 0 ? cache->key_scales() : cache->value_scales();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const float* row = src.data() + (t * heads + h) * dim;
          const std::vector<double> want = attnkit_test::kv_dequantized(row, dim, dtype);
          const float scale = scales.ptr<const float>()[t * scales.strides[1] + h];
          for (int64_t x = 0; x < dim; ++x) {
            const uint8_t code = codes.ptr<const uint8_t>()[t * codes.strides[1] + h * dim + x];
            const double got = double(attnkit::kv_code_value(dtype, code)) * scale;
            if (std::isnan(want[size_t(x)]))
              EXPECT_TRUE(std::isnan(got)) << kind << " " << t << " " << h << " " << x;
            else
              EXPECT_EQ(got, want[size_t(x)]) << kind << " " << t << " " << h << " " << x;
          }
        }
    }
    EXPECT_TRUE(std::isnan(cache->key_scales().ptr<const float>()[1]));
    EXPECT_EQ(cache->value_scales().ptr<const float>()[2], 0.0f);
    // The query rows that see token 0's NaN key (kv head 1 = query head 1) are NaN.
    for (int64_t x = 0; x < dim; ++x) EXPECT_TRUE(std::isnan(out[size_t(dim + x)]));
    EXPECT_TRUE(std::isfinite(out[0]));
  }
}

TEST(KVCacheDecode, OptionsScaleSoftcapAndBackendApply) {
  for (int64_t W : {int64_t{0}, int64_t{4}}) {
    SCOPED_TRACE("window " + std::to_string(W));
    Problem p;
    p.n = 13;
    Rng rng(77);
    p.fill(rng);
    attnkit::AttentionOptions opt;
    opt.softmax_scale = 0.9f;  // exactly the f32 value the oracle gets below
    opt.softcap = 1.5f;
    opt.backend = attnkit::Backend::kReference;
    opt.num_threads = 2;
    KVCacheSpec spec{p.batch, p.n, p.num_kv_heads, p.head_dim, 0, DType::kF32, W};
    const auto out = decode(p, spec, {5, 1, 4, 1, 2}, opt);
    EXPECT_TRUE(attnkit_test::all_close(
        "out", out, oracle(p, W, DType::kF32, double(opt.softmax_scale), 1.5),
        tolerance(p, DType::kF32, opt.backend, double(opt.softmax_scale))));
  }
}

TEST(KVCacheDecode, SparsePatternUsesAbsolutePositions) {
  // Without a window the logical key index is the absolute position, so a
  // pattern whose blocks straddle chunk boundaries still matches the
  // oracle over the whole sequence.
  for (auto kind : {attnkit::SparsePattern::Kind::kStrided, attnkit::SparsePattern::Kind::kFixed})
    for (attnkit::Backend backend : {attnkit::Backend::kReference, attnkit::Backend::kAuto}) {
      SCOPED_TRACE(std::string(kind == attnkit::SparsePattern::Kind::kFixed ? "fixed" : "strided") +
                   (backend == attnkit::Backend::kReference ? " reference" : " auto"));
      Problem p;
      p.n = 15;
      Rng rng(31);
      p.fill(rng);
      attnkit::AttentionOptions opt;
      opt.sparse.kind = kind;
      opt.sparse.block_size = 2;
      opt.sparse.stride = 2;
      opt.sparse.summary = 1;
      opt.backend = backend;
      KVCacheSpec spec{p.batch, p.n, p.num_kv_heads, p.head_dim, 0, DType::kF32, 0};
      const auto out = decode(p, spec, {5, 1, 3, 1, 2, 1, 2}, opt);
      EXPECT_TRUE(attnkit_test::all_close("out", out,
                                          oracle(p, 0, DType::kF32, 0.0, 0.0, opt.sparse),
                                          tolerance(p, DType::kF32, backend)));
    }
}

TEST(KVCacheRing, SlotIsPositionModSlots) {
  // W = 4 keeps slots = 3; after a 5-token chunk the ring holds tokens 2, 3,
  // 4 in slots 2, 0, 1, and after 3 more tokens 5, 6, 7 in slots 2, 0, 1.
  Problem p;
  p.n = 8;
  p.head_dim_v = 5;
  Rng rng(5);
  p.fill(rng);
  auto cache =
      KVCache::create({p.batch, 100, p.num_kv_heads, p.head_dim, p.head_dim_v, DType::kF32, 4});
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  EXPECT_EQ(cache->slots(), 3);
  EXPECT_EQ(cache->spec().head_dim_v, 5);
  EXPECT_EQ(cache->keys().shape[1], 3);
  std::vector<float> out(size_t(p.batch * p.n * p.num_heads * p.head_dim_v));
  int64_t t0 = 0;
  for (int64_t T : {5, 1, 2}) {
    ASSERT_TRUE(cache
                    ->attend(rows(p.q, p.batch, p.n, p.num_heads, p.head_dim, t0, T),
                             rows(p.k, p.batch, p.n, p.num_kv_heads, p.head_dim, t0, T),
                             rows(p.v, p.batch, p.n, p.num_kv_heads, p.head_dim_v, t0, T),
                             rows(out, p.batch, p.n, p.num_heads, p.head_dim_v, t0, T))
                    .ok());
    t0 += T;
    for (int64_t pos = t0 - 3; pos < t0; ++pos)
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t h = 0; h < p.num_kv_heads; ++h) {
          const int64_t slot = pos % 3;
          for (int64_t d = 0; d < p.head_dim; ++d)
            ASSERT_EQ(view_at(cache->keys(), b, slot, h, d),
                      p.k[size_t(((b * p.n + pos) * p.num_kv_heads + h) * p.head_dim + d)])
                << "pos " << pos;
          for (int64_t d = 0; d < p.head_dim_v; ++d)
            ASSERT_EQ(view_at(cache->values(), b, slot, h, d),
                      p.v[size_t(((b * p.n + pos) * p.num_kv_heads + h) * p.head_dim_v + d)])
                << "pos " << pos;
        }
  }
}

TEST(KVCacheRing, WindowOneHasNoSlots) {
  auto cache = KVCache::create({1, 10, 1, 4, 0, DType::kBF16, 1});
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->slots(), 0);
  EXPECT_EQ(cache->nbytes(), 0u);
}

TEST(KVCacheStorage, Bf16StoresRoundToNearestEven) {
  // 1 + 2^-8 is a tie between bf16 neighbours 1 and 1 + 2^-7: ties go to
  // even (1); 1 + 3*2^-9 rounds up; -(1 + 2^-8 + 2^-16) rounds away.
  float kv[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-9f, -(1.0f + 0x1p-8f + 0x1p-16f),
                 1.0f + 0x1p-7f + 0x1p-8f};
  float q[4] = {0, 0, 0, 0}, out[4] = {};
  auto cache = KVCache::create({1, 2, 1, 4, 0, DType::kBF16, 0});
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(cache
                  ->attend(attnkit::make_view(q, DType::kF32, {1, 1, 1, 4}),
                           attnkit::make_view(kv, DType::kF32, {1, 1, 1, 4}),
                           attnkit::make_view(kv, DType::kF32, {1, 1, 1, 4}),
                           attnkit::make_view(out, DType::kF32, {1, 1, 1, 4}))
                  .ok());
  const auto* k = cache->keys().ptr<attnkit::bf16>();
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(attnkit::bf16_to_float(k[d]), attnkit_test::round_bf16(kv[d])) << d;
    EXPECT_EQ(out[d], attnkit_test::round_bf16(kv[d])) << d;  // one visible key: out = v
  }
}

TEST(KVCacheStorage, TokenStridePadsRowsOfWholeTwoKiB) {
  using attnkit::kv_token_stride;
  EXPECT_EQ(kv_token_stride(8, 128, DType::kF32), 8 * 128 + 16);   // 4 KiB rows
  EXPECT_EQ(kv_token_stride(8, 128, DType::kBF16), 8 * 128 + 32);  // 2 KiB
  EXPECT_EQ(kv_token_stride(4, 128, DType::kF32), 4 * 128 + 16);   // 2 KiB
  EXPECT_EQ(kv_token_stride(4, 128, DType::kBF16), 4 * 128);       // 1 KiB
  EXPECT_EQ(kv_token_stride(1, 576, DType::kF32), 576);            // 2304 B
  EXPECT_EQ(kv_token_stride(3, 5, DType::kF32), 15);
  EXPECT_EQ(kv_token_stride(0, 128, DType::kF32), 0);
  EXPECT_EQ(kv_token_stride(8, -1, DType::kF32), 0);
}

// kv_cache_view gives the layout the cache itself uses, padded or not.
TEST(KVCacheStorage, CacheViewIsTheCachesLayout) {
  struct Case {
    KVCacheSpec spec;
    std::array<int64_t, 4> k_strides, v_strides;
  } cases[] = {
      {{2, 5, 8, 128, 0, DType::kF32, 0}, {5 * 1040, 1040, 128, 1}, {5 * 1040, 1040, 128, 1}},
      {{2, 5, 8, 128, 64, DType::kBF16, 0}, {5 * 1056, 1056, 128, 1}, {5 * 512, 512, 64, 1}},
      {{3, 4, 3, 5, 7, DType::kF32, 0}, {4 * 15, 15, 5, 1}, {4 * 21, 21, 7, 1}},
  };
  for (const Case& c : cases) {
    const KVCacheSpec& spec = c.spec;
    auto cache = KVCache::create(spec);
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    const int64_t dims[2] = {spec.head_dim, spec.head_dim_v == 0 ? spec.head_dim : spec.head_dim_v};
    const TensorView* own[2] = {&cache->keys(), &cache->values()};
    const std::array<int64_t, 4>* expected[2] = {&c.k_strides, &c.v_strides};
    for (int i = 0; i < 2; ++i) {
      const TensorView w = attnkit::kv_cache_view(own[i]->data, spec.dtype, spec.batch_size,
                                                  cache->slots(), spec.num_kv_heads, dims[i]);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(w.strides[r], (*expected[i])[r]) << "view " << i << " axis " << r;
        EXPECT_EQ(own[i]->strides[r], w.strides[r]) << "view " << i << " axis " << r;
        EXPECT_EQ(own[i]->shape[r], w.shape[r]) << "view " << i << " axis " << r;
      }
    }
  }
}

// Rows of whole 2 KiB are stored padded; decoding through them must equal
// the oracle as unpadded rows do, with and without a ring, on both
// backends, and nbytes() stays the KV memory formula.
TEST(KVCacheStorage, PaddedRowsDecodeLikeTheOracle) {
  uint64_t seed = 900;
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int64_t W : {int64_t{0}, int64_t{6}})
      for (attnkit::Backend backend : {attnkit::Backend::kReference, attnkit::Backend::kAuto}) {
        Problem p;
        p.num_heads = 8;
        p.num_kv_heads = dtype == DType::kF32 ? 2 : 4;  // 2 KiB rows either way
        p.head_dim = p.head_dim_v = 256;
        p.n = 13;
        Rng rng(seed++);
        p.fill(rng);
        const KVCacheSpec spec{p.batch, p.n, p.num_kv_heads, p.head_dim, 0, dtype, W};
        SCOPED_TRACE(std::string(attnkit::dtype_name(dtype)) + " window " + std::to_string(W) +
                     (backend == attnkit::Backend::kReference ? " reference" : " auto"));
        auto cache = KVCache::create(spec);
        ASSERT_TRUE(cache.ok()) << cache.status().to_string();
        const size_t elem = attnkit::dtype_size(dtype);
        const int64_t row = p.num_kv_heads * p.head_dim, pad = 64 / int64_t(elem);
        const int64_t rows = p.batch * cache->slots();
        EXPECT_EQ(cache->keys().strides[1], row + pad);
        EXPECT_EQ(cache->values().strides[0], cache->slots() * (row + pad));
        EXPECT_EQ(cache->nbytes(), size_t(rows * row * 2) * elem);
        EXPECT_EQ(cache->storage_nbytes(), size_t(rows * (row + pad) * 2) * elem);
        attnkit::AttentionOptions opt;
        opt.backend = backend;
        const std::vector<float> out = decode(p, spec, {5, 1, 3, 1, 1, 2}, opt);
        EXPECT_TRUE(
            attnkit_test::all_close("out", out, oracle(p, W, dtype), tolerance(p, dtype, backend)));
      }
}

// Byte snapshot of a cache's observable state: every byte its (strided)
// views span, padding included.
struct Snapshot {
  int64_t length;
  std::vector<unsigned char> keys, values;
  explicit Snapshot(const KVCache& c)
      : length(c.length()), keys(span_bytes(c.keys())), values(span_bytes(c.values())) {}
  bool operator==(const Snapshot&) const = default;
};

TEST(KVCacheErrors, OverflowIsOutOfRangeAndChangesNothing) {
  for (int64_t W : {int64_t{0}, int64_t{4}})
    for (DType dt : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
      SCOPED_TRACE("window " + std::to_string(W) + " " + attnkit::dtype_name(dt));
      Problem p;
      p.n = 9;  // 5 + 4 overflows max_seq_len 8; 5 + 3 fits
      Rng rng(11);
      p.fill(rng);
      auto cache = KVCache::create({p.batch, 8, p.num_kv_heads, p.head_dim, 0, dt, W});
      ASSERT_TRUE(cache.ok());
      std::vector<float> out(size_t(p.batch * p.n * p.num_heads * p.head_dim_v), -7.0f);
      auto attend = [&](int64_t t0, int64_t T) {
        return cache->attend(rows(p.q, p.batch, p.n, p.num_heads, p.head_dim, t0, T),
                             rows(p.k, p.batch, p.n, p.num_kv_heads, p.head_dim, t0, T),
                             rows(p.v, p.batch, p.n, p.num_kv_heads, p.head_dim_v, t0, T),
                             rows(out, p.batch, p.n, p.num_heads, p.head_dim_v, t0, T));
      };
      ASSERT_TRUE(attend(0, 5).ok());
      const Snapshot before(*cache);
      const std::vector<float> out_before = out;
      const auto st = attend(5, 4);
      EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.to_string();
      EXPECT_NE(st.message().find("5 + 4"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("max_seq_len = 8"), std::string::npos) << st.message();
      EXPECT_TRUE(Snapshot(*cache) == before);
      EXPECT_EQ(out, out_before);
      // The cache is still usable: 3 more tokens fill it exactly.
      ASSERT_TRUE(attend(5, 3).ok());
      EXPECT_EQ(cache->length(), 8);
      EXPECT_EQ(attend(8, 1).code(), StatusCode::kOutOfRange);
      p.n = 8;  // compare the first 8 tokens (drop the 9th from inputs)
      Problem p8 = p;
      auto slice = [&](const std::vector<float>& a, int64_t heads, int64_t dim) {
        std::vector<float> r;
        for (int64_t b = 0; b < p.batch; ++b)
          r.insert(r.end(), a.begin() + b * 9 * heads * dim, a.begin() + (b * 9 + 8) * heads * dim);
        return r;
      };
      p8.q = slice(p.q, p.num_heads, p.head_dim);
      p8.k = slice(p.k, p.num_kv_heads, p.head_dim);
      p8.v = slice(p.v, p.num_kv_heads, p.head_dim_v);
      EXPECT_TRUE(attnkit_test::all_close("out", slice(out, p.num_heads, p.head_dim_v),
                                          oracle(p8, W, dt),
                                          tolerance(p8, dt, attnkit::Backend::kAuto)));
    }
}

TEST(KVCacheErrors, ResetForgetsTokens) {
  for (int64_t W : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE("window " + std::to_string(W));
    Problem first, second;
    first.n = second.n = 7;
    Rng rng(21);
    first.fill(rng);
    second.fill(rng);
    auto cache = KVCache::create({2, 7, 2, 8, 0, DType::kF32, W});
    ASSERT_TRUE(cache.ok());
    std::vector<float> out(size_t(2 * 7 * 4 * 8));
    auto run = [&](Problem& p) {
      int64_t t0 = 0;
      for (int64_t T : {4, 1, 2}) {
        ASSERT_TRUE(cache
                        ->attend(rows(p.q, 2, 7, 4, 8, t0, T), rows(p.k, 2, 7, 2, 8, t0, T),
                                 rows(p.v, 2, 7, 2, 8, t0, T), rows(out, 2, 7, 4, 8, t0, T))
                        .ok());
        t0 += T;
      }
    };
    run(first);
    cache->reset();
    EXPECT_EQ(cache->length(), 0);
    EXPECT_EQ(cache->stored(), 0);
    run(second);
    EXPECT_TRUE(attnkit_test::all_close("out", out, oracle(second, W, DType::kF32),
                                        tolerance(second, DType::kF32, attnkit::Backend::kAuto)));
  }
}

TEST(KVCacheErrors, CreateRejectsBadSpecs) {
  const KVCacheSpec good{2, 16, 2, 8, 0, DType::kF32, 0};
  ASSERT_TRUE(KVCache::create(good).ok());
  struct Bad {
    KVCacheSpec spec;
    StatusCode code;
    const char* needle;
  };
  std::vector<Bad> bad;
  auto with = [&](auto edit, StatusCode code, const char* needle) {
    KVCacheSpec s = good;
    edit(s);
    bad.push_back({s, code, needle});
  };
  with([](KVCacheSpec& s) { s.batch_size = 0; }, StatusCode::kInvalidArgument,
       "spec.batch_size = 0");
  with([](KVCacheSpec& s) { s.max_seq_len = -3; }, StatusCode::kInvalidArgument,
       "spec.max_seq_len = -3");
  with([](KVCacheSpec& s) { s.num_kv_heads = 0; }, StatusCode::kInvalidArgument,
       "spec.num_kv_heads");
  with([](KVCacheSpec& s) { s.head_dim = 0; }, StatusCode::kInvalidArgument, "spec.head_dim = 0");
  with([](KVCacheSpec& s) { s.head_dim_v = -1; }, StatusCode::kInvalidArgument,
       "spec.head_dim_v = -1");
  with([](KVCacheSpec& s) { s.dtype = DType::kF16; }, StatusCode::kInvalidArgument,
       "spec.dtype = f16 must be f32, bf16, int8 or fp8_e4m3");
  with([](KVCacheSpec& s) { s.sliding_window = -2; }, StatusCode::kInvalidArgument,
       "spec.sliding_window = -2");
  with(
      [](KVCacheSpec& s) {
        s.max_seq_len = int64_t{1} << 40;
        s.num_kv_heads = int64_t{1} << 30;
      },
      StatusCode::kResourceExhausted, "overflows");
  for (const Bad& b : bad) {
    auto r = KVCache::create(b.spec);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), b.code) << r.status().to_string();
    EXPECT_NE(r.status().message().find(b.needle), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().rfind("KVCache::create: ", 0), 0u) << r.status().message();
  }
}

TEST(KVCacheErrors, AttendRejectsBadInputsAndChangesNothing) {
  for (int64_t W : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE("window " + std::to_string(W));
    // batch 2, 4 heads, 2 kv heads, head_dim 8, head_dim_v 6.
    auto cache = KVCache::create({2, 16, 2, 8, 6, DType::kF32, W});
    ASSERT_TRUE(cache.ok());
    Rng rng(3);
    std::vector<float> q = attnkit_test::uniform_vector(2 * 3 * 4 * 8, rng);
    std::vector<float> k = attnkit_test::uniform_vector(2 * 3 * 2 * 8, rng);
    std::vector<float> v = attnkit_test::uniform_vector(2 * 3 * 2 * 6, rng);
    std::vector<float> out(2 * 3 * 4 * 6, 0.0f), big(2 * 3 * 4 * 8, 0.0f);
    auto Q = attnkit::make_view(q.data(), DType::kF32, {2, 3, 4, 8});
    auto K = attnkit::make_view(k.data(), DType::kF32, {2, 3, 2, 8});
    auto V = attnkit::make_view(v.data(), DType::kF32, {2, 3, 2, 6});
    auto O = attnkit::make_view(out.data(), DType::kF32, {2, 3, 4, 6});
    ASSERT_TRUE(cache->attend(Q, K, V, O).ok());  // some tokens held
    const Snapshot before(*cache);
    const std::vector<float> out_before = out;

    struct Case {
      const char* what;
      TensorView q, k, v, out;
      attnkit::AttentionOptions opt;
      const char* needle;
    };
    std::vector<Case> cases;
    auto add = [&](const char* what, auto edit, const char* needle) {
      Case c{what, Q, K, V, O, {}, needle};
      edit(c);
      cases.push_back(c);
    };
    int32_t seqlens[2] = {3, 3};
    uint8_t mask_byte = 1;
    add(
        "T = 0", [](Case& c) { c.q.shape[1] = c.k.shape[1] = c.v.shape[1] = c.out.shape[1] = 0; },
        "q.shape[1] (T) = 0 must be >= 1");
    add(
        "batch", [](Case& c) { c.q.shape[0] = 1; },
        "q.shape[0] (batch) = 1 must equal spec.batch_size = 2");
    add(
        "q head_dim",
        [&](Case& c) {
          c.q = attnkit::make_view(q.data(), DType::kF32, {2, 3, 8, 4});
        },
        "q.shape[3] (head_dim) = 4");
    add(
        "heads not divisible",
        [&](Case& c) {
          c.q = attnkit::make_view(q.data(), DType::kF32, {2, 3, 3, 8});
        },
        "must divide num_heads = 3");
    add(
        "k kv heads",
        [&](Case& c) {
          c.k = attnkit::make_view(k.data(), DType::kF32, {2, 3, 1, 8});
        },
        "k_new.shape[2] (num_kv_heads) = 1 must equal spec.num_kv_heads = 2");
    add(
        "k head_dim",
        [&](Case& c) {
          c.k = attnkit::make_view(k.data(), DType::kF32, {2, 3, 2, 4});
        },
        "k_new.shape[3] (head_dim) = 4 must equal spec.head_dim = 8");
    add(
        "v head_dim_v",
        [&](Case& c) {
          c.v = attnkit::make_view(v.data(), DType::kF32, {2, 3, 2, 4});
        },
        "v_new.shape[3] (head_dim_v) = 4 must equal spec.head_dim_v = 6");
    add(
        "v T", [&](Case& c) { c.v.shape[1] = 2; },
        "v_new.shape[1] (T) = 2 must equal q.shape[1] = 3");
    add(
        "out dim",
        [&](Case& c) {
          c.out = attnkit::make_view(big.data(), DType::kF32, {2, 3, 4, 8});
        },
        "out.shape[3] (head_dim_v) = 8 must equal spec.head_dim_v = 6");
    add(
        "k bf16", [&](Case& c) { c.k.dtype = DType::kBF16; }, "k_new.dtype = bf16 must be f32");
    add(
        "mask",
        [&](Case& c) {
          c.opt.mask = attnkit::make_view(&mask_byte, DType::kBool, {1, 1, 1, 1});
        },
        "options.mask");
    add(
        "seqlens_k", [&](Case& c) { c.opt.seqlens_k = seqlens; }, "options.seqlens_k");
    add(
        "window", [&](Case& c) { c.opt.window_size.left = 2; }, "options.window_size = (2, -1)");
    add(
        "softcap", [&](Case& c) { c.opt.softcap = -1.0f; }, "softcap");
    add(
        "out aliases q",
        [&](Case& c) {
          c.out = attnkit::make_view(q.data(), DType::kF32, {2, 3, 4, 6});
        },
        "out overlaps input q");
    add(
        "input aliases cache",
        [&](Case& c) {
          c.k = attnkit::make_view(cache->keys().data, DType::kF32, {2, 3, 2, 8});
          c.k.strides = {0, 0, 0, 0};
        },
        "k_new overlaps the cache's own storage");
    if (W > 0) {
      add(
          "sparse with window",
          [&](Case& c) {
            c.opt.sparse.kind = attnkit::SparsePattern::Kind::kStrided;
            c.opt.sparse.stride = 2;
          },
          "options.sparse cannot be combined");
    }
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      const auto st = cache->attend(c.q, c.k, c.v, c.out, c.opt);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
      EXPECT_EQ(st.message().rfind("KVCache::attend: ", 0), 0u) << st.message();
      EXPECT_TRUE(Snapshot(*cache) == before);
      EXPECT_EQ(out, out_before);
    }
  }
}

// A chunked cache (chunk_size C) decoding any schedule of prompt chunks
// and single tokens gives full causal attention with chunks of C, in
// float64; with sinks (passed per call) too, on chunked, windowed and
// plain caches.
TEST(KVCacheChunk, DecodeMatchesFullChunkedAttentionWithSinks) {
  std::vector<int64_t> singles(6, 1);
  auto cat = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::vector<int64_t>> schedules = {
      cat({11}, singles),    // prefill over several chunks, then decode
      cat({4, 7}, singles),  // prefill in two calls, then decode
      {3, 5, 2, 4, 3},       // multi-token calls across chunk boundaries
      {1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
  };
  uint64_t seed = 500;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8})
    for (attnkit::Backend backend : {attnkit::Backend::kReference, attnkit::Backend::kAuto})
      for (int64_t C : {1, 3, 4, 100})
        for (const auto& chunks : schedules)
          for (bool with_sinks : {false, true}) {
            Problem p;
            p.num_heads = 4;
            p.num_kv_heads = 2;
            p.head_dim_v = 6;
            p.n = std::accumulate(chunks.begin(), chunks.end(), int64_t{0});
            Rng rng(seed++);
            p.fill(rng);
            const std::vector<float> sinks = {-1.0f, 0.5f, 2.0f, 40.0f};
            KVCacheSpec spec{p.batch, p.n + 1, p.num_kv_heads, p.head_dim, p.head_dim_v, dtype,
                             0,       C};
            SCOPED_TRACE(std::string(attnkit::dtype_name(dtype)) + " chunk " + std::to_string(C) +
                         " calls " + join(chunks) + (with_sinks ? " sinks" : "") +
                         (backend == attnkit::Backend::kReference ? " reference" : " auto"));
            attnkit::AttentionOptions opt;
            opt.backend = backend;
            if (with_sinks) opt.sinks = attnkit::make_view(sinks.data(), DType::kF32, {4});
            if (C == 3) opt.chunk_size = 3;  // the cache's own: accepted
            const std::vector<float> out = decode(p, spec, chunks, opt);
            EXPECT_TRUE(attnkit_test::all_close(
                "out", out,
                oracle(p, 0, dtype, 0.0, 0.0, {}, C, with_sinks ? sinks : std::vector<float>{}),
                tolerance(p, dtype, backend)));
            auto cache = KVCache::create(spec);
            ASSERT_TRUE(cache.ok());
            EXPECT_EQ(cache->slots(), std::min(C, p.n + 1));
            // The window's two merged halves count the sink once.
            if (C == 4 && with_sinks && dtype == DType::kF32) {
              for (int64_t W : {0, 3}) {
                KVCacheSpec ws = spec;
                ws.chunk_size = 0;
                ws.sliding_window = W;
                opt.chunk_size = 0;
                EXPECT_TRUE(attnkit_test::all_close("windowed out", decode(p, ws, chunks, opt),
                                                    oracle(p, W, dtype, 0.0, 0.0, {}, 0, sinks),
                                                    tolerance(p, dtype, backend)));
              }
            }
          }
}

// Bad chunk specs and per-call options are rejected; a chunked cache's
// failed attend changes nothing.
TEST(KVCacheChunk, RejectsBadChunksAndSinksAndChangesNothing) {
  for (auto [W, C, needle] :
       {std::tuple<int64_t, int64_t, const char*>{0, -1, "spec.chunk_size = -1 must be >= 1"},
        {4, 8, "spec.sliding_window = 4 and spec.chunk_size = 8 are both set"}}) {
    auto r = KVCache::create({2, 16, 2, 8, 0, DType::kF32, W, C});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  }
  auto cache = KVCache::create({2, 16, 2, 8, 6, DType::kBF16, 0, 4});
  ASSERT_TRUE(cache.ok());
  Rng rng(9);
  std::vector<float> q = attnkit_test::uniform_vector(2 * 6 * 4 * 8, rng);
  std::vector<float> k = attnkit_test::uniform_vector(2 * 6 * 2 * 8, rng);
  std::vector<float> v = attnkit_test::uniform_vector(2 * 6 * 2 * 6, rng);
  std::vector<float> out(2 * 6 * 4 * 6, 0.0f);
  auto Q = attnkit::make_view(q.data(), DType::kF32, {2, 6, 4, 8});
  auto K = attnkit::make_view(k.data(), DType::kF32, {2, 6, 2, 8});
  auto V = attnkit::make_view(v.data(), DType::kF32, {2, 6, 2, 6});
  auto O = attnkit::make_view(out.data(), DType::kF32, {2, 6, 4, 6});
  ASSERT_TRUE(cache->attend(Q, K, V, O).ok());  // 6 tokens: chunk 1 half held
  const Snapshot before(*cache);
  const std::vector<float> out_before = out;
  std::vector<float> sinks = {1.0f, 2.0f, std::numeric_limits<float>::infinity(), 0.0f};
  std::vector<attnkit::AttentionOptions> bad(4);
  std::vector<const char*> needles = {"options.chunk_size = 5 must be 0 or spec.chunk_size = 4",
                                      "options.sinks[2] = inf must be finite",
                                      "options.sinks.shape[0]",
                                      "options.sparse cannot be combined"};
  bad[0].chunk_size = 5;
  bad[1].sinks = attnkit::make_view(sinks.data(), DType::kF32, {4});
  bad[2].sinks = attnkit::make_view(sinks.data(), DType::kF32, {2});
  bad[3].sparse.kind = attnkit::SparsePattern::Kind::kStrided;
  bad[3].sparse.stride = 2;
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(needles[i]);
    const auto st = cache->attend(Q, K, V, O, bad[i]);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(needles[i]), std::string::npos) << st.message();
    EXPECT_TRUE(Snapshot(*cache) == before);
    EXPECT_EQ(out, out_before);
  }
  // Past max_seq_len: out of range, nothing changed.
  std::vector<float> q2(2 * 11 * 4 * 8), k2(2 * 11 * 2 * 8), v2(2 * 11 * 2 * 6), o2(2 * 11 * 4 * 6);
  EXPECT_EQ(cache
                ->attend(attnkit::make_view(q2.data(), DType::kF32, {2, 11, 4, 8}),
                         attnkit::make_view(k2.data(), DType::kF32, {2, 11, 2, 8}),
                         attnkit::make_view(v2.data(), DType::kF32, {2, 11, 2, 6}),
                         attnkit::make_view(o2.data(), DType::kF32, {2, 11, 4, 6}))
                .code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(Snapshot(*cache) == before);
}

}  // namespace
