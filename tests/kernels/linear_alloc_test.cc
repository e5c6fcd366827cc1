// kernels::linear allocates nothing in steady state: the second of two
// identical fast calls (f32 and bf16 weights, decode's one row and a small
// batch's 16 rows, with and without bias, the matmul primitive and the
// GEMV) makes no call of the global operator new from attnkit's code.
//
// oneDNN 2.6 itself is the exception, counted apart by the caller's shared
// object: dnnl_primitive_execute copies its arguments into a new
// std::unordered_map on every call (about nargs + 2 allocations per
// block), whatever the caller hands it.
//
// This translation unit replaces the global operator new and delete for
// the whole test binary: they always allocate with malloc (posix_memalign
// for over-aligned types), and only count while g_counting is set, so
// other tests see no difference.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "attnkit/gated_deltanet.h"
#include "common/random.h"
#include "kernels/linear.h"

// Sanitizers bring their own operator new; replacing it would blind them.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define ATTNKIT_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ATTNKIT_SANITIZED 1
#endif

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_news{0};
// The return addresses of the first kMaxCallers counted calls.
constexpr long kMaxCallers = 1024;
std::atomic<void*> g_callers[kMaxCallers];

#ifndef ATTNKIT_SANITIZED
void* counted_alloc(size_t size, size_t align, void* caller) {
  if (g_counting.load(std::memory_order_relaxed)) {
    const long i = g_news.fetch_add(1, std::memory_order_relaxed);
    if (i < kMaxCallers) g_callers[i].store(caller, std::memory_order_relaxed);
  }
  if (size == 0) size = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t))
    p = std::malloc(size);
  else if (posix_memalign(&p, align, size) != 0)
    p = nullptr;
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
#endif

}  // namespace

