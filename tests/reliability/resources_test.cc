// Sizes that cannot be honoured, through public entry points: element or
// byte counts that overflow 64 bits, and allocations no machine can satisfy.
// Every one must come back as kResourceExhausted (or kInvalidArgument for a
// rule a size breaks) naming the function, never a crash, and leave the
// caller's outputs and objects as they were.
//
// "Unallocatable" sizes are >= 2^57 bytes: above the 57-bit virtual
// address space of x86-64 with 5-level paging, so the allocation fails
// whatever the overcommit policy (a smaller request could succeed lazily
// and only die when zeroed). Huge sequence lengths come from broadcast
// views (stride 0), which are valid inputs that address one row.
//
// Sanitizers: AddressSanitizer and ThreadSanitizer abort on a failed
// malloc unless allocator_may_return_null=1, which the definitions below
// make the default for this test binary (an ASAN_OPTIONS/TSAN_OPTIONS in
// the environment still overrides them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/kv_cache.h"
#include "attnkit/latent_attention.h"
#include "attnkit/moe.h"
#include "attnkit/tensor.h"

extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }

namespace {

using attnkit::AttentionConfig;
using attnkit::AttentionLayer;
using attnkit::DType;
using attnkit::KVCache;
using attnkit::KVCacheSpec;
using attnkit::Status;
using attnkit::StatusCode;
using attnkit::Tensor;
using attnkit::TensorView;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Under ASan and TSan a failed throwing operator new aborts the process
// instead of throwing std::bad_alloc (allocator_may_return_null covers
// malloc only), so cases that reach one are skipped there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kNewAbortsOnFailure = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kNewAbortsOnFailure = true;
#else
constexpr bool kNewAbortsOnFailure = false;
#endif
#else
constexpr bool kNewAbortsOnFailure = false;
#endif
constexpr float kSentinel = 5.5f;

::testing::AssertionResult fails_with(const Status& st, StatusCode code,
                                      const std::string& needle) {
  if (st.ok()) return ::testing::AssertionFailure() << "succeeded; expected " << needle;
  if (st.code() != code) return ::testing::AssertionFailure() << "wrong code: " << st.to_string();
  if (st.message().find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "message lacks \"" << needle << "\": " << st.message();
  return ::testing::AssertionSuccess() << st.to_string();
}

// A broadcast view: `shape`, every stride 0, over one element.
TensorView broadcast(const float* one, std::initializer_list<int64_t> shape) {
  TensorView v = attnkit::make_view(one, DType::kF32, shape);
  v.strides = {0, 0, 0, 0};
  return v;
}

TEST(ReliabilityResources, TensorZerosOverflowAndAllocationFailure) {
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kF32, {int64_t{1} << 32, int64_t{1} << 32}).status(),
                         StatusCode::kResourceExhausted, "element count overflows"));
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kF64, {int64_t{1} << 61}).status(),
                         StatusCode::kResourceExhausted, "byte count overflows"));
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kF32, {kMax / 4 - 1}).status(),
                         StatusCode::kResourceExhausted, "byte count overflows"));  // + 63 padding
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kF32, {int64_t{1} << 55}).status(),
                         StatusCode::kResourceExhausted, "allocation of"));
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kBF16, {2, -3}).status(),
                         StatusCode::kInvalidArgument, "shape[1] = -3"));
  const int64_t five[5] = {1, 1, 1, 1, 1};
  EXPECT_TRUE(fails_with(Tensor::zeros(DType::kF32, five, 5).status(), StatusCode::kInvalidArgument,
                         "rank = 5"));
  // Empty tensors are fine and still have storage.
  auto empty = Tensor::zeros(DType::kF32, {3, 0, 2});
  ASSERT_TRUE(empty.ok());
  EXPECT_NE(empty->data(), nullptr);
  EXPECT_EQ(empty->numel(), 0);
}

