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
//
// bf16 weights of up to bf16_stream_max_rows() rows (decode) run the
// stream GEMM (kernels/linear_bf16.h), which reads W once and widens it in
// registers; longer calls take the same grid as f32. x is rounded to bf16
// once, on the calling thread (the contract: bf16 x times bf16 W, fp32
// sums), then each block runs oneDNN's bf16 matmul primitive, or, where
// oneDNN has no bf16 arithmetic in hardware (AVX2; AVX-512 without
// AVX512_BF16: bf16_matmul_native), widens its block of W into per-thread
// f32 scratch and runs the f32 path on the rounded x.
#include "kernels/linear.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <type_traits>

#include "attnkit/machine.h"
#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/dispatch.h"
#include "kernels/linear_bf16.h"
#include "kernels/scratch.h"

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

// ---- which GEMM runs bf16 weights ---------------------------------------

// The most rows for which bf16 weights run the stream GEMM
// (kernels/linear_bf16.h) instead of oneDNN, by what oneDNN 2.6 has for
// bf16 on this CPU (bf16_stream_max_rows). Each is the largest row count
// at which the stream GEMM was at least as fast as oneDNN, measured as
// GFLOP per thread-CPU second of one thread on a 1024 x 4096 bf16 W
// (`linear_bf16_bench --kernel`: the machine was shared, so CPU time, not
// wall time), on the Intel Xeon (family 6, model 167, AVX-512 + AMX) with
// oneDNN capped by DNNL_MAX_CPU_ISA to stand in for the other CPUs,
// 2026-11-27. Fewer rows are memory-bound, where reading half the bytes
// of f32 wins by more.
//   no bf16 kernel (AVX2: AMD Zen 3, older Intel): oneDNN's f32 GEMM on W
//     widened per call; 4x3 assembly tiles (ATTNKIT_SIMD=avx2): 16 rows
//     78.3 against 42.1, 48 rows 72.7 against 57.4, 88 rows 67.7 against
//     66.0, 96 rows 65.5 against 69.8
constexpr int64_t kStreamMaxRowsWidened = 88;
//   AVX-512 without AVX512_BF16 (Skylake-SP, Cascade Lake, Ice Lake):
//     oneDNN's bf16 there emulates the products (34 GFLOP/s at 256-1024
//     rows, against 145-158 for its f32 GEMM), so these CPUs widen W for
//     oneDNN's f32 GEMM as AVX2 ones do (bf16_matmul_native); stream
//     (ATTNKIT_SIMD=avx512, 6x4 tiles) against that: 16 rows 106.1
//     against 42.2, 64 rows 105.7 against 85.1, 96 rows 95.1 against 93.4,
//     128 rows 82.2 against 103.7
constexpr int64_t kStreamMaxRowsWidened512 = 96;
constexpr int64_t kStreamMaxRowsBf16Dot = 32;
//   AMX tiles (Sapphire Rapids and later), the vdpbf16ps stream kernel
//     (where this process may not use AMX itself): 4 rows 88.8 against
//     57.9, 8 rows 82.7 against 104.7, 32 rows 93.2 against 298.4
constexpr int64_t kStreamMaxRowsAmx = 4;
//   AMX tiles, attnkit's tile kernel (linear_bf16_amx.cc, W read in
//     place, where oneDNN reorders it on every call), 2026-11-28: 32 rows
//     630 against 347, 128 rows 837 against 465, 256 rows 512 against 479,
//     320 rows 412 against 465
constexpr int64_t kStreamMaxRowsAmxTiles = 256;

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

