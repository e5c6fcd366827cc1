// gemm_bench: the layers' projections, y[M, N] = x[M, K] W[N, K]^T in fp32,
// on the GEMM libraries Debian ships, at real layer shapes (docs/GEMM.md).
//
//   gemm_bench [--libs attnkit,attnkit-inv,loop,onednn-sgemm,onednn-matmul,openblas,blis,eigen]
//              [--rows 1,4,16,512,2048] [--shapes all|llama_qo,v3_q_b,...]
//              [--threads 1,2] [--reps 3] [--min-seconds 0.5] [--loop-max-gflop 40]
//
// Candidates:
//   attnkit        kernels::linear as the attention and MLA layers call it
//                  (linear_backend_name(); gemv_for_one_row)
//   attnkit-inv    kernels::linear with default options, as the MoE layer
//                  calls it (rows independent; differs from attnkit at M = 1)
//   loop           kernels::linear with Backend::kReference (the loop twin)
//   onednn-sgemm   dnnl_sgemm (oneDNN's JIT GEMM; gemv when M == 1)
//   onednn-matmul  oneDNN's matmul primitive, cached per shape (brgemm)
//   openblas       cblas_sgemm (cblas_sgemv when M == 1), dlopen'ed
//   blis           cblas_sgemm of Debian's libblis (cblas_sgemv when M == 1), dlopen'ed
//   eigen          Eigen 3 compiled for AVX-512 in gemm_bench_eigen.cc (when built)
// Libraries that can thread are run in two modes at T > 1 threads:
//   lib    the library's own threads (openblas_set_num_threads,
//          bli_thread_set_num_threads, OpenMP's nthreads for oneDNN)
//   pool   attnkit's thread pool splits N into column blocks; the library
//          runs single-threaded inside each block
// OpenBLAS and BLIS are opened with dlopen so that both (they export the
// same cblas symbols) fit in one process, and so that the bench builds
// without them. OpenBLAS picks its kernels once, when it is loaded, from
// the CPU or from OPENBLAS_CORETYPE; the header says which it picked.
//
// Each cell is one candidate on one (shape, M, threads), called --reps
// times and for at least --min-seconds. W is rotated over copies that
// together exceed 128 MiB, so that decode reads weights from DRAM, as a
// model's layers do. Reported per cell:
//   best     2 M N K / the fastest call's wall seconds, GFLOP/s: on a
//            shared machine the fastest of many short calls is the one
//            least disturbed
//   %peak    best over T times one core's fp32 FMA peak timed in
//            thread-CPU seconds (measure_machine's probe loop, timed by CPU
//            time so that a busy machine does not lower it)
//   %mm      best over measure_machine()'s fp32 FMA peak at T threads,
//            measured in this process before the table (a best-of in wall
//            time: on a busy machine it can read low, and %mm high)
//   median   2 M N K / the median call's wall seconds
//   %core    2 M N K / the median call's process-CPU seconds, over one
//            core's peak as in %peak: the fraction of the cores' peak
//            while they worked. For calls too long to run undisturbed
//            this is the robust column
//   W GB/s   4 N K / best seconds: the weight stream, which bounds decode
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "attnkit/machine.h"
#include "core/threads.h"
#include "kernels/linear.h"

#if ATTNKIT_BENCH_EIGEN
#include "gemm_bench_eigen.h"
#endif

// OpenMP's runtime calls, from the libgomp oneDNN is built on (linked).
extern "C" {
void omp_set_num_threads(int n);
int omp_get_max_threads(void);
}

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int64_t n, k;  // out_features, in_features
  const char* what;
};

constexpr Shape kShapes[] = {
    {"llama_qo", 4096, 4096, "Llama-2/3 8B q_proj, o_proj"},
    {"llama3_kv", 1024, 4096, "Llama-3 8B k_proj, v_proj"},
    {"cmp_qo", 2048, 2048, "compare default (d_model 2048) q/o"},
    {"cmp_kv", 512, 2048, "compare default k/v"},
    {"v3_q_a", 1536, 7168, "DeepSeek-V3 MLA q_a_proj"},
    {"v3_kv_a", 576, 7168, "DeepSeek-V3 MLA kv_a_proj_with_mqa"},
    {"v3_q_b", 24576, 1536, "DeepSeek-V3 MLA q_b_proj"},
    {"v3_kv_b", 32768, 512, "DeepSeek-V3 MLA kv_b_proj"},
    {"v3_o", 7168, 16384, "DeepSeek-V3 MLA o_proj"},
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& t : split(s)) out.push_back(std::atoll(t.c_str()));
  return out;
}

