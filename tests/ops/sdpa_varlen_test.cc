// sdpa_varlen() against the float64 oracle run on each sequence alone: a
// packed batch of sequences of different lengths must give, row for row,
// what sdpa() gives each sequence as a batch of one (FlashAttention's
// flash_attn_varlen_func semantics). Also: equal lengths give sdpa()'s bits,
// outputs do not depend on the thread count, and every bad argument is
// rejected without a write.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/attention_bounds.h"
#include "common/attention_f64.h"
#include "common/random.h"

namespace {

using attnkit::AttentionOptions;
using attnkit::Backend;
using attnkit::DType;
using attnkit::SparsePattern;
using attnkit::StatusCode;
using attnkit::TensorView;

constexpr float kSentinel = -777.25f;

enum class Mask { kNone, kBool, kAdd };

struct VarlenCase {
  std::vector<int32_t> q_lens, k_lens;
  int64_t heads = 4, kv_heads = 2, d = 16, dv = 12;
  DType kv = DType::kF32;
  bool causal = false;
  attnkit::WindowSize window;
  float softcap = 0.0f;
  SparsePattern sparse;
  int64_t chunk_size = 0;
  std::vector<float> sinks;  // [heads]; empty = none
  Mask mask = Mask::kNone;
  bool mask_broadcast = false;  // [1, 1, 1, max_seqlen_k] instead of the full shape
  Backend backend = Backend::kAuto;
  int threads = 2;
  uint64_t seed = 1;

  std::string describe() const {
    std::string s = "q_lens=";
    for (int32_t x : q_lens) s += std::to_string(x) + ",";
    s += " k_lens=";
    for (int32_t x : k_lens) s += std::to_string(x) + ",";
    return s + " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
           " d=" + std::to_string(d) + "/" + std::to_string(dv) + " kv=" + dtype_name(kv) +
           " causal=" + std::to_string(causal) + " window=(" + std::to_string(window.left) + "," +
           std::to_string(window.right) + ") softcap=" + std::to_string(softcap) +
           " sparse=" + std::to_string(static_cast<int>(sparse.kind)) +
           " chunk=" + std::to_string(chunk_size) + " sinks=" + std::to_string(sinks.size()) +
           " mask=" + std::to_string(static_cast<int>(mask)) + (mask_broadcast ? "b" : "") +
           " backend=" + std::to_string(static_cast<int>(backend)) +
           " threads=" + std::to_string(threads) + " seed=" + std::to_string(seed);
  }
};

std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

// Packed inputs, outputs and the per-sequence oracle for one case.
struct Varlen {
  VarlenCase c;
  std::vector<int32_t> cu_q, cu_k;
  int32_t max_q = 0, max_k = 0, total_q = 0, total_k = 0;
  std::vector<float> q, k, v, out, lse, probs, add_mask;
  std::vector<attnkit::bf16> k16, v16;
  std::vector<uint8_t> bool_mask;

