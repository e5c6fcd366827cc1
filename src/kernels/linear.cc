// kernels::linear: oneDNN behind attnkit's thread pool, and the loop twin.
//
// The fast path cuts y into blocks (Grid) that pool threads take one at a
// time. Each block is one single-threaded call of oneDNN's matmul primitive
// (its brgemm kernels where the CPU has AVX-512), created once per block
// shape and cached.
//
// Why the matmul primitive and not dnnl_sgemm (docs/GEMM.md): it is
// 1.5-2x faster on 4-64 rows and equal on long prefills, and, where it
// runs brgemm on one thread, it computes every y[m, n] as one sequential
// chain of fused multiply-adds over k, whatever the number of rows or
// columns in the call. So a row's result depends on that row of x and on
// W only: not on the other rows, the blocks or the thread count. oneDNN 2.x
// has no brgemm for AVX2; there the primitive runs its jit sgemm, as
// dnnl_sgemm does, which picks other kernels by the row count (a GEMV on
// one row), and a row's last bits depend on the other rows of its call
// (linear_rows_independent says which holds). The blocks depend on the
// shape only, so either way the thread count does not change a bit. The
// GEMV streams W ~1.4x faster than the matmul kernels on one row, so
// callers that do not need row independence (attention, MLA) ask for it
// in decode (LinearOptions::gemv_for_one_row).
//
// oneDNN 2.6 runs brgemm only on dense operands (otherwise it silently
// picks its slower sgemm-based matmul), so strided x rows are packed
// first, and a block of several rows narrower than y's row stride is
// computed into dense per-thread scratch and copied into place. If oneDNN
// refuses a block (out of memory), dnnl_sgemm, then the loop computes it;
// each writes the whole block.
#include "kernels/linear.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "attnkit/machine.h"
#include "core/threads.h"
#include "kernels/dispatch.h"

// OpenMP's per-thread thread count, from the libgomp that Debian's oneDNN
// is built on (linked explicitly, see cmake/attnkit_onednn.cmake). Declared
// here rather than through <omp.h>, which only some compilers ship.
extern "C" {
void omp_set_num_threads(int num_threads);
int omp_get_max_threads(void);
}