// rows, cols, depth, bias, bf16 x and W, W's layout (0: [cols, depth]
// contiguous, nn.Linear's; else [depth, cols] with this row stride)
using MatmulKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t>;

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// x [rows, depth] and y [rows, cols] dense; w [cols, depth] dense, or
// [depth, cols] with row stride ldw_nn (linear_nn's layout); x and w f32,
// or both bf16; y f32. Shared by all threads. A model has a few
// projection shapes, but input lengths vary (prefill, tokens per MoE
// expert), and each new block shape costs ~0.1 ms of JIT compilation (up
// to ~10 ms for bf16 AMX kernels), so the cache holds many and starts over
// when full (entries in use stay alive through their shared_ptr).
class MatmulCache {
 public:
  static constexpr size_t kMaxEntries = 1024;

  std::shared_ptr<const Matmul> get(int64_t rows, int64_t cols, int64_t depth, bool has_bias,
                                    bool bf16, int64_t ldw_nn) {
    // Creation (~0.1 ms of JIT, once per shape) happens under the lock too:
    // oneDNN's own primitive cache synchronises in ways ThreadSanitizer
    // cannot see, so concurrent creations would be reported as races.
    std::lock_guard<std::mutex> lock(mu_);
    const MatmulKey key{rows, cols, depth, has_bias, bf16, ldw_nn};
    auto it = entries_.find(key);
    if (it != entries_.end()) return it->second;
    auto m = create(rows, cols, depth, has_bias, bf16, ldw_nn);
    if (m == nullptr) return nullptr;
    if (entries_.size() >= kMaxEntries) entries_.clear();
    return entries_.emplace(key, std::move(m)).first->second;
  }

