// Every bad argument to sdpa() and merge_attention_states() is rejected with
// kInvalidArgument, a message naming the argument and its value, and no write
// to any output (each output is pre-filled with a sentinel and compared bit
// for bit afterwards).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"
#include "common/kv_quant_f64.h"
#include "common/random.h"

namespace {

using attnkit::AttentionOptions;
using attnkit::Backend;
using attnkit::bf16;
using attnkit::DType;
using attnkit::SparsePattern;
using attnkit::Status;
using attnkit::StatusCode;
using attnkit::TensorView;

constexpr float kSentinel = -12345.5f;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A valid GQA call: batch 2, seqlen_q 3, seqlen_k 5, 4 query heads over 2 kv
// heads, head_dim 8, head_dim_v 6. Tests break one thing at a time.
struct SdpaCall {
  static constexpr int64_t B = 2, Sq = 3, Sk = 5, H = 4, Hkv = 2, D = 8, Dv = 6;
  std::vector<float> q, k, v, out, lse, probs;
  std::vector<bf16> k16, v16;
  std::vector<uint8_t> mask_data;
  std::vector<int32_t> lens{5, 2};
  TensorView qv, kv, vv, ov, lv, pv;
  AttentionOptions opt;

  SdpaCall() {
    attnkit_test::Rng rng(42);
    q = attnkit_test::uniform_vector(size_t(B * Sq * H * D), rng);
    k = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * D), rng);
    v = attnkit_test::uniform_vector(size_t(B * Sk * Hkv * Dv), rng);
    // Extra room so that views can be re-shaped bigger in a test without
    // pointing outside the allocation.
    out.assign(size_t(4 * B * Sq * H * Dv), kSentinel);
    lse.assign(size_t(2 * B * H * Sq * Sk), kSentinel);
    probs.assign(size_t(4 * B * H * Sq * Sk), kSentinel);
    mask_data.assign(size_t(B * H * Sq * Sk * 4), 1);
    qv = attnkit::make_view(q.data(), DType::kF32, {B, Sq, H, D});
    kv = attnkit::make_view(k.data(), DType::kF32, {B, Sk, Hkv, D});
    vv = attnkit::make_view(v.data(), DType::kF32, {B, Sk, Hkv, Dv});
    ov = attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, Dv});
    lv = attnkit::make_view(lse.data(), DType::kF32, {B, H, Sq});
    pv = attnkit::make_view(probs.data(), DType::kF32, {B, H, Sq, Sk});
    opt.backend = Backend::kReference;
  }
  Status call() const { return attnkit::sdpa(qv, kv, vv, ov, opt, lv, pv); }
  // int8 K/V with their scales, quantized as a KVCache stores them.
  std::vector<uint8_t> k8, v8;
  std::vector<float> ks8, vs8;
  void use_int8_kv() {
    k8.resize(k.size());
    v8.resize(v.size());
    ks8.resize(size_t(B * Sk * Hkv));
    vs8.resize(ks8.size());
    const TensorView kc = attnkit::make_view(k8.data(), DType::kI8, {B, Sk, Hkv, D});
    const TensorView vc = attnkit::make_view(v8.data(), DType::kI8, {B, Sk, Hkv, Dv});
    opt.k_scales = attnkit::make_view(ks8.data(), DType::kF32, {B, Sk, Hkv, 1});
    opt.v_scales = attnkit::make_view(vs8.data(), DType::kF32, {B, Sk, Hkv, 1});
    EXPECT_TRUE(attnkit::quantize_kv_rows(kv, kc, opt.k_scales).ok());
    EXPECT_TRUE(attnkit::quantize_kv_rows(vv, vc, opt.v_scales).ok());
    kv = kc;
    vv = vc;
  }
  void use_bf16_kv() {
    for (float x : k) k16.push_back(attnkit::float_to_bf16(x));
    for (float x : v) v16.push_back(attnkit::float_to_bf16(x));
    kv = attnkit::make_view(k16.data(), DType::kBF16, {B, Sk, Hkv, D});
    vv = attnkit::make_view(v16.data(), DType::kBF16, {B, Sk, Hkv, Dv});
  }
  TensorView mask(DType dtype, std::initializer_list<int64_t> shape) {
    return attnkit::make_view(mask_data.data(), dtype, shape);
  }
};

bool all_sentinel(const std::vector<float>& x) {
  for (float e : x)
    if (std::memcmp(&e, &kSentinel, sizeof e) != 0) return false;
  return true;
}