#ifndef ATTNKIT_SANITIZED
void* operator new(size_t size) { return counted_alloc(size, 0, __builtin_return_address(0)); }
void* operator new(size_t size, std::align_val_t align) {
  return counted_alloc(size, static_cast<size_t>(align), __builtin_return_address(0));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
#endif

namespace attnkit::kernels {
namespace {

using attnkit_test::Rng;
using attnkit_test::uniform_vector;

// Whether the code at `address` belongs to oneDNN's shared library.
bool in_onednn(void* address) {
  Dl_info info{};
  return dladdr(address, &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libdnnl") != nullptr;
}

struct AllocCase {
  DType weight;
  int64_t rows;
  bool bias, gemv;
};

TEST(LinearAlloc, SecondIdenticalCallAllocatesNothing) {
#ifdef ATTNKIT_SANITIZED
  GTEST_SKIP() << "sanitizers own operator new";
#endif
  // 4096 x 1024: at one row just enough multiply-adds for the block grid
  // to split the columns, so several blocks (cached primitives) run.
  constexpr int64_t kOut = 4096, kIn = 1024;
  Rng rng(37);
  const std::vector<float> w = uniform_vector(kOut * kIn, rng);
  std::vector<bf16> wb(w.size());
  for (size_t i = 0; i < w.size(); ++i) wb[i] = float_to_bf16(w[i]);
  const std::vector<float> bias = uniform_vector(kOut, rng);
  long onednn_total = 0;
  for (const AllocCase c :
       {AllocCase{DType::kF32, 1, false, false}, AllocCase{DType::kF32, 1, true, true},
        AllocCase{DType::kF32, 16, true, false}, AllocCase{DType::kBF16, 1, false, false},
        AllocCase{DType::kBF16, 16, true, false}}) {
    SCOPED_TRACE(std::string(dtype_name(c.weight)) + " rows=" + std::to_string(c.rows) +
                 " bias=" + std::to_string(c.bias) + " gemv=" + std::to_string(c.gemv));
    const std::vector<float> x = uniform_vector(static_cast<size_t>(c.rows * kIn), rng);
    std::vector<float> first(static_cast<size_t>(c.rows * kOut)), second(first.size());
    const Weight weight =
        c.weight == DType::kBF16 ? Weight{wb.data(), DType::kBF16} : Weight{w.data()};
    LinearOptions opt;
    // One thread: every block runs on the calling thread, so the first
    // call has surely grown this thread's scratch for all of them (with
    // more, a pool thread may take its first block only in the second).
    opt.num_threads = 1;
    opt.backend = Backend::kFast;
    opt.gemv_for_one_row = c.gemv;
    const float* b = c.bias ? bias.data() : nullptr;
    linear(x.data(), kIn, weight, b, first.data(), kOut, c.rows, kOut, kIn, opt);
    g_news = 0;
    g_counting = true;
    linear(x.data(), kIn, weight, b, second.data(), kOut, c.rows, kOut, kIn, opt);
    g_counting = false;
    const long counted = std::min(g_news.load(), kMaxCallers);
    ASSERT_LT(g_news.load(), kMaxCallers);
    long ours = 0;
    for (long i = 0; i < counted; ++i) {
      if (in_onednn(g_callers[i].load()))
        ++onednn_total;
      else
        ++ours;
    }
    EXPECT_EQ(ours, 0);
    // The memory objects re-pointed, not rebuilt, read this call's buffers.
    EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  }
  std::printf("oneDNN's own allocations in the counted calls: %ld\n", onednn_total);
}

// GatedDeltaNet's prefill: its scratch is a block of rows, not the whole
// call, grown once per thread and reused, so a second call of 2 x 1000
// tokens (8 blocks) allocates no more than a warm call of 2 x 10 tokens
// (one block) does: only the argument checks' strings, nothing that
// depends on the length or that a warm call could have kept.
TEST(LinearAlloc, GatedDeltaNetPrefillAllocatesNothingTheSecondTime) {
#ifdef ATTNKIT_SANITIZED
  GTEST_SKIP() << "sanitizers own operator new";
#endif
  const GatedDeltaNetConfig c{.hidden_size = 64,
                              .num_k_heads = 2,
                              .num_v_heads = 4,
                              .key_head_dim = 32,
                              .value_head_dim = 32,
                              .conv_kernel = 4};
  const int64_t kd = c.num_k_heads * c.key_head_dim, vd = c.num_v_heads * c.value_head_dim;
  Rng rng(5);
  std::vector<std::vector<float>> store;
  WeightMap m;
  auto add = [&](const std::string& name, std::initializer_list<int64_t> shape, float lo,
                 float hi) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    store.push_back(uniform_vector(static_cast<size_t>(n), rng, lo, hi));
    m[name] = make_view(store.back().data(), DType::kF32, shape);
  };
  store.reserve(7);
  add("in_proj_qkvz.weight", {2 * kd + 2 * vd, c.hidden_size}, -0.2f, 0.2f);
  add("in_proj_ba.weight", {2 * c.num_v_heads, c.hidden_size}, -0.2f, 0.2f);
  add("conv1d.weight", {2 * kd + vd, 1, c.conv_kernel}, -0.5f, 0.5f);
  add("A_log", {c.num_v_heads}, -1.0f, 1.0f);
  add("dt_bias", {c.num_v_heads}, -1.0f, 1.0f);
  add("norm.weight", {c.value_head_dim}, 0.5f, 1.5f);
  add("out_proj.weight", {c.hidden_size, vd}, -0.2f, 0.2f);
  auto layer = GatedDeltaNet::create(c);
  ASSERT_TRUE(layer.ok());
  ASSERT_TRUE(layer->load_weights(m).ok());
  auto state = layer->new_state(2);
  ASSERT_TRUE(state.ok());
  // One thread, so that every worker's scratch is this thread's.
  const RunOptions run{Backend::kFast, 1};
  // Our allocations in the second of two calls of `seq` tokens.
  auto second_call = [&](int64_t seq) -> long {
    const std::vector<float> x = uniform_vector(static_cast<size_t>(2 * seq * c.hidden_size), rng);
    std::vector<float> out(x.size());
    const TensorView xv = make_view(x.data(), DType::kF32, {2, seq, c.hidden_size});
    const TensorView ov = make_view(out.data(), DType::kF32, {2, seq, c.hidden_size});
    EXPECT_TRUE(layer->forward(xv, ov, &*state, run).ok());
    g_news = 0;
    g_counting = true;
    const Status st = layer->forward(xv, ov, &*state, run);
    g_counting = false;
    EXPECT_TRUE(st.ok());
    EXPECT_LT(g_news.load(), kMaxCallers);
    long ours = 0;
    for (long i = 0; i < std::min(g_news.load(), kMaxCallers); ++i)
      ours += in_onednn(g_callers[i].load()) ? 0 : 1;
    return ours;
  };
  const long long_call = second_call(1000);
  const long short_call = second_call(10);
  EXPECT_EQ(long_call, short_call);
  // The argument checks of x and out build their messages' prefixes (three
  // strings each) before they know whether the view is good.
  EXPECT_LE(long_call, 6) << "more than the argument checks' strings";
}

}  // namespace
}  // namespace attnkit::kernels