  explicit Varlen(const VarlenCase& vc) : c(vc) {
    cu_q = offsets(c.q_lens);
    cu_k = offsets(c.k_lens);
    total_q = cu_q.back();
    total_k = cu_k.back();
    max_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
    max_k = *std::max_element(c.k_lens.begin(), c.k_lens.end());
    attnkit_test::Rng rng(c.seed);
    // One spare element each: an empty batch still has a buffer (a view
    // without data is an absent one).
    q = attnkit_test::uniform_vector(size_t(cu_q.back() * c.heads * c.d + 1), rng);
    k = attnkit_test::uniform_vector(size_t(cu_k.back() * c.kv_heads * c.d + 1), rng);
    v = attnkit_test::uniform_vector(size_t(cu_k.back() * c.kv_heads * c.dv + 1), rng);
    if (c.kv == DType::kBF16) {
      // The oracle reads the rounded values, so rounding is not an error.
      for (float& x : k) x = attnkit_test::round_bf16(x);
      for (float& x : v) x = attnkit_test::round_bf16(x);
      for (float x : k) k16.push_back(attnkit::float_to_bf16(x));
      for (float x : v) v16.push_back(attnkit::float_to_bf16(x));
    }
    const size_t n = c.q_lens.size();
    const size_t mask_elems =
        c.mask_broadcast ? size_t(max_k) : n * size_t(c.heads * max_q * max_k);
    if (c.mask == Mask::kBool)
      for (size_t x = 0; x < mask_elems; ++x) bool_mask.push_back(rng.uniform(0, 1) < 0.75f);
    if (c.mask == Mask::kAdd)
      for (size_t x = 0; x < mask_elems; ++x)
        add_mask.push_back(rng.uniform(0, 1) < 0.1f ? -INFINITY : rng.uniform());
    out.assign(size_t(cu_q.back() * c.heads * c.dv + 1), kSentinel);
    lse.assign(size_t(c.heads * cu_q.back() + 1), kSentinel);
    probs.assign(n * size_t(c.heads * max_q * max_k) + 1, kSentinel);
    if (c.mask != Mask::kNone) {
      bool_mask.push_back(1);
      add_mask.push_back(0.0f);
    }
  }

  TensorView mask_view() {
    const int64_t n = static_cast<int64_t>(c.q_lens.size());
    const DType dt = c.mask == Mask::kBool ? DType::kBool : DType::kF32;
    void* data = c.mask == Mask::kBool ? static_cast<void*>(bool_mask.data()) : add_mask.data();
    if (c.mask == Mask::kNone) return {};
    if (c.mask_broadcast) return attnkit::make_view(data, dt, {1, 1, 1, max_k});
    return attnkit::make_view(data, dt, {n, c.heads, max_q, max_k});
  }

  attnkit::Status run(bool with_probs = false) {
    AttentionOptions o;
    o.causal = c.causal;
    o.window_size = c.window;
    o.softcap = c.softcap;
    o.sparse = c.sparse;
    o.chunk_size = c.chunk_size;
    if (!c.sinks.empty()) o.sinks = attnkit::make_view(c.sinks.data(), DType::kF32, {c.heads});
    o.mask = mask_view();
    o.backend = c.backend;
    o.num_threads = c.threads;
    const int64_t tq = total_q, tk = total_k;
    const int64_t n = static_cast<int64_t>(c.q_lens.size());
    const bool bf16 = c.kv == DType::kBF16;
    return attnkit::sdpa_varlen(
        attnkit::make_view(q.data(), DType::kF32, {tq, c.heads, c.d}),
        bf16 ? attnkit::make_view(k16.data(), DType::kBF16, {tk, c.kv_heads, c.d})
             : attnkit::make_view(k.data(), DType::kF32, {tk, c.kv_heads, c.d}),
        bf16 ? attnkit::make_view(v16.data(), DType::kBF16, {tk, c.kv_heads, c.dv})
             : attnkit::make_view(v.data(), DType::kF32, {tk, c.kv_heads, c.dv}),
        cu_q, cu_k, attnkit::make_view(out.data(), DType::kF32, {tq, c.heads, c.dv}), o,
        attnkit::make_view(lse.data(), DType::kF32, {c.heads, tq}),
        with_probs ? attnkit::make_view(probs.data(), DType::kF32, {n, c.heads, max_q, max_k})
                   : TensorView{});
  }