TEST(ReliabilityResources, KVCacheSpecsBeyondMemory) {
  KVCacheSpec s;
  s.batch_size = int64_t{1} << 20;
  s.max_seq_len = int64_t{1} << 30;
  s.num_kv_heads = int64_t{1} << 10;
  s.head_dim = int64_t{1} << 10;  // 2^70 elements
  EXPECT_TRUE(fails_with(KVCache::create(s).status(), StatusCode::kResourceExhausted,
                         "KVCache::create: keys"));
  s = {};
  s.batch_size = 1;
  s.max_seq_len = int64_t{1} << 40;
  s.num_kv_heads = 8;
  s.head_dim = int64_t{1} << 16;  // 2^59 elements, 2^60 bytes of keys: fits, cannot exist
  s.dtype = DType::kBF16;
  EXPECT_TRUE(fails_with(KVCache::create(s).status(), StatusCode::kResourceExhausted,
                         "KVCache::create: keys"));
  // num_kv_heads * head_dim itself overflows (the padded row stride
  // must not wrap to a small allocation).
  s = {};
  s.batch_size = 1;
  s.max_seq_len = 1;
  s.num_kv_heads = int64_t{1} << 32;
  s.head_dim = int64_t{1} << 32;
  EXPECT_TRUE(fails_with(KVCache::create(s).status(), StatusCode::kResourceExhausted,
                         "KVCache::create: keys"));
  // Keys fit, values overflow.
  s = {};
  s.batch_size = 1;
  s.max_seq_len = 4;
  s.num_kv_heads = 1;
  s.head_dim = 8;
  s.head_dim_v = kMax / 2;
  EXPECT_TRUE(fails_with(KVCache::create(s).status(), StatusCode::kResourceExhausted,
                         "KVCache::create: values"));
  // A window larger than anything sizes the ring by max_seq_len.
  s.head_dim_v = 0;
  s.sliding_window = kMax;
  auto ok = KVCache::create(s);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->slots(), 4);
}

AttentionConfig small_config() {
  AttentionConfig c;
  c.hidden_size = 16;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.use_rope = false;
  return c;
}

TEST(ReliabilityResources, LayerCachesBeyondMemory) {
  auto layer = AttentionLayer::create(small_config());
  ASSERT_TRUE(layer.ok());
  EXPECT_TRUE(fails_with(layer->new_cache(int64_t{1} << 40, int64_t{1} << 40).status(),
                         StatusCode::kResourceExhausted, "AttentionLayer::new_cache"));
  EXPECT_TRUE(fails_with(layer->new_cache(1, int64_t{1} << 56).status(),
                         StatusCode::kResourceExhausted, "AttentionLayer::new_cache"));

  attnkit::MlaConfig m;
  m.hidden_size = 16;
  m.num_attention_heads = 2;
  m.kv_lora_rank = 8;
  m.qk_nope_head_dim = 4;
  m.qk_rope_head_dim = 4;
  m.v_head_dim = 4;
  auto mla = attnkit::LatentAttention::create(m);
  ASSERT_TRUE(mla.ok()) << mla.status().to_string();
  EXPECT_TRUE(fails_with(mla->new_cache(int64_t{1} << 40, int64_t{1} << 40).status(),
                         StatusCode::kResourceExhausted, "LatentAttention::new_cache"));
  EXPECT_TRUE(fails_with(mla->new_cache(2, int64_t{1} << 55).status(),
                         StatusCode::kResourceExhausted, "LatentAttention::new_cache"));
}

// A config whose sizes each pass validate() (<= 2^20) but whose weights
// cannot exist: q_proj is [2^40, 2^20]. Broadcast views stand in for the
// weights; loading fails on the allocation and leaves the layer unloaded.
TEST(ReliabilityResources, LayerWeightsBeyondMemory) {
  AttentionConfig c = small_config();
  c.hidden_size = int64_t{1} << 20;
  c.num_heads = c.num_kv_heads = int64_t{1} << 20;
  c.head_dim = int64_t{1} << 20;
  auto layer = AttentionLayer::create(c);
  ASSERT_TRUE(layer.ok()) << layer.status().to_string();
  const float one = 1.0f;
  const int64_t q_out = c.num_heads * c.head_dim, d = c.hidden_size;
  TensorView w2 = broadcast(&one, {q_out, d});
  w2.rank = 2;
  TensorView o2 = broadcast(&one, {d, q_out});
  o2.rank = 2;
  const attnkit::WeightMap weights{
      {"q_proj.weight", w2}, {"k_proj.weight", w2}, {"v_proj.weight", w2}, {"o_proj.weight", o2}};
  EXPECT_TRUE(fails_with(layer->load_weights(weights), StatusCode::kResourceExhausted,
                         "AttentionLayer::load_weights: weight 'q_proj.weight': "));
  std::vector<float> x(16, 0.0f), out(16, kSentinel);
  EXPECT_TRUE(fails_with(layer->forward(attnkit::make_view(x.data(), DType::kF32, {1, 1, 16}),
                                        attnkit::make_view(out.data(), DType::kF32, {1, 1, 16})),
                         StatusCode::kInvalidArgument, "no weights loaded"));
}