// The call fails with kInvalidArgument, its message contains every needle,
// and no output element changed.
void expect_rejected(const Status& st, const std::vector<std::string>& needles,
                     const std::vector<const std::vector<float>*>& outputs) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  for (const std::string& n : needles)
    EXPECT_NE(st.message().find(n), std::string::npos)
        << "message \"" << st.message() << "\" lacks \"" << n << "\"";
  for (const auto* o : outputs) EXPECT_TRUE(all_sentinel(*o)) << "an output was written";
}

void expect_sdpa_rejected(const SdpaCall& c, const std::vector<std::string>& needles) {
  std::vector<std::string> all{"sdpa: "};
  all.insert(all.end(), needles.begin(), needles.end());
  expect_rejected(c.call(), all, {&c.out, &c.lse, &c.probs});
}

// Positive controls: the unbroken call succeeds and writes, so a sentinel
// left intact above really means "nothing written".
TEST(SdpaApi, ValidCallWrites) {
  SdpaCall c;
  c.opt.seqlens_k = c.lens;
  c.opt.mask = c.mask(DType::kBool, {1, 1, 1, SdpaCall::Sk});
  const Status st = c.call();
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_FALSE(all_sentinel(c.out));
  EXPECT_FALSE(all_sentinel(c.lse));
  EXPECT_FALSE(all_sentinel(c.probs));
  SdpaCall d;
  d.use_bf16_kv();
  EXPECT_TRUE(d.call().ok());
}

TEST(SdpaApi, MissingViews) {
  for (const char* name : {"q", "k", "v", "out"}) {
    SdpaCall c;
    TensorView* views[] = {&c.qv, &c.kv, &c.vv, &c.ov};
    const std::string n = name;
    views[n == "q" ? 0 : n == "k" ? 1 : n == "v" ? 2 : 3]->data = nullptr;
    SCOPED_TRACE(n);
    expect_sdpa_rejected(c, {n + " is missing"});
  }
}

TEST(SdpaApi, WrongRank) {
  SdpaCall c;
  c.qv.rank = 3;
  expect_sdpa_rejected(c, {"q has rank 3", "must have rank 4"});
  SdpaCall d;
  d.vv = attnkit::make_view(d.v.data(), DType::kF32, {2, 5, 12});
  expect_sdpa_rejected(d, {"v has rank 3"});
  SdpaCall e;
  e.lv = attnkit::make_view(e.lse.data(), DType::kF32, {2, 4, 3, 1});
  expect_sdpa_rejected(e, {"lse has rank 4", "must have rank 3"});
  SdpaCall f;
  f.pv = attnkit::make_view(f.probs.data(), DType::kF32, {8, 3, 5});
  expect_sdpa_rejected(f, {"probs has rank 3"});
  SdpaCall g;
  g.ov.rank = 2;
  expect_sdpa_rejected(g, {"out has rank 2"});
}

TEST(SdpaApi, WrongDtype) {
  SdpaCall c;
  c.qv.dtype = DType::kBF16;
  expect_sdpa_rejected(c, {"q.dtype = bf16", "must be f32"});
  SdpaCall d;
  d.kv.dtype = DType::kI32;
  expect_sdpa_rejected(d, {"k.dtype = i32", "f32 or bf16 or int8 or fp8_e4m3"});
  SdpaCall e;  // v must follow k's dtype
  e.use_bf16_kv();
  e.vv = attnkit::make_view(e.v.data(), DType::kF32, {2, 5, 2, 6});
  expect_sdpa_rejected(e, {"v.dtype = f32", "must be bf16"});
  SdpaCall f;
  f.ov.dtype = DType::kF16;
  expect_sdpa_rejected(f, {"out.dtype = f16"});
  SdpaCall g;
  g.lv.dtype = DType::kF64;
  expect_sdpa_rejected(g, {"lse.dtype = f64"});
  SdpaCall h;
  h.pv.dtype = DType::kBool;
  expect_sdpa_rejected(h, {"probs.dtype = bool"});
}