 private:
  static std::shared_ptr<const Matmul> create(int64_t rows, int64_t cols, int64_t depth,
                                              bool has_bias, bool bf16, int64_t ldw_nn) {
    using dnnl::memory;
    const memory::data_type in = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
    try {
      auto m = std::make_shared<Matmul>();
      m->x = memory::desc({rows, depth}, in, memory::dims{depth, 1});
      m->w = memory::desc({depth, cols}, in,
                          ldw_nn > 0 ? memory::dims{ldw_nn, 1} : memory::dims{1, depth});
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

// Per-thread buffers that grow only when a call larger than any before
// it comes (Scratch): oneDNN's scratchpad, packed x rows (f32, or bf16 for
// bf16 weights), a dense y block, and a block of bf16 W widened to f32.
struct ThreadScratch {
  Scratch<char> onednn;
  Scratch<float> x, y, w;
  Scratch<bf16> xb;
};
ThreadScratch& thread_scratch() {
  thread_local ThreadScratch s;
  return s;
}

// One cached block shape's arguments on one thread: memory objects made
// once from the shape's descriptors and re-pointed at each call's buffers
// (set_data_handle), and the argument array handed to
// dnnl_primitive_execute, built once with them (the C++ execute would copy
// an argument map into a new vector on every call).
struct BoundArgs {
  dnnl::memory x, w, y, bias, scratch;
  dnnl_exec_arg_t args[5];
  int count = 0;
};

// This thread's BoundArgs, by the MatmulCache key: the descriptors depend
// on the key only, so they serve whichever primitive the cache holds for
// it. Cleared when full, as the cache is.
BoundArgs& bound_args(const MatmulKey& key, const Matmul& m, const void* x, const void* w,
                      const float* bias, float* y, void* scratch) {
  thread_local std::map<MatmulKey, BoundArgs> bound;
  auto it = bound.find(key);
  if (it != bound.end()) {
    BoundArgs& b = it->second;
    b.x.set_data_handle(const_cast<void*>(x));
    b.w.set_data_handle(const_cast<void*>(w));
    b.y.set_data_handle(y);
    b.scratch.set_data_handle(scratch);
    if (bias != nullptr) b.bias.set_data_handle(const_cast<float*>(bias));
    return b;
  }
  // Built aside and inserted whole, so that a throw leaves no half-made entry.
  const dnnl::engine& e = cpu_engine();
  BoundArgs b;
  b.x = dnnl::memory(m.x, e, const_cast<void*>(x));
  b.w = dnnl::memory(m.w, e, const_cast<void*>(w));
  b.y = dnnl::memory(m.y, e, y);
  b.scratch = dnnl::memory(m.scratch, e, scratch);
  b.args[b.count++] = {DNNL_ARG_SRC, b.x.get()};
  b.args[b.count++] = {DNNL_ARG_WEIGHTS, b.w.get()};
  b.args[b.count++] = {DNNL_ARG_DST, b.y.get()};
  b.args[b.count++] = {DNNL_ARG_SCRATCHPAD, b.scratch.get()};
  if (bias != nullptr) {
    b.bias = dnnl::memory(m.bias, e, const_cast<float*>(bias));
    b.args[b.count++] = {DNNL_ARG_BIAS, b.bias.get()};
  }
  // The handles in args belong to the memory objects, which a move keeps.
  if (bound.size() >= MatmulCache::kMaxEntries) bound.clear();
  return bound.emplace(key, std::move(b)).first->second;
}

// One block through the cached matmul primitive: x dense [rows, depth]
// and w (layout as MatmulCache's, ldw_nn), both f32 or both bf16; y [rows,
// cols] f32 with row stride ldy. false if oneDNN refused.
bool block_matmul(const void* x, const void* w, bool bf16, const float* bias, float* y, int64_t ldy,
                  int64_t rows, int64_t cols, int64_t depth, int64_t ldw_nn = 0) {
  try {
    const auto m = matmul_cache().get(rows, cols, depth, bias != nullptr, bf16, ldw_nn);
    if (m == nullptr) return false;
    ThreadScratch& s = thread_scratch();
    const bool in_place = rows == 1 || ldy == cols;
    if (!s.onednn.grow(m->scratch.get_size()) ||
        (!in_place && !s.y.grow(static_cast<size_t>(rows * cols))))
      return false;
    float* out = in_place ? y : s.y.get();
    thread_local dnnl::stream stream(cpu_engine());
    const BoundArgs& b = bound_args(MatmulKey{rows, cols, depth, bias != nullptr, bf16, ldw_nn}, *m,
                                    x, w, bias, out, s.onednn.get());
    if (dnnl_primitive_execute(m->prim.get(), stream.get(), b.count, b.args) != dnnl_success)
      return false;
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
  if (!gemv && xd != nullptr && block_matmul(xd, w, false, bias, y, ldy, rows, cols, depth)) return;
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
    Scratch<float>& packed = thread_scratch().x;
    if (packed.grow(static_cast<size_t>(rows * depth))) {
      for (int64_t r = 0; r < rows; ++r)
        std::copy(x + r * ldx, x + r * ldx + depth, packed.get() + r * depth);
      xd = packed.get();
    } else {
      xd = nullptr;  // dnnl_sgemm reads strided rows itself
    }
  }
  const Grid g = make_grid(rows, cols, depth);
  const bool gemv = rows == 1 && opt.gemv_for_one_row;
  // The tasks reach parallel_for through a closure holding one reference,
  // which std::function stores without allocating.
  const auto body = [&](int64_t task) {
    const int64_t r0 = task / g.col_blocks * g.row_size;
    const int64_t c0 = task % g.col_blocks * g.col_size;
    block_fast(x + r0 * ldx, ldx, xd ? xd + r0 * depth : nullptr, w + c0 * depth,
               bias ? bias + c0 : nullptr, y + r0 * ldy + c0, ldy, std::min(g.row_size, rows - r0),
               std::min(g.col_size, cols - c0), depth, gemv);
  };
  parallel_for(g.row_blocks * g.col_blocks, resolve_num_threads(opt.num_threads),
               [&body](int64_t task, int) { body(task); });
}

// The implementation oneDNN picks for the matmul primitive here with f32
// or bf16 operands (f32 y) for a block of `rows` x `cols` (depth 256),
// e.g. "brg:avx512_core" or "gemm:jit"; "" if it refuses.
std::string pick_matmul_impl(bool bf16_operands, int64_t rows, int64_t cols) {
  using dnnl::memory;
  constexpr int64_t kDepth = 256;
  const memory::data_type in = bf16_operands ? memory::data_type::bf16 : memory::data_type::f32;
  try {
    const memory::desc x({rows, kDepth}, in, memory::dims{kDepth, 1});
    const memory::desc w({kDepth, cols}, in, memory::dims{1, kDepth});
    const memory::desc y({rows, cols}, memory::data_type::f32, memory::dims{cols, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x, w, y), cpu_engine());
    return std::string(pd.impl_info_str());
  } catch (const dnnl::error&) {
    return std::string();
  }
}

// The implementation for a small dense block (16 x 256), as reported.
const std::string& matmul_impl(bool bf16_operands) {
  static const std::string f32 = pick_matmul_impl(false, 16, 256),
                           bf16 = pick_matmul_impl(true, 16, 256);
  return bf16_operands ? bf16 : f32;
}

// Whether a row's result cannot depend on the rows beside it: brgemm, and
// the same brgemm for one row of a narrow projection as for a long block
// of a wide one. oneDNN chooses its kernel by the shape; with bf16 on an
// AMX CPU it runs AMX tiles for large blocks and avx512_core_bf16 for small
// ones, which sum in another order, so there a row computed alone and the
// same row among others differ in their last bits.
bool rows_independent(bool bf16_operands) {
  static const auto decide = [](bool bf16) {
    const std::string one = pick_matmul_impl(bf16, 1, 64), many = pick_matmul_impl(bf16, 512, 1024);
    return one.rfind("brg", 0) == 0 && one == many;
  };
  static const bool f32 = decide(false), bf16 = decide(true);
  return bf16_operands ? bf16 : f32;
}

// Whether oneDNN multiplies bf16 in hardware here (AVX512_BF16 or AMX).
// Without it, oneDNN 2.6 has only its reference code for bf16 matmul
// (AVX2), or emulates the products with AVX-512F at a quarter of its f32
// GEMM's speed (docs/GEMM.md); both run slower than its f32 GEMM on W
// widened to f32.
bool bf16_matmul_native() {
  static const bool native = [] {
    const std::string& impl = matmul_impl(true);
    // oneDNN's ISA values are sets of feature bits.
    const unsigned isa = dnnl_get_effective_cpu_isa(), bf16 = dnnl_cpu_isa_avx512_core_bf16;
    return !impl.empty() && impl.rfind("ref", 0) != 0 && (isa & bf16) == bf16;
  }();
  return native;
}

// One block of bf16 weights where oneDNN has no bf16 kernel, on the
// calling thread: W's block widened to f32 (exact) into per-thread scratch,
// then the f32 path on xr, x already rounded to bf16 (dense, [rows, depth]).
void block_widened(const float* xr, const bf16* w, const float* bias, float* y, int64_t ldy,
                   int64_t rows, int64_t cols, int64_t depth) {
  Scratch<float>& wf = thread_scratch().w;
  if (!wf.grow(static_cast<size_t>(cols * depth))) {
    linear_ref(xr, depth, Weight{w, DType::kBF16}, bias, y, ldy, rows, cols, depth);
    return;
  }
  for (int64_t i = 0; i < cols * depth; ++i) wf.get()[i] = bf16_to_float(w[i]);
  block_fast(xr, depth, xr, wf.get(), bias, y, ldy, rows, cols, depth, /*gemv=*/false);
}

void linear_fast_bf16(const float* x, int64_t ldx, const bf16* w, const float* bias, float* y,
                      int64_t ldy, int64_t rows, int64_t cols, int64_t depth,
                      const LinearOptions& opt) {
  if (depth == 0 || (rows > 1 && ldx < depth)) {
    linear_ref(x, ldx, Weight{w, DType::kBF16}, bias, y, ldy, rows, cols, depth);
    return;
  }
  // Few rows (decode): the stream GEMM, where the plan says so
  // (bf16_stream_max_rows); it writes nothing if it cannot get its scratch,
  // and oneDNN's path below then runs.
  using Choice = LinearOptions::Bf16Gemm;
  const Bf16StreamKernel* stream = bf16_stream_planned_kernel();
  if (stream != nullptr && opt.bf16_gemm != Choice::kOneDnn &&
      (opt.bf16_gemm == Choice::kStream || rows <= bf16_stream_max_rows()) &&
      linear_bf16_stream(*stream, x, ldx, w, bias, y, ldy, rows, cols, depth,
                         resolve_num_threads(opt.num_threads)))
    return;
  // x rounded to bf16 once, here on the calling thread: as bf16 for
  // oneDNN's bf16 kernels, else as f32 values for the widened path.
  const bool native = bf16_matmul_native();
  ThreadScratch& s = thread_scratch();
  const size_t n = static_cast<size_t>(rows * depth);
  if (!(native ? s.xb.grow(n) : s.x.grow(n))) {
    linear_ref(x, ldx, Weight{w, DType::kBF16}, bias, y, ldy, rows, cols, depth);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < depth; ++k) {
      const bf16 v = float_to_bf16(x[r * ldx + k]);
      if (native)
        s.xb.get()[r * depth + k] = v;
      else
        s.x.get()[r * depth + k] = bf16_to_float(v);
    }
  const bf16* xb = native ? s.xb.get() : nullptr;
  const float* xr = native ? nullptr : s.x.get();
  const Grid g = make_grid(rows, cols, depth);
  // The tasks reach parallel_for through a closure holding one reference,
  // which std::function stores without allocating.
  const auto body = [&](int64_t task) {
    const int64_t r0 = task / g.col_blocks * g.row_size;
    const int64_t c0 = task % g.col_blocks * g.col_size;
    const int64_t br = std::min(g.row_size, rows - r0), bc = std::min(g.col_size, cols - c0);
    float* yb = y + r0 * ldy + c0;
    const float* bb = bias ? bias + c0 : nullptr;
    if (native) {
      OmpThreadsScope single(1);
      if (block_matmul(xb + r0 * depth, w + c0 * depth, true, bb, yb, ldy, br, bc, depth)) return;
      // oneDNN refused (out of memory): the loop, on the caller's x.
      linear_ref(x + r0 * ldx, ldx, Weight{w + c0 * depth, DType::kBF16}, bb, yb, ldy, br, bc,
                 depth);
      return;
    }
    block_widened(xr + r0 * depth, w + c0 * depth, bb, yb, ldy, br, bc, depth);
  };
  parallel_for(g.row_blocks * g.col_blocks, resolve_num_threads(opt.num_threads),
               [&body](int64_t task, int) { body(task); });
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

void linear(const float* x, int64_t ldx, Weight w, const float* bias, float* y, int64_t ldy,
            int64_t rows, int64_t out_features, int64_t in_features, const LinearOptions& options) {
  if (rows <= 0 || out_features <= 0) return;
  if (resolve_backend(options.backend) == Backend::kReference)
    linear_ref(x, ldx, w, bias, y, ldy, rows, out_features, in_features);
  else if (w.dtype == DType::kBF16)
    linear_fast_bf16(x, ldx, static_cast<const bf16*>(w.data), bias, y, ldy, rows, out_features,
                     in_features, options);
  else
    linear_fast(x, ldx, static_cast<const float*>(w.data), bias, y, ldy, rows, out_features,
                in_features, options);
}

namespace {

// linear_ref's loop for W of element type T (float, or bf16 with x rounded
// to bf16: both factors then widen exactly, and each product is exact).
template <typename T>
void linear_loop(const float* x, int64_t ldx, const T* w, const float* bias, float* y, int64_t ldy,
                 int64_t rows, int64_t out_features, int64_t in_features) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  // float_to_bf16 widened back, without its branch, so the loop vectorises:
  // round to nearest even in the upper 16 bits; a NaN stays a NaN.
  const auto xv = [](float v) {
    if constexpr (!kBf16) return v;
    const uint32_t u = std::bit_cast<uint32_t>(v);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return std::bit_cast<float>((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u
                                                                : r);
  };
  const auto wv = [](T v) {
    if constexpr (kBf16)
      return bf16_to_float(v);
    else
      return v;
  };
  constexpr int kLanes = 8;  // independent partial sums: lets the compiler vectorise
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    for (int64_t n = 0; n < out_features; ++n) {
      const T* wr = w + n * in_features;
      float acc[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= in_features; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += xv(xr[k + l]) * wv(wr[k + l]);
      float tail = 0.0f;
      for (; k < in_features; ++k) tail += xv(xr[k]) * wv(wr[k]);
      float sum = tail;
      for (int l = 0; l < kLanes; ++l) sum += acc[l];
      yr[n] = bias ? sum + bias[n] : sum;
    }
  }
}

}  // namespace

void linear_ref(const float* x, int64_t ldx, Weight w, const float* bias, float* y, int64_t ldy,
                int64_t rows, int64_t out_features, int64_t in_features) {
  if (w.dtype == DType::kBF16)
    linear_loop(x, ldx, static_cast<const bf16*>(w.data), bias, y, ldy, rows, out_features,
                in_features);
  else
    linear_loop(x, ldx, static_cast<const float*>(w.data), bias, y, ldy, rows, out_features,
                in_features);
}

void linear_nn(const float* x, int64_t ldx, Weight w, int64_t ldw, float* y, int64_t ldy,
               int64_t rows, int64_t out_features, int64_t in_features, Backend backend) {
  if (rows <= 0 || out_features <= 0) return;
  const bool bf16w = w.dtype == DType::kBF16;
  if (resolve_backend(backend) != Backend::kReference && in_features > 0) {
    OmpThreadsScope single(1);
    if (bf16w && bf16_matmul_native()) {
      // oneDNN's bf16 matmul on x rounded to bf16 (the contract), dense, in
      // this thread's scratch, and W in place.
      Scratch<bf16>& xb = thread_scratch().xb;
      // Without the scratch, the loop below, which needs none.
      if (xb.grow(static_cast<size_t>(rows * in_features))) {
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t k = 0; k < in_features; ++k)
            xb.get()[m * in_features + k] = float_to_bf16(x[m * ldx + k]);
        if (block_matmul(xb.get(), w.data, true, nullptr, y, ldy, rows, out_features, in_features,
                         ldw))
          return;
      }
    } else {
      // f32 W as it is; bf16 W without a bf16 kernel widened to f32 and x
      // rounded to bf16, both in this thread's scratch (the same exact
      // products).
      const float* wf = static_cast<const float*>(w.data);
      const float* xf = x;
      int64_t ldwf = ldw, ldxf = ldx;
      bool ready = true;
      if (bf16w) {
        ThreadScratch& s = thread_scratch();
        // Without the scratch, the loop below, which needs none.
        ready = s.w.grow(static_cast<size_t>(in_features * out_features)) &&
                s.x.grow(static_cast<size_t>(rows * in_features));
        if (ready) {
          const bf16* wb = static_cast<const bf16*>(w.data);
          for (int64_t k = 0; k < in_features; ++k)
            for (int64_t n = 0; n < out_features; ++n)
              s.w.get()[k * out_features + n] = bf16_to_float(wb[k * ldw + n]);
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t k = 0; k < in_features; ++k)
              s.x.get()[m * in_features + k] = bf16_to_float(float_to_bf16(x[m * ldx + k]));
          wf = s.w.get();
          xf = s.x.get();
          ldwf = out_features;
          ldxf = in_features;
        }
      }
      // oneDNN checks lda >= K and ldc >= N even for one row (see block_sgemm).
      const int64_t lda = rows == 1 ? std::max(ldxf, in_features) : ldxf;
      const int64_t ldc = rows == 1 ? std::max(ldy, out_features) : ldy;
      if (ready && (ldxf >= in_features || rows == 1) &&
          dnnl_sgemm('N', 'N', rows, out_features, in_features, 1.0f, xf, lda, wf, ldwf, 0.0f, y,
                     ldc) == dnnl_success)
        return;
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* yr = y + m * ldy;
    std::fill(yr, yr + out_features, 0.0f);
    for (int64_t k = 0; k < in_features; ++k) {
      float a = x[m * ldx + k];
      if (bf16w) a = bf16_to_float(float_to_bf16(a));
      for (int64_t n = 0; n < out_features; ++n) {
        const int64_t at = k * ldw + n;
        yr[n] += a * (bf16w ? bf16_to_float(static_cast<const bf16*>(w.data)[at])
                            : static_cast<const float*>(w.data)[at]);
      }
    }
  }
}

bool linear_rows_independent(Backend backend, DType weight_dtype) {
  if (resolve_backend(backend) == Backend::kReference) return true;
  // bf16 weights of a few rows run the stream GEMM, more rows oneDNN's bf16
  // matmul, or the f32 one on widened W: a row's bits then depend on how
  // many rows share its call.
  if (weight_dtype == DType::kBF16 && bf16_stream_max_rows() > 0) return false;
  return rows_independent(weight_dtype == DType::kBF16 && bf16_matmul_native());
}

int64_t bf16_stream_max_rows() {
  const Bf16StreamKernel* stream = bf16_stream_planned_kernel();
  if (stream == nullptr) return 0;
  if (!bf16_matmul_native()) {
    const unsigned isa = dnnl_get_effective_cpu_isa(), avx512 = dnnl_cpu_isa_avx512_core;
    return (isa & avx512) == avx512 ? kStreamMaxRowsWidened512 : kStreamMaxRowsWidened;
  }
  if (stream == bf16_stream_amx_kernel()) return kStreamMaxRowsAmxTiles;
  static const int64_t native = matmul_impl(true).find("amx") != std::string::npos
                                    ? kStreamMaxRowsAmx
                                    : kStreamMaxRowsBf16Dot;
  return native;
}

std::string linear_backend_name(DType weight_dtype) {
  const dnnl_version_t* v = dnnl_version();
  char buf[300];
  const char* isa = isa_name(dnnl_get_effective_cpu_isa());
  if (weight_dtype != DType::kBF16) {
    std::snprintf(buf, sizeof buf, "oneDNN %d.%d.%d matmul %s (%s)", v->major, v->minor, v->patch,
                  matmul_impl(false).c_str(), isa);
    return buf;
  }
  const bool native = bf16_matmul_native();
  char onednn[200];
  std::snprintf(onednn, sizeof onednn, "oneDNN %d.%d.%d matmul %s (%s)%s", v->major, v->minor,
                v->patch, matmul_impl(native).c_str(), isa, native ? "" : " on W widened to f32");
  const int64_t stream_rows = bf16_stream_max_rows();
  if (stream_rows == 0) return onednn;
  std::snprintf(buf, sizeof buf, "attnkit bf16 stream (%s) for 1-%lld rows, above: %s",
                bf16_stream_planned_kernel()->name, static_cast<long long>(stream_rows), onednn);
  return buf;
}

const char* linear_backend_name() {
  // Per thread, so that a call after set_simd_target() reports the new
  // plan while another thread may still read the string it was given.
  thread_local std::string name;
  name = linear_backend_name(DType::kF32) + ", bf16 weights " + linear_backend_name(DType::kBF16);
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

std::string gemm_backend_name(DType weight_dtype) {
  return kernels::linear_backend_name(weight_dtype);
}

}  // namespace attnkit