double cpu_seconds(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
double process_cpu_seconds() { return cpu_seconds(CLOCK_PROCESS_CPUTIME_ID); }

volatile float g_sink;

// 16 independent FMA chains: enough to fill two FMA pipes of latency 4.
__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < 16; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc[0]);
  return lanes[0];
}
__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_ps(0.001f * static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  for (int i = 1; i < 16; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  return lanes[0];
}

// One core's fp32 FMA peak in GFLOP per thread-CPU second: the best of a
// few runs of measure_machine()'s probe, timed by CPU time instead of wall.
double core_peak_cpu_time() {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const int64_t iters = 4'000'000;
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double t0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    g_sink = avx512 ? fma_avx512(iters) : fma_avx2(iters);
    best = std::min(best, cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - t0);
  }
  return 2.0 * 16 * (avx512 ? 16 : 8) * static_cast<double>(iters) / best / 1e9;
}

// One problem: y [m, n] (row stride n) = x [m, k] (row stride k) w^T, w [n, k].
struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, n, k;
};

// A candidate runs one problem on `threads` threads in its mode.
using RunFn = std::function<void(const Problem&, int threads)>;

struct Candidate {
  std::string name;
  std::string mode;  // "-" (single mode), "lib" or "pool"
  RunFn run;
};

// Splits N into column blocks of at least 64 and runs fn on each block on
// attnkit's pool; the block list depends only on the shape.
void pool_columns(const Problem& p, int threads,
                  const std::function<void(const Problem&)>& single) {
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(8, p.n / 64));
  const int64_t width = (p.n + blocks - 1) / blocks;
  attnkit::parallel_for(blocks, threads, [&](int64_t b, int) {
    const int64_t n0 = b * width, n1 = std::min(p.n, n0 + width);
    if (n0 >= n1) return;
    Problem q = p;
    q.w = p.w + n0 * p.k;
    q.y = p.y + n0;
    q.n = n1 - n0;
    // q.y keeps row stride p.n: passed through ldy below.
    single(q);
  });
}

// ---- oneDNN ------------------------------------------------------------------

// Sets OpenMP's thread count for this thread for one scope (the ICV is
// per thread, so pool workers and the caller do not disturb each other).
class OmpThreads {
 public:
  explicit OmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

void dnnl_sgemm_run(const Problem& p, int64_t ldy) {
  dnnl_sgemm('N', 'T', p.m, p.n, p.k, 1.0f, p.x, p.k, p.w, p.k, 0.0f, p.y, ldy);
}

// The matmul primitive for a shape, created once (creation JIT-compiles).
class MatmulCache {
 public:
  void run(const Problem& p, int64_t ldy, int threads) {
    using dnnl::memory;
    const auto key = std::make_tuple(p.m, p.n, p.k, ldy, threads);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      const memory::desc a({p.m, p.k}, memory::data_type::f32, memory::dims{p.k, 1});
      const memory::desc b({p.k, p.n}, memory::data_type::f32, memory::dims{1, p.k});
      const memory::desc c({p.m, p.n}, memory::data_type::f32, memory::dims{ldy, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine_);
      it = cache_.emplace(key, Entry{dnnl::matmul(pd), a, b, c}).first;
    }
    Entry& e = it->second;
    memory am(e.a, engine_, const_cast<float*>(p.x)), bm(e.b, engine_, const_cast<float*>(p.w)),
        cm(e.c, engine_, p.y);
    dnnl::stream s(engine_);
    e.prim.execute(s, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    s.wait();
  }

 private:
  struct Entry {
    dnnl::matmul prim;
    dnnl::memory::desc a, b, c;
  };
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int>, Entry> cache_;
};

// ---- dlopen'ed CBLAS libraries ----------------------------------------------

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                            int, float, float*, int);
using CblasSgemv = void (*)(int, int, int, int, float, const float*, int, const float*, int, float,
                            float*, int);

struct Cblas {
  CblasSgemm sgemm = nullptr;
  CblasSgemv sgemv = nullptr;
  std::function<void(int)> set_threads;
  std::string info;