TEST(SdpaApi, MismatchedShapes) {
  struct Edit {
    std::function<void(SdpaCall&)> apply;
    std::vector<std::string> needles;
  };
  const std::vector<Edit> edits = {
      {[](SdpaCall& c) { c.kv.shape[0] = 1; }, {"k.shape[0] (batch) = 1", "q.shape[0] = 2"}},
      {[](SdpaCall& c) { c.vv.shape[0] = 1; }, {"v.shape[0] (batch) = 1"}},
      {[](SdpaCall& c) { c.ov.shape[0] = 1; }, {"out.shape[0] (batch) = 1"}},
      {[](SdpaCall& c) { c.vv.shape[1] = 4; }, {"v.shape[1] (seqlen_k) = 4", "k.shape[1] = 5"}},
      {[](SdpaCall& c) { c.ov.shape[1] = 2; }, {"out.shape[1] (seqlen_q) = 2", "q.shape[1] = 3"}},
      {[](SdpaCall& c) { c.kv.shape[3] = 7; }, {"k.shape[3] (head_dim) = 7", "q.shape[3] = 8"}},
      {[](SdpaCall& c) { c.ov.shape[3] = 5; }, {"out.shape[3] (head_dim_v) = 5", "v.shape[3] = 6"}},
      {[](SdpaCall& c) { c.ov.shape[2] = 2; }, {"out.shape[2] (num_heads) = 2"}},
      {[](SdpaCall& c) { c.vv.shape[2] = 1; }, {"v.shape[2] (num_kv_heads) = 1"}},
      {[](SdpaCall& c) {  // 3 kv heads cannot serve 4 query heads
         c.kv = attnkit::make_view(c.k.data(), DType::kF32, {2, 5, 3, 8});
         c.vv = attnkit::make_view(c.v.data(), DType::kF32, {2, 5, 3, 4});
         c.ov = attnkit::make_view(c.out.data(), DType::kF32, {2, 3, 4, 4});
       },
       {"num_kv_heads = 3", "must divide num_heads = 4"}},
      {[](SdpaCall& c) { c.qv.shape[2] = 0; }, {"num_heads = 0", ">= 1"}},
      {[](SdpaCall& c) { c.kv.shape[2] = 0; }, {"num_kv_heads = 0", ">= 1"}},
      {[](SdpaCall& c) { c.qv.shape[3] = 0; }, {"head_dim = 0"}},
      {[](SdpaCall& c) { c.vv.shape[3] = 0; }, {"head_dim_v = 0"}},
      {[](SdpaCall& c) { c.lv.shape[2] = 2; }, {"lse.shape[2] (seqlen_q) = 2", "q.shape[1] = 3"}},
      {[](SdpaCall& c) {  // [batch, seq, heads] instead of [batch, heads, seq]
         c.lv = attnkit::make_view(c.lse.data(), DType::kF32, {2, 3, 4});
       },
       {"lse.shape[1] (num_heads) = 3"}},
      {[](SdpaCall& c) { c.lv.shape[0] = 3; }, {"lse.shape[0] (batch) = 3"}},
      {[](SdpaCall& c) { c.pv.shape[3] = 4; }, {"probs.shape[3] (seqlen_k) = 4", "k.shape[1] = 5"}},
      {[](SdpaCall& c) {
         c.pv = attnkit::make_view(c.probs.data(), DType::kF32, {2, 3, 4, 5});
       },
       {"probs.shape[1] (num_heads) = 3"}},
      {[](SdpaCall& c) { c.pv.shape[2] = 5; }, {"probs.shape[2] (seqlen_q) = 5"}},
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    SdpaCall c;
    edits[i].apply(c);
    expect_sdpa_rejected(c, edits[i].needles);
  }
}

TEST(SdpaApi, NegativeShapeStrideAndOverflow) {
  SdpaCall c;
  c.qv.shape[1] = -1;
  expect_sdpa_rejected(c, {"q.shape[1] = -1", ">= 0"});
  SdpaCall d;
  d.kv.strides[2] = -8;
  expect_sdpa_rejected(d, {"k.strides[2] = -8", ">= 0"});
  SdpaCall e;
  e.ov.strides[0] = -1;
  expect_sdpa_rejected(e, {"out.strides[0] = -1"});
  SdpaCall f;
  f.vv.shape[0] = int64_t(1) << 40;
  f.vv.strides[0] = int64_t(1) << 40;
  expect_sdpa_rejected(f, {"v ", "overflows"});
}