  // Sequence s alone through the float64 oracle.
  attnkit_test::OracleResult oracle(size_t s) const {
    const int64_t sq = c.q_lens[s], sk = c.k_lens[s];
    attnkit_test::OracleOptions o;
    o.seqlen_q = sq;
    o.seqlen_k = sk;
    o.num_heads = c.heads;
    o.num_kv_heads = c.kv_heads;
    o.head_dim = c.d;
    o.head_dim_v = c.dv;
    o.causal = c.causal;
    o.window_left = c.window.left;
    o.window_right = c.window.right;
    o.softcap = c.softcap;
    o.sparse = c.sparse;
    o.chunk_size = c.chunk_size;
    for (float x : c.sinks) o.sinks.push_back(x);
    if (c.mask != Mask::kNone) {
      // The sequence's [heads, sq, sk] corner of the padded mask.
      o.mask_shape = c.mask_broadcast ? std::array<int64_t, 4>{1, 1, 1, sk}
                                      : std::array<int64_t, 4>{1, c.heads, sq, sk};
      for (int64_t h = 0; h < o.mask_shape[1]; ++h)
        for (int64_t i = 0; i < o.mask_shape[2]; ++i)
          for (int64_t j = 0; j < sk; ++j) {
            const size_t at = c.mask_broadcast
                                  ? size_t(j)
                                  : size_t(((int64_t(s) * c.heads + h) * max_q + i) * max_k + j);
            if (c.mask == Mask::kBool)
              o.bool_mask.push_back(bool_mask[at]);
            else
              o.add_mask.push_back(add_mask[at]);
          }
    }
    auto slice = [](const std::vector<float>& x, int64_t row0, int64_t rows, int64_t width) {
      return std::vector<double>(x.begin() + row0 * width, x.begin() + (row0 + rows) * width);
    };
    return attnkit_test::attention_f64(o, slice(q, cu_q[s], sq, c.heads * c.d),
                                       slice(k, cu_k[s], sk, c.kv_heads * c.d),
                                       slice(v, cu_k[s], sk, c.kv_heads * c.dv));
  }
};

void expect_matches_oracle(Varlen& x, bool with_probs) {
  const VarlenCase& c = x.c;
  const attnkit::Status st = x.run(with_probs);
  ASSERT_TRUE(st.ok()) << st.to_string() << " " << c.describe();
  const attnkit_test::Tolerance tol =
      attnkit_test::attention_tolerance(c.d, x.max_k, c.kv, c.backend);
  for (size_t s = 0; s < c.q_lens.size(); ++s) {
    const attnkit_test::OracleResult ref = x.oracle(s);
    const int64_t sq = c.q_lens[s], row0 = x.cu_q[s];
    const std::vector<float> out(x.out.begin() + row0 * c.heads * c.dv,
                                 x.out.begin() + (row0 + sq) * c.heads * c.dv);
    EXPECT_TRUE(attnkit_test::all_close("out", out, ref.out, tol))
        << "sequence " << s << ": " << c.describe();
    // lse [heads, total_q] against the oracle's [1, heads, sq].
    std::vector<float> lse;
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < sq; ++i) lse.push_back(x.lse[size_t(h * x.cu_q.back() + row0 + i)]);
    const double s1 = std::sqrt(double(c.d));
    EXPECT_TRUE(attnkit_test::all_close("lse", lse, ref.lse, {tol.atol * (1.0 + s1), 1e-6}))
        << "sequence " << s << ": " << c.describe();
    if (!with_probs) continue;
    // probs [n, heads, max_q, max_k]: the [heads, sq, sk] corner, 0 elsewhere.
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < x.max_q; ++i)
        for (int64_t j = 0; j < x.max_k; ++j) {
          const float got =
              x.probs[size_t(((int64_t(s) * c.heads + h) * x.max_q + i) * x.max_k + j)];
          const bool inside = i < sq && j < c.k_lens[s];
          const double want = inside ? ref.probs[size_t((h * sq + i) * c.k_lens[s] + j)] : 0.0;
          ASSERT_NEAR(got, want, tol.atol)
              << "probs[" << s << "," << h << "," << i << "," << j << "] " << c.describe();
        }
  }
}