  void run(const Problem& p, int64_t ldy) const {
    const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    if (p.m == 1)  // y = W x: sgemm with M == 1 is 3-4x slower in OpenBLAS 0.3.21
      sgemv(kRowMajor, kNoTrans, n, k, 1.0f, p.w, k, p.x, 1, 0.0f, p.y, 1);
    else
      sgemm(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, p.x, k, p.w, k, 0.0f, p.y,
            static_cast<int>(ldy));
  }
};

void* open_library(const char* soname) {
  // DEEPBIND: each library's own calls bind inside it, although both export
  // cblas_sgemm.
  void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (h == nullptr) std::fprintf(stderr, "gemm_bench: skipping %s: %s\n", soname, dlerror());
  return h;
}

std::unique_ptr<Cblas> open_openblas() {
  void* h = open_library("libopenblas.so.0");
  if (h == nullptr) return nullptr;
  auto c = std::make_unique<Cblas>();
  c->sgemm = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
  c->sgemv = reinterpret_cast<CblasSgemv>(dlsym(h, "cblas_sgemv"));
  auto set = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
  auto core = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
  auto config = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_config"));
  if (!c->sgemm || !c->sgemv || !set || !core || !config) return nullptr;
  c->set_threads = set;
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  c->info = std::string(config()) + "; kernels: " + core() +
            "; OPENBLAS_CORETYPE=" + (env ? env : "(unset)");
  return c;
}

std::unique_ptr<Cblas> open_blis() {
  void* h = open_library("libblis.so.4");
  if (h == nullptr) return nullptr;
  auto c = std::make_unique<Cblas>();
  c->sgemm = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
  c->sgemv = reinterpret_cast<CblasSgemv>(dlsym(h, "cblas_sgemv"));
  auto set = reinterpret_cast<void (*)(int64_t)>(dlsym(h, "bli_thread_set_num_threads"));
  auto arch = reinterpret_cast<int (*)()>(dlsym(h, "bli_arch_query_id"));
  auto arch_name = reinterpret_cast<const char* (*)(int)>(dlsym(h, "bli_arch_string"));
  auto version = reinterpret_cast<const char* (*)()>(dlsym(h, "bli_info_get_version_str"));
  auto init = reinterpret_cast<void (*)()>(dlsym(h, "bli_init"));
  if (!c->sgemm || !c->sgemv || !set || !arch || !arch_name || !version || !init) return nullptr;
  init();  // before the query: BLIS_ARCH_TYPE is honoured only once BLIS is initialised
  c->set_threads = [set](int n) { set(n); };
  const char* env = std::getenv("BLIS_ARCH_TYPE");
  c->info = std::string("BLIS ") + version() + "; sub-configuration: " + arch_name(arch()) +
            "; BLIS_ARCH_TYPE=" + (env ? env : "(unset)");
  return c;
}

// ---- the table --------------------------------------------------------------

struct Options {
  std::vector<std::string> libs = {"attnkit",       "attnkit-inv", "loop", "onednn-sgemm",
                                   "onednn-matmul", "openblas",    "blis", "eigen"};
  std::vector<int64_t> rows = {1, 4, 16, 512, 2048};
  std::vector<std::string> shapes;  // empty: all
  std::vector<int64_t> threads = {1, 2};
  int reps = 3;                // timed calls per cell, at least
  double min_seconds = 0.5;    // and at least this long (short calls repeat more)
  double loop_max_gflop = 40;  // the loop takes minutes on the largest prefill cells
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (v == nullptr) {
      std::fprintf(stderr, "gemm_bench: %s needs a value\n", a.c_str());
      std::exit(2);
    }
    if (a == "--libs")
      o.libs = split(v);
    else if (a == "--rows")
      o.rows = split_ints(v);
    else if (a == "--shapes")
      o.shapes = std::string(v) == "all" ? std::vector<std::string>{} : split(v);
    else if (a == "--threads")
      o.threads = split_ints(v);
    else if (a == "--reps")
      o.reps = std::max(1, std::atoi(v));
    else if (a == "--min-seconds")
      o.min_seconds = std::atof(v);
    else if (a == "--loop-max-gflop")
      o.loop_max_gflop = std::atof(v);
    else {
      std::fprintf(stderr, "gemm_bench: unknown option %s\n", a.c_str());
      std::exit(2);
    }
    ++i;
  }
  return o;
}