TEST(SdpaApi, OutputsOverlap) {
  SdpaCall c;  // out written over q
  c.ov = attnkit::make_view(c.q.data(), DType::kF32, {2, 3, 4, 6});
  expect_rejected(c.call(), {"sdpa: out overlaps input q"}, {&c.out, &c.lse, &c.probs});
  SdpaCall d;  // lse inside v
  d.lv = attnkit::make_view(d.v.data() + 10, DType::kF32, {2, 4, 3});
  expect_sdpa_rejected(d, {"lse overlaps input v"});
  SdpaCall e;  // probs over the mask
  e.opt.mask = attnkit::make_view(e.probs.data(), DType::kF32, {2, 4, 3, 5});
  expect_sdpa_rejected(e, {"probs overlaps input mask"});
  SdpaCall f;  // lse inside out
  f.lv = attnkit::make_view(f.out.data() + 7, DType::kF32, {2, 4, 3});
  expect_sdpa_rejected(f, {"outputs out and lse overlap"});
  SdpaCall g;
  g.pv = attnkit::make_view(g.lse.data(), DType::kF32, {2, 4, 3, 5});
  expect_sdpa_rejected(g, {"outputs lse and probs overlap"});
}

// An output whose own elements share memory (stride 0, or strides that
// collide) cannot be written deterministically.
TEST(SdpaApi, OutputOverlapsItself) {
  SdpaCall c;
  c.ov.strides[1] = 0;
  expect_sdpa_rejected(c, {"out.strides[1] = 0", "out.shape[1] = 3", "overlap itself"});
  SdpaCall d;
  d.ov.strides[2] = 1;  // heads step by one element, as dims do
  expect_sdpa_rejected(d, {"out.strides[2] = 1", "overlap itself"});
  SdpaCall e;
  e.lv.strides[1] = 0;
  expect_sdpa_rejected(e, {"lse.strides[1] = 0"});
  SdpaCall f;
  f.pv.strides[3] = f.pv.strides[2];  // keys step like queries
  expect_sdpa_rejected(f, {"probs.strides[", "overlap itself"});
  // Size-1 dims may carry any stride, and non-colliding exotic strides pass.
  SdpaCall g;
  g.ov = attnkit::make_view(g.out.data(), DType::kF32, {1, 3, 4, 6});
  g.qv.shape[0] = g.kv.shape[0] = g.vv.shape[0] = 1;
  g.ov.strides[0] = 0;
  g.lv = TensorView{};
  g.pv = TensorView{};
  EXPECT_TRUE(g.call().ok());
}

TEST(SdpaApi, WindowSoftmaxScaleSoftcapThreadsBackend) {
  struct Edit {
    std::function<void(AttentionOptions&)> apply;
    std::vector<std::string> needles;
  };
  const std::vector<Edit> edits = {
      {[](AttentionOptions& o) { o.window_size.left = -2; }, {"window_size.left = -2"}},
      {[](AttentionOptions& o) { o.window_size.right = -5; }, {"window_size.right = -5"}},
      {[](AttentionOptions& o) { o.softmax_scale = -1.0f; }, {"softmax_scale = -1"}},
      {[](AttentionOptions& o) { o.softmax_scale = kNaN; }, {"softmax_scale = nan"}},
      {[](AttentionOptions& o) { o.softmax_scale = kInf; }, {"softmax_scale = inf"}},
      {[](AttentionOptions& o) { o.softmax_scale = -kInf; }, {"softmax_scale = -inf"}},
      {[](AttentionOptions& o) { o.softcap = -0.5f; }, {"softcap = -0.5"}},
      {[](AttentionOptions& o) { o.softcap = kNaN; }, {"softcap = nan"}},
      {[](AttentionOptions& o) { o.softcap = kInf; }, {"softcap = inf"}},
      {[](AttentionOptions& o) { o.num_threads = -1; }, {"num_threads = -1"}},
      {[](AttentionOptions& o) { o.chunk_size = -3; }, {"chunk_size = -3", ">= 0"}},
      {[](AttentionOptions& o) { o.backend = static_cast<Backend>(9); }, {"backend = 9"}},
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    SdpaCall c;
    edits[i].apply(c.opt);
    expect_sdpa_rejected(c, edits[i].needles);
  }
}

