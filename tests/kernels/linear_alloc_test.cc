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

}  // namespace
}  // namespace attnkit::kernels