// Loaded layers asked for 2^50 tokens through a broadcast x and an out view
// whose extent (2^56 bytes) is valid arithmetic but no memory: the
// activation scratch cannot be allocated, and since nothing is written
// before it is, out stays as it was. (A broadcast out, stride 0, is
// rejected as overlapping itself.)
TEST(ReliabilityResources, LayerForwardOverHugeBroadcastSequences) {
  const AttentionConfig c = small_config();
  auto layer = AttentionLayer::create(c);
  ASSERT_TRUE(layer.ok());
  std::vector<float> wq(32 * 16, 0.01f), wkv(16 * 16, 0.01f), wo(16 * 32, 0.01f);
  const attnkit::WeightMap weights{
      {"q_proj.weight", attnkit::make_view(wq.data(), DType::kF32, {32, 16})},
      {"k_proj.weight", attnkit::make_view(wkv.data(), DType::kF32, {16, 16})},
      {"v_proj.weight", attnkit::make_view(wkv.data(), DType::kF32, {16, 16})},
      {"o_proj.weight", attnkit::make_view(wo.data(), DType::kF32, {16, 32})}};
  ASSERT_TRUE(layer->load_weights(weights).ok());
  // x below out in one buffer, so that out's huge extent (upwards from
  // its first element) cannot cover x.
  std::vector<float> buffer(32, 0.5f);
  std::fill(buffer.begin() + 16, buffer.end(), kSentinel);
  const std::span<const float> out(buffer.data() + 16, 16);
  const int64_t T = int64_t{1} << 50;
  TensorView xv = attnkit::make_view(buffer.data(), DType::kF32, {1, T, 16});
  xv.strides = {0, 0, 1, 0};
  const TensorView ov = attnkit::make_view(buffer.data() + 16, DType::kF32, {1, T, 16});
  EXPECT_TRUE(fails_with(layer->forward(xv, ov), StatusCode::kResourceExhausted,
                         "AttentionLayer::forward"));
  TensorView broadcast_out = ov;
  broadcast_out.strides = {0, 0, 1, 0};
  EXPECT_TRUE(fails_with(layer->forward(xv, broadcast_out), StatusCode::kInvalidArgument,
                         "out.strides[1] = 0"));
  for (float v : out) EXPECT_EQ(v, kSentinel);

  // The same through the cache path: the cache's capacity is checked first.
  auto cache = layer->new_cache(1, 8);
  ASSERT_TRUE(cache.ok());
  EXPECT_TRUE(fails_with(layer->forward(xv, ov, {}, &*cache), StatusCode::kOutOfRange,
                         "exceeds max_seq_len"));
  EXPECT_EQ(cache->length(), 0);
  for (float v : out) EXPECT_EQ(v, kSentinel);
}