// options.sinks: f32, rank 1, [num_heads], every value finite; any stride.
TEST(SdpaApi, Sinks) {
  std::vector<float> sinks(16, 0.5f);
  std::vector<int32_t> ints(16, 0);
  struct Bad {
    TensorView view;
    std::vector<std::string> needles;
  };
  const int64_t H = SdpaCall::H;
  std::vector<Bad> bad = {
      {attnkit::make_view(sinks.data(), DType::kF32, {H - 1}),
       {"options.sinks.shape[0]", "= 3", "num_heads", "4"}},
      {attnkit::make_view(sinks.data(), DType::kF32, {1, H}), {"options.sinks has rank 2"}},
      {attnkit::make_view(ints.data(), DType::kI32, {H}), {"options.sinks.dtype"}},
  };
  std::vector<std::vector<float>> nonfinite(3, std::vector<float>(16, 0.5f));
  const float values[3] = {kNaN, kInf, -kInf};
  for (int x = 0; x < 3; ++x) {
    nonfinite[x][6] = values[x];
    TensorView v = attnkit::make_view(nonfinite[x].data(), DType::kF32, {H});
    v.strides[0] = 2;  // element 3 is nonfinite[x][6]
    bad.push_back({v, {"options.sinks[3] = ", "must be finite"}});
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    SdpaCall c;
    c.opt.sinks = bad[i].view;
    expect_sdpa_rejected(c, bad[i].needles);
  }
  // Sinks inside an output alias it.
  SdpaCall d;
  d.opt.sinks = attnkit::make_view(d.out.data() + 4, DType::kF32, {H});
  expect_rejected(d.call(), {"sdpa: ", "out overlaps input options.sinks"}, {&d.lse, &d.probs});
  // Strided, finite sinks are accepted (sdpa_varlen too: tests/ops).
  SdpaCall e;
  TensorView strided = attnkit::make_view(sinks.data(), DType::kF32, {H});
  strided.strides[0] = 3;
  e.opt.sinks = strided;
  e.opt.chunk_size = 2;
  EXPECT_TRUE(e.call().ok());
}

TEST(SdpaApi, SeqlensK) {
  SdpaCall c;
  const std::vector<int32_t> one{5};
  c.opt.seqlens_k = one;
  expect_sdpa_rejected(c, {"seqlens_k has 1 entries", "batch = 2"});
  SdpaCall d;
  const std::vector<int32_t> three{5, 5, 5};
  d.opt.seqlens_k = three;
  expect_sdpa_rejected(d, {"seqlens_k has 3 entries"});
  SdpaCall e;
  const std::vector<int32_t> big{5, 6};
  e.opt.seqlens_k = big;
  expect_sdpa_rejected(e, {"seqlens_k[1] = 6", "[0, seqlen_k = 5]"});
  SdpaCall f;
  const std::vector<int32_t> neg{-1, 2};
  f.opt.seqlens_k = neg;
  expect_sdpa_rejected(f, {"seqlens_k[0] = -1"});
  SdpaCall g;  // the bounds themselves are fine
  const std::vector<int32_t> edge{0, 5};
  g.opt.seqlens_k = edge;
  EXPECT_TRUE(g.call().ok());
}

TEST(SdpaApi, Mask) {
  SdpaCall c;
  c.opt.mask = c.mask(DType::kBool, {4, 3, 5});
  expect_sdpa_rejected(c, {"mask has rank 3"});
  SdpaCall d;
  d.opt.mask = d.mask(DType::kI32, {1, 1, 3, 5});
  expect_sdpa_rejected(d, {"mask.dtype = i32", "bool or f32"});
  SdpaCall e;
  e.opt.mask = e.mask(DType::kBool, {1, 1, 2, 5});
  expect_sdpa_rejected(e, {"mask.shape[2] = 2", "1 or seqlen_q = 3"});
  SdpaCall f;
  f.opt.mask = f.mask(DType::kBool, {3, 1, 1, 5});
  expect_sdpa_rejected(f, {"mask.shape[0] = 3", "1 or batch = 2"});
  SdpaCall g;  // mask over kv heads instead of query heads
  g.opt.mask = g.mask(DType::kF32, {1, 2, 1, 1});
  expect_sdpa_rejected(g, {"mask.shape[1] = 2", "num_heads = 4"});
  SdpaCall h;
  h.opt.mask = h.mask(DType::kBool, {1, 1, 1, 4});
  expect_sdpa_rejected(h, {"mask.shape[3] = 4", "seqlen_k = 5"});
  SdpaCall i;
  i.opt.mask = i.mask(DType::kBool, {1, 1, 3, 5});
  i.opt.mask.strides[3] = -1;
  expect_sdpa_rejected(i, {"mask.strides[3] = -1"});
}