bool wanted(const Options& o, const char* shape) {
  return o.shapes.empty() || std::find(o.shapes.begin(), o.shapes.end(), shape) != o.shapes.end();
}

// xorshift64*: a fast deterministic fill for hundreds of MB.
void fill(std::vector<float>& v, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& e : v) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    e = static_cast<float>(static_cast<double>((s * 2685821657736338717ull) >> 40) * 0x1p-24 - 0.5);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  auto has = [&](const char* lib) {
    return std::find(opt.libs.begin(), opt.libs.end(), lib) != opt.libs.end();
  };
  std::unique_ptr<Cblas> openblas = has("openblas") ? open_openblas() : nullptr;
  std::unique_ptr<Cblas> blis = has("blis") ? open_blis() : nullptr;
  MatmulCache matmul;

  std::printf("attnkit linear backend: %s\n", attnkit::kernels::linear_backend_name());
  const dnnl_version_t* dv = dnnl_version();
  std::printf("oneDNN %d.%d.%d, CPU ISA in use: %d (dnnl_cpu_isa_t)\n", dv->major, dv->minor,
              dv->patch, static_cast<int>(dnnl_get_effective_cpu_isa()));
  if (openblas) std::printf("OpenBLAS: %s\n", openblas->info.c_str());
  if (blis) std::printf("BLIS: %s\n", blis->info.c_str());

  std::vector<Candidate> cands;
  for (const std::string& lib : opt.libs) {
    if (lib == "attnkit" || lib == "attnkit-inv") {
      cands.push_back(
          {lib, "-", [gemv = lib == "attnkit"](const Problem& p, int t) {
             attnkit::kernels::linear(
                 p.x, p.k, p.w, nullptr, p.y, p.n, p.m, p.n, p.k,
                 {.num_threads = t, .backend = attnkit::Backend::kFast, .gemv_for_one_row = gemv});
           }});
    } else if (lib == "loop") {
      cands.push_back({lib, "-", [](const Problem& p, int t) {
                         attnkit::kernels::linear(
                             p.x, p.k, p.w, nullptr, p.y, p.n, p.m, p.n, p.k,
                             {.num_threads = t, .backend = attnkit::Backend::kReference});
                       }});
    } else if (lib == "onednn-sgemm") {
      cands.push_back({lib, "lib", [](const Problem& p, int t) {
                         OmpThreads omp(t);
                         dnnl_sgemm_run(p, p.n);
                       }});
      cands.push_back({lib, "pool", [](const Problem& p, int t) {
                         pool_columns(p, t, [ldy = p.n](const Problem& q) {
                           OmpThreads omp(1);
                           dnnl_sgemm_run(q, ldy);
                         });
                       }});
    } else if (lib == "onednn-matmul") {
      cands.push_back({lib, "lib", [&matmul](const Problem& p, int t) {
                         OmpThreads omp(t);
                         matmul.run(p, p.n, t);
                       }});
      // The pool mode would need one cache per worker (std::map is not
      // thread-safe); the sgemm pool mode shows what splitting N costs.
    } else if (lib == "openblas" || lib == "blis") {
      const Cblas* c = lib == "openblas" ? openblas.get() : blis.get();
      if (c == nullptr) continue;
      cands.push_back({lib, "lib", [c](const Problem& p, int t) {
                         c->set_threads(t);
                         c->run(p, p.n);
                       }});
      cands.push_back({lib, "pool", [c](const Problem& p, int t) {
                         c->set_threads(1);
                         pool_columns(p, t, [c, ldy = p.n](const Problem& q) { c->run(q, ldy); });
                       }});
    } else if (lib == "eigen") {
#if ATTNKIT_BENCH_EIGEN
      if (!__builtin_cpu_supports("avx512f")) continue;
      // No threads of its own (Debian's Eigen without OpenMP): the pool's.
      cands.push_back({lib, "pool", [](const Problem& p, int t) {
                         pool_columns(p, t, [ldy = p.n](const Problem& q) {
                           eigen_linear_avx512(q.x, q.k, q.w, q.y, ldy, q.m, q.n, q.k);
                         });
                       }});
#endif
    } else {
      std::fprintf(stderr, "gemm_bench: unknown library %s\n", lib.c_str());
      return 2;
    }
  }

  const double core_peak = core_peak_cpu_time();
  size_t rotation = 0;  // which copy of W the next call reads
  for (int64_t threads : opt.threads) {
    const int t = static_cast<int>(threads);
    const attnkit::MachineProfile mp = attnkit::measure_machine(t);
    std::printf(
        "\n== %d thread(s): measure_machine: fp32 FMA peak %.0f GFLOP/s, DRAM read %.1f GB/s;"
        " one core's peak by CPU time %.0f GFLOP/s ==\n",
        t, mp.fp32_peak_gflops, mp.dram_read_gbps, core_peak);
    std::printf("%-10s %5s  %-14s %-4s  %8s %6s %6s %8s %6s %7s %5s %9s\n", "shape", "M", "lib",
                "mode", "best", "%peak", "%mm", "median", "%core", "W GB/s", "calls", "best s");
    for (const Shape& s : kShapes) {
      if (!wanted(opt, s.name)) continue;
      const size_t wsize = static_cast<size_t>(s.n * s.k);
      const size_t copies =
          std::max<size_t>(1, std::min<size_t>(8, (size_t{128} << 20) / (wsize * 4) + 1));
      std::vector<std::vector<float>> ws(copies, std::vector<float>(wsize));
      for (size_t c = 0; c < copies; ++c) fill(ws[c], 7 + c);
      for (int64_t m : opt.rows) {
        std::vector<float> x(static_cast<size_t>(m * s.k)), y(static_cast<size_t>(m * s.n));
        fill(x, 3);
        const double flop = 2.0 * static_cast<double>(m) * s.n * s.k;
        for (const Candidate& c : cands) {
          // At one thread "pool" is "lib" where a library has both.
          if (t == 1 && c.mode == "pool" &&
              std::any_of(cands.begin(), cands.end(),
                          [&](const Candidate& o) { return o.name == c.name && o.mode == "lib"; }))
            continue;
          if (c.name == "loop" && flop > opt.loop_max_gflop * 1e9) continue;
          if (c.name == "attnkit-inv" && m > 1) continue;  // the same as attnkit
          // Untimed warm-up: JIT compilation, primitive creation, thread start.
          {
            std::vector<float> xs(static_cast<size_t>(std::min<int64_t>(m, 4) * s.k));
            std::vector<float> ys(static_cast<size_t>(std::min<int64_t>(m, 4) * s.n));
            c.run({xs.data(), ws[0].data(), ys.data(), std::min<int64_t>(m, 4), s.n, s.k}, t);
            if (c.name == "onednn-matmul")
              c.run({x.data(), ws[0].data(), y.data(), m, s.n, s.k}, t);
          }
          std::vector<double> wall, cpu;
          const auto cell_start = Clock::now();
          while (
              static_cast<int>(wall.size()) < opt.reps ||
              (std::chrono::duration<double>(Clock::now() - cell_start).count() < opt.min_seconds &&
               wall.size() < 1000)) {
            const Problem p{x.data(), ws[rotation++ % copies].data(), y.data(), m, s.n, s.k};
            const double c0 = process_cpu_seconds();
            const auto t0 = Clock::now();
            c.run(p, t);
            wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            cpu.push_back(process_cpu_seconds() - c0);
          }
          std::sort(wall.begin(), wall.end());
          std::sort(cpu.begin(), cpu.end());
          const double best = wall.front(), med = wall[wall.size() / 2];
          const double med_cpu = cpu[cpu.size() / 2];
          std::printf(
              "%-10s %5lld  %-14s %-4s  %8.1f %5.0f%% %5.0f%% %8.1f %5.0f%% %7.1f %5zu %9.5f\n",
              s.name, static_cast<long long>(m), c.name.c_str(), c.mode.c_str(), flop / best / 1e9,
              100.0 * flop / best / 1e9 / (t * core_peak),
              100.0 * flop / best / 1e9 / mp.fp32_peak_gflops, flop / med / 1e9,
              100.0 * flop / med_cpu / 1e9 / core_peak, 4.0 * s.n * s.k / best / 1e9, wall.size(),
              best);
          std::fflush(stdout);
          // Idle library threads (OpenBLAS's, libgomp's) busy-wait for a
          // while after a call: let them settle before the next candidate.
          std::this_thread::sleep_for(std::chrono::milliseconds(t > 1 ? 200 : 0));
        }
      }
    }
  }
  return 0;
}