VarlenCase random_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
  };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  VarlenCase c;
  c.seed = seed;
  const int64_t n = pick({1, 2, 3, 5});
  for (int64_t s = 0; s < n; ++s) {
    // Decode rows (1), chunks, prompts, empty sequences, more queries than
    // keys (causal rows that see nothing).
    c.q_lens.push_back(static_cast<int32_t>(pick({0, 1, 1, 4, 9, 20})));
    c.k_lens.push_back(static_cast<int32_t>(pick({0, 1, 7, 20, 33, 70})));
  }
  const int64_t hg[][2] = {{4, 2}, {8, 1}, {3, 3}, {6, 2}};
  const auto& h = hg[pick({0, 1, 2, 3})];
  c.heads = h[0];
  c.kv_heads = h[1];
  c.d = pick({8, 16, 33});
  c.dv = pick({5, 8, 20});
  c.kv = chance(0.35) ? DType::kBF16 : DType::kF32;
  c.causal = chance(0.6);
  if (chance(0.3)) c.window = {pick({0, 3, 12}), pick({-1, 0, 2})};
  if (chance(0.2)) c.softcap = 1.5f;
  if (chance(0.15)) {
    c.sparse.kind = chance(0.5) ? SparsePattern::Kind::kStrided : SparsePattern::Kind::kFixed;
    c.sparse.block_size = pick({1, 4});
    c.sparse.stride = pick({2, 3});
  }
  c.mask = static_cast<Mask>(pick({0, 0, 0, 1, 2}));
  c.mask_broadcast = chance(0.4);
  c.backend = chance(0.25) ? Backend::kReference : Backend::kAuto;
  c.threads = static_cast<int>(pick({1, 2, 3}));
  if (chance(0.25)) c.chunk_size = pick({1, 5, 16, 17});
  if (chance(0.25))
    for (int64_t x = 0; x < c.heads; ++x)
      c.sinks.push_back(static_cast<float>(pick({-10, 0, 1, 3, 40})));
  return c;
}

TEST(SdpaVarlen, RandomBatchesMatchEachSequenceAlone) {
  for (uint64_t seed = 1; seed <= 80; ++seed) {
    Varlen x(random_case(seed * 104729));
    expect_matches_oracle(x, /*with_probs=*/false);
  }
}

TEST(SdpaVarlen, ProbabilitiesArePaddedPerSequence) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    VarlenCase c = random_case(seed * 31);
    Varlen x(c);
    expect_matches_oracle(x, /*with_probs=*/true);
  }
}

// Sequences of one length are sdpa()'s batch: the same plan, the same bits.
TEST(SdpaVarlen, EqualLengthsGiveSdpaBits) {
  for (int64_t sq : {1, 16})
    for (DType kv : {DType::kF32, DType::kBF16}) {
      VarlenCase c;
      c.q_lens = {static_cast<int32_t>(sq), static_cast<int32_t>(sq), static_cast<int32_t>(sq)};
      c.k_lens = {600, 600, 600};
      c.heads = 8;
      c.kv_heads = 2;
      c.d = c.dv = 32;
      c.kv = kv;
      c.causal = true;
      Varlen x(c);
      ASSERT_TRUE(x.run().ok());
      std::vector<float> out(x.out.size(), kSentinel), lse(x.lse.size(), kSentinel);
      const int64_t b = 3;
      AttentionOptions o;
      o.causal = true;
      o.num_threads = c.threads;
      const bool bf16 = kv == DType::kBF16;
      const attnkit::Status st = attnkit::sdpa(
          attnkit::make_view(x.q.data(), DType::kF32, {b, sq, c.heads, c.d}),
          bf16 ? attnkit::make_view(x.k16.data(), DType::kBF16, {b, 600, c.kv_heads, c.d})
               : attnkit::make_view(x.k.data(), DType::kF32, {b, 600, c.kv_heads, c.d}),
          bf16 ? attnkit::make_view(x.v16.data(), DType::kBF16, {b, 600, c.kv_heads, c.dv})
               : attnkit::make_view(x.v.data(), DType::kF32, {b, 600, c.kv_heads, c.dv}),
          attnkit::make_view(out.data(), DType::kF32, {b, sq, c.heads, c.dv}), o);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(0, std::memcmp(out.data(), x.out.data(), out.size() * sizeof(float)))
          << "sq=" << sq << " " << dtype_name(kv);
    }
}