TEST(SdpaApi, Sparse) {
  using Kind = SparsePattern::Kind;
  struct Edit {
    SparsePattern sp;
    std::vector<std::string> needles;
  };
  const std::vector<Edit> edits = {
      {{Kind::kStrided, 1, 0, 1}, {"sparse.stride = 0", ">= 1"}},
      {{Kind::kFixed, 1, -3, 1}, {"sparse.stride = -3"}},
      {{Kind::kStrided, 0, 2, 1}, {"sparse.block_size = 0", ">= 1"}},
      {{Kind::kFixed, -4, 2, 1}, {"sparse.block_size = -4"}},
      {{Kind::kFixed, 1, 4, 5}, {"sparse.summary = 5", "[1, sparse.stride = 4]"}},
      {{Kind::kFixed, 1, 4, 0}, {"sparse.summary = 0"}},
      {{static_cast<Kind>(7), 1, 2, 1}, {"sparse.kind = 7"}},
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    SdpaCall c;
    c.opt.sparse = edits[i].sp;
    expect_sdpa_rejected(c, edits[i].needles);
  }
  SdpaCall ok;  // summary only matters for kFixed
  ok.opt.sparse = {Kind::kStrided, 2, 3, 0};
  EXPECT_TRUE(ok.call().ok());
}

// ---------------------------------------------------------------------------
// merge_attention_states

struct MergeCall {
  static constexpr int64_t B = 2, Sq = 3, H = 4, Dv = 5;
  std::vector<float> out_a, lse_a, out_b, lse_b, out, lse;
  TensorView oa, la, ob, lb, o, l;

  MergeCall() {
    attnkit_test::Rng rng(7);
    out_a = attnkit_test::uniform_vector(size_t(B * Sq * H * Dv), rng);
    out_b = attnkit_test::uniform_vector(size_t(B * Sq * H * Dv), rng);
    lse_a = attnkit_test::uniform_vector(size_t(B * H * Sq), rng);
    lse_b = attnkit_test::uniform_vector(size_t(B * H * Sq), rng);
    out.assign(size_t(2 * B * Sq * H * Dv), kSentinel);
    lse.assign(size_t(2 * B * H * Sq), kSentinel);
    oa = attnkit::make_view(out_a.data(), DType::kF32, {B, Sq, H, Dv});
    ob = attnkit::make_view(out_b.data(), DType::kF32, {B, Sq, H, Dv});
    la = attnkit::make_view(lse_a.data(), DType::kF32, {B, H, Sq});
    lb = attnkit::make_view(lse_b.data(), DType::kF32, {B, H, Sq});
    o = attnkit::make_view(out.data(), DType::kF32, {B, Sq, H, Dv});
    l = attnkit::make_view(lse.data(), DType::kF32, {B, H, Sq});
  }
  Status call() const { return attnkit::merge_attention_states(oa, la, ob, lb, o, l); }
};

void expect_merge_rejected(const MergeCall& c, const std::vector<std::string>& needles) {
  std::vector<std::string> all{"merge_attention_states: "};
  all.insert(all.end(), needles.begin(), needles.end());
  expect_rejected(c.call(), all, {&c.out, &c.lse});
}

TEST(MergeStatesApi, ValidCallWrites) {
  MergeCall c;
  ASSERT_TRUE(c.call().ok());
  EXPECT_FALSE(all_sentinel(c.out));
  EXPECT_FALSE(all_sentinel(c.lse));
}

TEST(MergeStatesApi, BadViews) {
  struct Edit {
    std::function<void(MergeCall&)> apply;
    std::vector<std::string> needles;
  };
  const std::vector<Edit> edits = {
      {[](MergeCall& c) { c.oa.data = nullptr; }, {"out_a is missing"}},
      {[](MergeCall& c) { c.la.data = nullptr; }, {"lse_a is missing"}},
      {[](MergeCall& c) { c.ob.data = nullptr; }, {"out_b is missing"}},
      {[](MergeCall& c) { c.lb.data = nullptr; }, {"lse_b is missing"}},
      {[](MergeCall& c) { c.o.data = nullptr; }, {"out is missing"}},
      {[](MergeCall& c) { c.l.data = nullptr; }, {"lse is missing"}},
      {[](MergeCall& c) { c.oa.rank = 3; }, {"out_a has rank 3"}},
      {[](MergeCall& c) { c.lb.rank = 4; }, {"lse_b has rank 4"}},
      {[](MergeCall& c) { c.ob.dtype = DType::kBF16; }, {"out_b.dtype = bf16", "must be f32"}},
      {[](MergeCall& c) { c.l.dtype = DType::kF64; }, {"lse.dtype = f64"}},
      {[](MergeCall& c) { c.ob.shape[0] = 1; }, {"out_b.shape[0] (batch) = 1", "out_a.shape[0]"}},
      {[](MergeCall& c) { c.o.shape[3] = 4; },
       {"out.shape[3] (head_dim_v) = 4", "out_a.shape[3] = 5"}},
      {[](MergeCall& c) { c.ob.shape[1] = 2; }, {"out_b.shape[1] (seqlen_q) = 2"}},
      {[](MergeCall& c) { c.o.shape[2] = 2; }, {"out.shape[2] (num_heads) = 2"}},
      {[](MergeCall& c) { c.la.shape[2] = 4; }, {"lse_a.shape[2] (seqlen_q) = 4"}},
      {[](MergeCall& c) {  // [batch, seq, heads] instead of [batch, heads, seq]
         c.lb = attnkit::make_view(c.lse_b.data(), DType::kF32, {2, 3, 4});
       },
       {"lse_b.shape[1] (num_heads) = 3", "out_a.shape[2] = 4"}},
      {[](MergeCall& c) { c.l.shape[0] = 1; }, {"lse.shape[0] (batch) = 1"}},
      {[](MergeCall& c) { c.oa.strides[1] = -20; }, {"out_a.strides[1] = -20"}},
      {[](MergeCall& c) { c.l.shape[2] = -3; }, {"lse.shape[2] = -3"}},
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(i);
    MergeCall c;
    edits[i].apply(c);
    expect_merge_rejected(c, edits[i].needles);
  }
}