// The MoE block over 2^61 broadcast tokens: its routing arrays (tokens x
// top-k) cannot exist.
TEST(ReliabilityResources, MoeForwardOverHugeBroadcastSequences) {
  attnkit::MoeConfig c;
  c.naming = attnkit::MoeWeightNaming::kMixtral;
  c.hidden_size = 8;
  c.n_routed_experts = 2;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 4;
  auto moe = attnkit::MoeLayer::create(c);
  ASSERT_TRUE(moe.ok()) << moe.status().to_string();
  std::vector<float> gate(2 * 8, 0.1f), up(4 * 8, 0.1f), down(8 * 4, 0.1f);
  attnkit::WeightMap w{
      {"block_sparse_moe.gate.weight", attnkit::make_view(gate.data(), DType::kF32, {2, 8})}};
  for (int e = 0; e < 2; ++e) {
    const std::string p = "block_sparse_moe.experts." + std::to_string(e) + ".";
    w[p + "w1.weight"] = attnkit::make_view(up.data(), DType::kF32, {4, 8});
    w[p + "w3.weight"] = attnkit::make_view(up.data(), DType::kF32, {4, 8});
    w[p + "w2.weight"] = attnkit::make_view(down.data(), DType::kF32, {8, 4});
  }
  ASSERT_TRUE(moe->load_weights(w).ok());
  // x below out in one buffer, as above.
  std::vector<float> buffer(16, 0.5f);
  std::fill(buffer.begin() + 8, buffer.end(), kSentinel);
  const std::span<const float> out(buffer.data() + 8, 8);
  // 2^50 tokens, out a view of 2^55 bytes (valid arithmetic, no memory):
  // the routing arrays' operator new fails (bad_alloc) before any write.
  // 2^61 tokens only fit a broadcast out, which overlaps itself.
  for (int64_t T : {int64_t{1} << 50, int64_t{1} << 61}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const bool broadcast_out = T == int64_t{1} << 61;
    if (kNewAbortsOnFailure && !broadcast_out) continue;
    TensorView xv = attnkit::make_view(buffer.data(), DType::kF32, {1, T, 8});
    xv.strides = {0, 0, 1, 0};
    TensorView ov = attnkit::make_view(buffer.data() + 8, DType::kF32, {1, T, 8});
    if (broadcast_out) ov.strides = {0, 0, 1, 0};
    const Status st = moe->forward(xv, ov);
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(st.code(),
              broadcast_out ? StatusCode::kInvalidArgument : StatusCode::kResourceExhausted)
        << st.to_string();
    for (float v : out) EXPECT_EQ(v, kSentinel);
  }
}

// sdpa over 2^61 broadcast keys on the reference backend: its scratch
// (one double per key) overflows size_t and is reported, not thrown.
TEST(ReliabilityResources, SdpaScratchBeyondMemory) {
  // 2^61 keys of float64 scratch is 2^64 bytes, more than any address
  // space: refused before operator new[] is asked (which some sanitizers'
  // allocators answer by aborting).
  const std::vector<float> q(8, 0.5f), kv(8, 0.25f);
  std::vector<float> out(8, kSentinel);
  attnkit::AttentionOptions o;
  o.backend = attnkit::Backend::kReference;
  const Status st = attnkit::sdpa(attnkit::make_view(q.data(), DType::kF32, {1, 1, 1, 8}),
                                  broadcast(kv.data(), {1, int64_t{1} << 61, 1, 8}),
                                  broadcast(kv.data(), {1, int64_t{1} << 61, 1, 8}),
                                  attnkit::make_view(out.data(), DType::kF32, {1, 1, 1, 8}), o);
  EXPECT_TRUE(fails_with(st, StatusCode::kResourceExhausted, "sdpa"));
  for (float v : out) EXPECT_EQ(v, kSentinel);
}

// Sizes in views whose extents overflow 64-bit offsets are rejected by
// every entry point before anything is read.
TEST(ReliabilityResources, ViewExtentsOverflowing64Bits) {
  const std::vector<float> buf(64, 1.0f);
  std::vector<float> out(64, kSentinel);
  TensorView huge = attnkit::make_view(buf.data(), DType::kF32, {2, 2, 1, 8});
  huge.strides[1] = kMax / 2;
  const TensorView q = attnkit::make_view(buf.data(), DType::kF32, {2, 2, 1, 8});
  const TensorView o = attnkit::make_view(out.data(), DType::kF32, {2, 2, 1, 8});
  EXPECT_TRUE(
      fails_with(attnkit::sdpa(q, huge, huge, o), StatusCode::kInvalidArgument, "overflows"));
  auto cache = KVCache::create({2, 8, 1, 8});
  ASSERT_TRUE(cache.ok());
  EXPECT_TRUE(fails_with(cache->attend(q, huge, q, o), StatusCode::kInvalidArgument, "overflows"));
  EXPECT_EQ(cache->length(), 0);
  for (float v : out) EXPECT_EQ(v, kSentinel);
}

}  // namespace