TEST(SdpaVarlen, BitIdenticalForAnyThreadCount) {
  VarlenCase c;
  c.q_lens = {1, 3, 1, 17};
  c.k_lens = {2000, 900, 1, 1500};
  c.heads = 8;
  c.kv_heads = 2;
  c.d = c.dv = 64;
  c.causal = true;
  c.threads = 1;
  Varlen first(c);
  ASSERT_TRUE(first.run().ok());
  for (int threads : {2, 3, 7}) {
    c.threads = threads;
    Varlen again(c);
    ASSERT_TRUE(again.run().ok());
    EXPECT_EQ(0, std::memcmp(first.out.data(), again.out.data(), first.out.size() * 4)) << threads;
    EXPECT_EQ(0, std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * 4)) << threads;
  }
}

// Each rule of the packed layout, broken once: kInvalidArgument naming the
// argument, and nothing written.
TEST(SdpaVarlen, RejectsBadOffsetsAndShapesWithoutWriting) {
  struct Bad {
    const char* needle;
    std::vector<int32_t> cu_q, cu_k;
  };
  const Bad bad[] = {
      {"cu_seqlens_k has 3 entries, must have 2", {0, 4}, {0, 5, 9}},
      {"cu_seqlens_q[0] = 1 must be 0", {1, 2, 4}, {0, 5, 9}},
      {"cu_seqlens_k[2] = 3 must be >= cu_seqlens_k[1] = 5", {0, 2, 4}, {0, 5, 3}},
      {"cu_seqlens_q[2] = 3 must equal q.shape[0] = 4", {0, 2, 3}, {0, 5, 9}},
      {"cu_seqlens_k[2] = 8 must equal k.shape[0] = 9", {0, 2, 4}, {0, 5, 8}},
  };
  VarlenCase c;
  c.q_lens = {2, 2};
  c.k_lens = {5, 4};
  for (const Bad& b : bad) {
    Varlen x(c);
    x.cu_q = b.cu_q;
    x.cu_k = b.cu_k;
    const attnkit::Status st = x.run();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find(std::string("sdpa_varlen: ") + b.needle), std::string::npos)
        << st.message();
    for (float o : x.out) ASSERT_EQ(o, kSentinel);
    for (float o : x.lse) ASSERT_EQ(o, kSentinel);
  }
  Varlen x(c);
  const std::vector<int32_t> lens{5, 4};
  AttentionOptions o;
  o.seqlens_k = lens;
  const attnkit::Status st = attnkit::sdpa_varlen(
      attnkit::make_view(x.q.data(), DType::kF32, {4, c.heads, c.d}),
      attnkit::make_view(x.k.data(), DType::kF32, {9, c.kv_heads, c.d}),
      attnkit::make_view(x.v.data(), DType::kF32, {9, c.kv_heads, c.dv}), x.cu_q, x.cu_k,
      attnkit::make_view(x.out.data(), DType::kF32, {4, c.heads, c.dv}), o);
  EXPECT_NE(st.message().find("options.seqlens_k must be empty"), std::string::npos)
      << st.message();
  // lse in sdpa()'s [batch, heads, seqlen_q] layout instead of [heads, total_q].
  const attnkit::Status lse_st = attnkit::sdpa_varlen(
      attnkit::make_view(x.q.data(), DType::kF32, {4, c.heads, c.d}),
      attnkit::make_view(x.k.data(), DType::kF32, {9, c.kv_heads, c.d}),
      attnkit::make_view(x.v.data(), DType::kF32, {9, c.kv_heads, c.dv}), x.cu_q, x.cu_k,
      attnkit::make_view(x.out.data(), DType::kF32, {4, c.heads, c.dv}), {},
      attnkit::make_view(x.lse.data(), DType::kF32, {2, c.heads, 2}));
  EXPECT_NE(lse_st.message().find("sdpa_varlen: lse has rank 3"), std::string::npos)
      << lse_st.message();
  for (float v : x.out) ASSERT_EQ(v, kSentinel);
}

}  // namespace