TEST(MergeStatesApi, Overlaps) {
  MergeCall c;  // out over out_b
  c.o = attnkit::make_view(c.out_b.data(), DType::kF32, {2, 3, 4, 5});
  expect_rejected(c.call(), {"out overlaps input out_b"}, {&c.out, &c.lse});
  MergeCall d;  // out shifted inside out_a: not the allowed exact alias
  d.out_a.resize(d.out_a.size() + 8);
  d.oa.data = d.out_a.data();
  d.o = attnkit::make_view(d.out_a.data() + 3, DType::kF32, {2, 3, 4, 5});
  expect_merge_rejected(d, {"out overlaps input out_a"});
  MergeCall e;  // lse over lse_b
  e.l = e.lb;
  expect_merge_rejected(e, {"lse overlaps input lse_b"});
  MergeCall f;  // lse inside out
  f.l = attnkit::make_view(f.out.data() + 4, DType::kF32, {2, 4, 3});
  expect_merge_rejected(f, {"outputs out and lse overlap"});
  MergeCall g;  // out over lse_a
  g.lse_a.resize(200);
  g.la.data = g.lse_a.data();
  g.o = attnkit::make_view(g.lse_a.data(), DType::kF32, {2, 3, 4, 5});
  expect_merge_rejected(g, {"out overlaps input lse_a"});
  MergeCall h;
  h.o.strides[2] = 0;
  expect_merge_rejected(h, {"out.strides[2] = 0", "overlap itself"});
  MergeCall ok;  // the documented aliases
  ok.o = ok.oa;
  ok.l = ok.la;
  EXPECT_TRUE(ok.call().ok());
}

}  // namespace