namespace attnkit::kernels {
namespace {

// ---- the block grid ---------------------------------------------------------

// The blocks of one fast call; they depend on the shape only, so the
// result is the same bits for any thread count.
struct Grid {
  int64_t row_blocks, row_size, col_blocks, col_size;
};

// Block sizes (docs/GEMM.md). Long inputs (prefill) are cut into row
// blocks of at least kMinRows: full-width blocks write y in place, and each
// re-reads W once, which at kMinRows rows costs ~1/kMinRows of the
// arithmetic in memory traffic. Short inputs (decode, small batches) are
// cut into column blocks of at least kMinCols (the matmul kernels' W
// panels stay long and their widest microkernel full), each reading its
// own slice of W once. At most kMaxBlocks blocks: enough to balance two
// to eight threads on a shared machine. A problem below kMinSplitMacs
// multiply-adds is one block, where a pool wake-up costs more than the
// split saves.
constexpr int64_t kMinRows = 256;
constexpr int64_t kMinCols = 256;
constexpr int64_t kMaxBlocks = 8;
constexpr int64_t kColAlign = 64;  // the matmul kernels' N block (4 AVX-512 vectors)
constexpr double kMinSplitMacs = 1 << 22;

Grid make_grid(int64_t rows, int64_t cols, int64_t depth) {
  const double macs = static_cast<double>(rows) * static_cast<double>(cols) * depth;
  if (macs < kMinSplitMacs) return {1, rows, 1, cols};
  if (rows >= 2 * kMinRows) {
    const int64_t rb = std::min<int64_t>(rows / kMinRows, kMaxBlocks);
    const int64_t rs = (rows + rb - 1) / rb;
    return {(rows + rs - 1) / rs, rs, 1, cols};
  }
  const int64_t cb = std::clamp<int64_t>(cols / kMinCols, 1, kMaxBlocks);
  const int64_t cs = ((cols + cb - 1) / cb + kColAlign - 1) / kColAlign * kColAlign;
  return {1, rows, (cols + cs - 1) / cs, cs};
}

// ---- oneDNN -----------------------------------------------------------------

// Sets this thread's OpenMP thread count for one scope, so that oneDNN
// stays on the calling pool thread. The count is per thread: this disturbs
// neither other threads nor, once the scope ends, the caller's own OpenMP.
class OmpThreadsScope {
 public:
  explicit OmpThreadsScope(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreadsScope() { omp_set_num_threads(saved_); }
  OmpThreadsScope(const OmpThreadsScope&) = delete;
  OmpThreadsScope& operator=(const OmpThreadsScope&) = delete;

 private:
  int saved_;
};

// One block through dnnl_sgemm (row-major C = A B^T; one row runs its
// GEMV). oneDNN checks lda >= K and ldc >= N even for one row, so a single
// row's strides (never used) are widened. false if oneDNN refused.
bool block_sgemm(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                 int64_t ldy, int64_t rows, int64_t cols, int64_t depth) {
  if (rows == 1) {
    ldx = std::max(ldx, depth);
    ldy = std::max(ldy, cols);
  }
  float beta = 0.0f;  // beta 0: y is written, never read (it may hold NaN)
  if (bias != nullptr) {
    for (int64_t m = 0; m < rows; ++m) std::copy(bias, bias + cols, y + m * ldy);
    beta = 1.0f;
  }
  return dnnl_sgemm('N', 'T', rows, cols, depth, 1.0f, x, ldx, w, depth, beta, y, ldy) ==
         dnnl_success;
}

// A matmul primitive for one block shape. Scratchpad mode "user": with the
// library's own scratchpad (Debian builds oneDNN with one per thread) a
// primitive may run only on the thread that created it, and pool tasks
// move between threads; each thread passes its own scratchpad instead.
struct Matmul {
  dnnl::matmul prim;
  dnnl::memory::desc x, w, bias, y, scratch;
};

using MatmulKey = std::tuple<int64_t, int64_t, int64_t, bool>;  // rows, cols, depth, bias

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Dense operands only: x [rows, depth], w [cols, depth], y [rows, cols].
// Shared by all threads. A model has a few projection shapes, but input
// lengths vary (prefill, tokens per MoE expert), and each new block shape
// costs ~0.1 ms of JIT compilation, so the cache holds many and starts over
// when full (entries in use stay alive through their shared_ptr).
class MatmulCache {
 public:
  static constexpr size_t kMaxEntries = 1024;

  std::shared_ptr<const Matmul> get(int64_t rows, int64_t cols, int64_t depth, bool has_bias) {
    // Creation (~0.1 ms of JIT, once per shape) happens under the lock too:
    // oneDNN's own primitive cache synchronises in ways ThreadSanitizer
    // cannot see, so concurrent creations would be reported as races.
    std::lock_guard<std::mutex> lock(mu_);
    const MatmulKey key{rows, cols, depth, has_bias};
    auto it = entries_.find(key);
    if (it != entries_.end()) return it->second;
    auto m = create(rows, cols, depth, has_bias);
    if (m == nullptr) return nullptr;
    if (entries_.size() >= kMaxEntries) entries_.clear();
    return entries_.emplace(key, std::move(m)).first->second;
  }

 private:
  static std::shared_ptr<const Matmul> create(int64_t rows, int64_t cols, int64_t depth,
                                              bool has_bias) {
    using dnnl::memory;
    try {
      auto m = std::make_shared<Matmul>();
      m->x = memory::desc({rows, depth}, memory::data_type::f32, memory::dims{depth, 1});
      m->w = memory::desc({depth, cols}, memory::data_type::f32, memory::dims{1, depth});
      m->y = memory::desc({rows, cols}, memory::data_type::f32, memory::dims{cols, 1});
      if (has_bias)
        m->bias = memory::desc({1, cols}, memory::data_type::f32, memory::dims{cols, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m->x, m->w, m->bias, m->y), attr,
                                            cpu_engine());
      m->scratch = pd.scratchpad_desc();
      m->prim = dnnl::matmul(pd);
      return m;
    } catch (const dnnl::error&) {
      return nullptr;
    }
  }