namespace {

// 8-bit K/V through sdpa(): the scales are required exactly when K is
// 8-bit, [batch, seqlen_k, num_kv_heads, 1] f32; the caches and
// sdpa_varlen take none (they keep their own, or none).
TEST(SdpaApi, EightBitKvNeedTheirScales) {
  SdpaCall ok;
  ok.use_int8_kv();
  ASSERT_TRUE(ok.call().ok());
  SdpaCall a;
  a.use_int8_kv();
  a.opt.v_scales = {};
  expect_sdpa_rejected(a, {"options.v_scales is absent", "k.dtype = int8"});
  SdpaCall given;
  given.opt.k_scales = attnkit::make_view(given.k.data(), DType::kF32, {2, 5, 2, 1});
  expect_sdpa_rejected(given, {"options.k_scales is given, but k.dtype = f32 has no scales"});
  SdpaCall c;
  c.use_int8_kv();
  c.opt.k_scales.shape[3] = 2;
  expect_sdpa_rejected(c, {"options.k_scales.shape[3] = 2 must be 1 (one scale per row) = 1"});
  SdpaCall d;
  d.use_int8_kv();
  d.opt.v_scales.dtype = DType::kBF16;
  expect_sdpa_rejected(d, {"options.v_scales.dtype = bf16 must be f32"});
  SdpaCall e;
  e.use_int8_kv();
  e.vv.dtype = DType::kFp8E4M3;  // v must follow k's dtype
  expect_sdpa_rejected(e, {"v.dtype = fp8_e4m3", "must be int8"});
  // The reference over int8 K/V equals the oracle over their dequantized values.
  SdpaCall f;
  f.use_int8_kv();
  ASSERT_TRUE(attnkit::sdpa(f.qv, f.kv, f.vv, f.ov, f.opt).ok());
  const int64_t B = SdpaCall::B, Sq = SdpaCall::Sq, Sk = SdpaCall::Sk, H = SdpaCall::H,
                Hkv = SdpaCall::Hkv, D = SdpaCall::D, Dv = SdpaCall::Dv;
  std::vector<double> kd, vd;
  for (int64_t r = 0; r < B * Sk * Hkv; ++r) {
    const std::vector<double> kr = attnkit_test::kv_dequantized(f.k.data() + r * D, D, DType::kI8);
    const std::vector<double> vr =
        attnkit_test::kv_dequantized(f.v.data() + r * Dv, Dv, DType::kI8);
    kd.insert(kd.end(), kr.begin(), kr.end());
    vd.insert(vd.end(), vr.begin(), vr.end());
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        double s[SdpaCall::Sk], mx = -1e300, sum = 0;
        const int64_t g = h / (H / Hkv);
        for (int64_t j = 0; j < Sk; ++j) {
          s[j] = 0;
          for (int64_t x = 0; x < D; ++x)
            s[j] +=
                double(f.q[((b * Sq + i) * H + h) * D + x]) * kd[((b * Sk + j) * Hkv + g) * D + x];
          s[j] /= std::sqrt(double(D));
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j < Sk; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int64_t x = 0; x < Dv; ++x) {
          double o = 0;
          for (int64_t j = 0; j < Sk; ++j) o += s[j] * vd[((b * Sk + j) * Hkv + g) * Dv + x];
          EXPECT_NEAR(f.out[((b * Sq + i) * H + h) * Dv + x], o / sum, 1e-6);
        }
      }
  // Anywhere else the scales have no place.
  std::vector<float> out(size_t(B * Sq * H * Dv), kSentinel);
  const int32_t cu_q[3] = {0, 3, 6}, cu_k[3] = {0, 5, 10};
  const Status varlen = attnkit::sdpa_varlen(
      attnkit::make_view(ok.q.data(), DType::kF32, {B * Sq, H, D}),
      attnkit::make_view(ok.k.data(), DType::kF32, {B * Sk, Hkv, D}),
      attnkit::make_view(ok.v.data(), DType::kF32, {B * Sk, Hkv, Dv}), cu_q, cu_k,
      attnkit::make_view(out.data(), DType::kF32, {B * Sq, H, Dv}), ok.opt);
  expect_rejected(varlen, {"sdpa_varlen: options.k_scales must be absent"}, {&out});
}

TEST(SdpaApi, QuantizeKvRowsFollowsTheCachesRuleAndChecksItsViews) {
  attnkit_test::Rng rng(3);
  std::vector<float> x = attnkit_test::uniform_vector(6 * 10, rng);
  std::vector<uint8_t> codes(60, 0xee);
  std::vector<float> scales(6, kSentinel);
  const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {2, 3, 10});
  const TensorView cv = attnkit::make_view(codes.data(), DType::kFp8E4M3, {2, 3, 10});
  const TensorView sv = attnkit::make_view(scales.data(), DType::kF32, {2, 3, 1});
  ASSERT_TRUE(attnkit::quantize_kv_rows(xv, cv, sv).ok());
  for (int r = 0; r < 6; ++r) {
    const std::vector<double> want =
        attnkit_test::kv_dequantized(x.data() + 10 * r, 10, DType::kFp8E4M3);
    for (int c = 0; c < 10; ++c)
      EXPECT_EQ(double(attnkit::fp8_e4m3_to_float(codes[size_t(10 * r + c)])) * scales[size_t(r)],
                want[size_t(c)]);
  }
  std::vector<float> s2(12, kSentinel);
  const Status bad =
      attnkit::quantize_kv_rows(xv, cv, attnkit::make_view(s2.data(), DType::kF32, {2, 3, 2}));
  expect_rejected(bad, {"quantize_kv_rows: scales.shape[2] = 2 must be 1 (one scale per row)"},
                  {&s2});
  const Status f32 =
      attnkit::quantize_kv_rows(xv, attnkit::make_view(x.data(), DType::kF32, {2, 3, 10}), sv);
  EXPECT_NE(f32.message().find("codes.dtype = f32 must be int8 or fp8_e4m3"), std::string::npos)
      << f32.to_string();
}

}  // namespace