  std::mutex mu_;
  std::map<MatmulKey, std::shared_ptr<const Matmul>> entries_;
};

MatmulCache& matmul_cache() {
  static MatmulCache cache;
  return cache;
}

// Per-thread buffers that grow to the largest call the thread has made:
// oneDNN's scratchpad, packed x rows, and a dense y block.
struct ThreadScratch {
  std::vector<char> onednn;
  std::vector<float> x, y;
};
ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

// One block through the cached matmul primitive: x dense [rows, depth],
// y [rows, cols] with row stride ldy. false if oneDNN refused.
bool block_matmul(const float* x, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t rows, int64_t cols, int64_t depth) {
  try {
    const auto m = matmul_cache().get(rows, cols, depth, bias != nullptr);
    if (m == nullptr) return false;
    ThreadScratch& s = thread_scratch();
    const size_t bytes = m->scratch.get_size();
    if (s.onednn.size() < bytes) s.onednn.resize(bytes);
    const bool in_place = rows == 1 || ldy == cols;
    if (!in_place && s.y.size() < static_cast<size_t>(rows * cols))
      s.y.resize(static_cast<size_t>(rows * cols));
    float* out = in_place ? y : s.y.data();
    thread_local dnnl::stream stream(cpu_engine());
    const dnnl::engine& e = cpu_engine();
    using dnnl::memory;
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(m->x, e, const_cast<float*>(x))},
        {DNNL_ARG_WEIGHTS, memory(m->w, e, const_cast<float*>(w))},
        {DNNL_ARG_DST, memory(m->y, e, out)},
        {DNNL_ARG_SCRATCHPAD, memory(m->scratch, e, s.onednn.data())}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(m->bias, e, const_cast<float*>(bias)));
    m->prim.execute(stream, args);
    stream.wait();
    if (!in_place)
      for (int64_t r = 0; r < rows; ++r)
        std::copy(out + r * cols, out + (r + 1) * cols, y + r * ldy);
    return true;
  } catch (const dnnl::error&) {
    return false;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

// One block, on the calling thread. `xd` is x's rows dense (row stride
// depth), or null if they could not be packed.
void block_fast(const float* x, int64_t ldx, const float* xd, const float* w, const float* bias,
                float* y, int64_t ldy, int64_t rows, int64_t cols, int64_t depth, bool gemv) {
  OmpThreadsScope single(1);
  if (!gemv && xd != nullptr && block_matmul(xd, w, bias, y, ldy, rows, cols, depth)) return;
  if (block_sgemm(x, ldx, w, bias, y, ldy, rows, cols, depth)) return;
  linear_ref(x, ldx, w, bias, y, ldy, rows, cols, depth);
}

void linear_fast(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                 int64_t ldy, int64_t rows, int64_t cols, int64_t depth, const LinearOptions& opt) {
  // Overlapping input rows (ldx < in_features) are legal here but not in
  // BLAS; no layer makes them, and the loop serves them.
  if (depth == 0 || (rows > 1 && ldx < depth)) {
    linear_ref(x, ldx, w, bias, y, ldy, rows, cols, depth);
    return;
  }
  // Dense x for the matmul primitive: as given, or packed here on the
  // calling thread (rows * depth copies against rows * cols * depth MACs).
  const float* xd = x;
  if (rows > 1 && ldx != depth) {
    std::vector<float>& packed = thread_scratch().x;
    try {
      if (packed.size() < static_cast<size_t>(rows * depth))
        packed.resize(static_cast<size_t>(rows * depth));
      for (int64_t r = 0; r < rows; ++r)
        std::copy(x + r * ldx, x + r * ldx + depth, packed.data() + r * depth);
      xd = packed.data();
    } catch (const std::bad_alloc&) {
      xd = nullptr;  // dnnl_sgemm reads strided rows itself
    }
  }
  const Grid g = make_grid(rows, cols, depth);
  const bool gemv = rows == 1 && opt.gemv_for_one_row;
  parallel_for(
      g.row_blocks * g.col_blocks, resolve_num_threads(opt.num_threads), [&](int64_t task, int) {
        const int64_t r0 = task / g.col_blocks * g.row_size;
        const int64_t c0 = task % g.col_blocks * g.col_size;
        block_fast(x + r0 * ldx, ldx, xd ? xd + r0 * depth : nullptr, w + c0 * depth,
                   bias ? bias + c0 : nullptr, y + r0 * ldy + c0, ldy,
                   std::min(g.row_size, rows - r0), std::min(g.col_size, cols - c0), depth, gemv);
      });
}

const char* isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx512_mic:
      return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "unknown ISA";
  }
}

}  // namespace

void linear(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features, const LinearOptions& options) {
  if (rows <= 0 || out_features <= 0) return;
  if (resolve_backend(options.backend) == Backend::kReference)
    linear_ref(x, ldx, w, bias, y, ldy, rows, out_features, in_features);
  else
    linear_fast(x, ldx, w, bias, y, ldy, rows, out_features, in_features, options);
}

void linear_ref(const float* x, int64_t ldx, const float* w, const float* bias, float* y,
                int64_t ldy, int64_t rows, int64_t out_features, int64_t in_features) {
  constexpr int kLanes = 8;  // independent partial sums: lets the compiler vectorise
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    for (int64_t n = 0; n < out_features; ++n) {
      const float* wr = w + n * in_features;
      float acc[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= in_features; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += xr[k + l] * wr[k + l];
      float tail = 0.0f;
      for (; k < in_features; ++k) tail += xr[k] * wr[k];
      float sum = tail;
      for (int l = 0; l < kLanes; ++l) sum += acc[l];
      yr[n] = bias ? sum + bias[n] : sum;
    }
  }
}

void linear_nn(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
               int64_t rows, int64_t out_features, int64_t in_features, Backend backend) {
  if (rows <= 0 || out_features <= 0) return;
  if (resolve_backend(backend) != Backend::kReference && in_features > 0) {
    OmpThreadsScope single(1);
    // oneDNN checks lda >= K and ldc >= N even for one row (see block_sgemm).
    const int64_t lda = rows == 1 ? std::max(ldx, in_features) : ldx;
    const int64_t ldc = rows == 1 ? std::max(ldy, out_features) : ldy;
    if (ldx >= in_features || rows == 1)
      if (dnnl_sgemm('N', 'N', rows, out_features, in_features, 1.0f, x, lda, w, ldw, 0.0f, y,
                     ldc) == dnnl_success)
        return;
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* yr = y + m * ldy;
    std::fill(yr, yr + out_features, 0.0f);
    for (int64_t k = 0; k < in_features; ++k) {
      const float a = x[m * ldx + k];
      const float* wr = w + k * ldw;
      for (int64_t n = 0; n < out_features; ++n) yr[n] += a * wr[n];
    }
  }
}

// The implementation oneDNN picks for the matmul primitive here, e.g.
// "brg:avx512_core" or "gemm:jit"; "" if it refuses.
const std::string& matmul_impl() {
  static const std::string impl = [] {
    using dnnl::memory;
    constexpr int64_t kRows = 16, kCols = 256, kDepth = 256;  // a small dense block
    try {
      const memory::desc x({kRows, kDepth}, memory::data_type::f32, memory::dims{kDepth, 1});
      const memory::desc w({kDepth, kCols}, memory::data_type::f32, memory::dims{1, kDepth});
      const memory::desc y({kRows, kCols}, memory::data_type::f32, memory::dims{kCols, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x, w, y), cpu_engine());
      return std::string(pd.impl_info_str());
    } catch (const dnnl::error&) {
      return std::string();
    }
  }();
  return impl;
}

bool linear_rows_independent(Backend backend) {
  return resolve_backend(backend) == Backend::kReference || matmul_impl().rfind("brg", 0) == 0;
}

const char* linear_backend_name() {
  static const std::string name = [] {
    const dnnl_version_t* v = dnnl_version();
    char buf[160];
    std::snprintf(buf, sizeof buf, "oneDNN %d.%d.%d matmul %s (%s)", v->major, v->minor, v->patch,
                  matmul_impl().c_str(), isa_name(dnnl_get_effective_cpu_isa()));
    return std::string(buf);
  }();
  return name.c_str();
}

void rms_norm(const float* x, int64_t ldx, const float* gain, float* y, int64_t ldy, int64_t rows,
              int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    double ss = 0.0;
    for (int64_t d = 0; d < dim; ++d) ss += static_cast<double>(xr[d]) * xr[d];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) yr[d] = static_cast<float>(xr[d] * inv * gain[d]);
  }
}

}  // namespace attnkit::kernels

namespace attnkit {

const char* gemm_backend_name() { return kernels::linear_backend_name(); }

}  // namespace attnkit
