// Benchmarks of the fast CPU attention kernel on the shapes of the speed
// targets, reported against this machine's own limits, measured in-process
// (per thread count, attnkit::measure_machine) before the benchmarks run and
// again after them:
//   fp32 FMA peak   independent FMAs on the vectors the benchmark's kernels
//                   use (512-bit for the AVX-512 targets, 256-bit for
//                   AVX2: an AVX2 row on an AVX-512 CPU is judged against
//                   what 256-bit FMAs can do), on as many threads as the
//                   benchmark uses (GFLOP/s, 2 per FMA)
//   DRAM read BW    streaming reads of a 512 MiB buffer, same threads
// Each benchmark reports GFLOP/s (2 per multiply-add of QK^T and PV, over
// the visible (query, key) pairs only) as `frac_fma_peak`, and for decode
// the bytes of K and V it must read as `frac_dram_bw`; decode calls rotate
// over copies of K/V totalling >= 128 MiB so that they read DRAM, not L3.
// Because this VM's bandwidth moves from second to second, decode also
// alternates calls with plain reads of the same bytes: `frac_paired_read`
// (summary: "of read") is the median of read time / call time over the
// pairs, a fraction of the memory speed at that moment.
// Ratios between benchmarks (4-token vs 1-token decode, per-key decode time
// from 4K to 64K keys, GQA/MQA vs MHA per query head, 1 thread vs the
// default, fast vs reference) are printed in the summary at the end, from
// each benchmark's best repetition; the 4-token and per-query-head ratios
// also from calls of the two shapes alternated ("paired"), as are decode
// with sinks against without, and a 32K-token chunked prefill (chunks of
// 8K) against a sliding window of 8K (also per visible pair, since chunks
// see about half the pairs):
//   build/bench/attnkit_bench --benchmark_filter='sinks_over_plain|chunk8192'
//
//   build/bench/attnkit_bench --benchmark_repetitions=5      # everything
//   build/bench/attnkit_bench --benchmark_filter=decode
// ATTNKIT_BENCH_THREADS sets the default thread count (2); ATTNKIT_SIMD
// lowers the kernels of the rows that do not name a target (a row named
// .../avx2 runs the AVX2 kernels whatever it says).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/machine.h"
#include "bench_stats.h"
#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/amx.h"
#include "kernels/attention_params.h"
#include "kernels/dispatch.h"
#include "ops/kv_quant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attnkit {
namespace {

using Clock = std::chrono::steady_clock;

int bench_threads() {
  static const int threads = [] {
    const char* env = std::getenv("ATTNKIT_BENCH_THREADS");
    return env ? std::max(1, std::atoi(env)) : 2;
  }();
  return threads;
}

// ---- machine limits ---------------------------------------------------------

// A sequential read, for the decode benchmarks' paired reads (the limits
// themselves come from attnkit::measure_machine, src/core/machine.cc).
#if defined(__x86_64__)
__attribute__((target("avx2"))) float read_avx2(const float* p, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return out[0];
}
#endif

float read_plain(const float* p, int64_t n) {
  float s[8] = {};
  for (int64_t i = 0; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += p[i + j];
  return s[0] + s[7];
}

struct Limits {
  double fma_gflops = 0;  // fp32 peak of `threads` threads on `bits` vectors, 2 flops per FMA
  double dram_gbs = 0;    // read bandwidth of `threads` threads
};

// The vector width a target's kernels run on, which their FMA peak is
// measured at.
int vector_bits(SimdTarget target) {
  return target >= SimdTarget::kAvx512 ? 512 : target == SimdTarget::kAvx2 ? 256 : 32;
}

Limits measure_limits(int threads, int bits) {
  const MachineProfile m = measure_machine(threads);
  return {measure_fp32_peak(threads, bits), m.dram_read_gbps};
}

// Measured once per (thread count, vector width) before its first benchmark
// (for the per-benchmark counters) and again after all of them; the summary
// uses the higher of the two, so that a busy moment while measuring cannot
// flatter the fractions.
const Limits& limits(int threads, int bits) {
  static std::map<std::pair<int, int>, Limits> measured;
  auto it = measured.find({threads, bits});
  if (it == measured.end())
    it = measured.emplace(std::pair{threads, bits}, measure_limits(threads, bits)).first;
  return it->second;
}

// The target the rows that name none run: the best one, or what
// ATTNKIT_SIMD lowered it to (read before any row changes it).
SimdTarget default_target() {
  static const SimdTarget target = simd_target();
  return target;
}

// ---- problems ---------------------------------------------------------------

struct Shape {
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, kv_heads = 1, d = 128, dv = 128;
  DType kv = DType::kF32;
  bool causal = false;
  bool mla_view = false;  // V = the first dv columns of K's rows
  bool ragged = false;    // batch items of seqlen_k / 16 ... seqlen_k keys, evenly spread
  int threads = 0;        // 0 = bench_threads()
  bool sinks = false;     // one sink logit per query head (gpt-oss)
  int64_t chunk = 0;      // chunked local attention (Llama 4), 0 = off
  int64_t window_left = -1;
  // AttentionParams::batch_invariant, as PagedKVCache::attend runs: no key
  // split, fixed key tiles (src/kernels/cpu/tile_policy.h).
  bool invariant = false;
};

bool eight_bit(DType kv) { return kv == DType::kI8 || kv == DType::kFp8E4M3; }

// Keys of batch item b.
int64_t keys_of(const Shape& s, int64_t b) {
  if (!s.ragged || s.batch < 2) return s.seqlen_k;
  const int64_t lo = s.seqlen_k / 16;
  return lo + (s.seqlen_k - lo) * b / (s.batch - 1);
}

// Bytes of one token's row of one kv head as a cache stores it (8-bit:
// codes and scales, ops/kv_quant.h), unpadded.
double head_row_bytes(const Shape& s, int64_t dim) {
  if (!eight_bit(s.kv)) return static_cast<double>(dim) * static_cast<double>(dtype_size(s.kv));
  const int64_t block = s.mla_view ? kLatentScaleBlock : 0;
  return static_cast<double>(dim + 4 * (block ? (dim + block - 1) / block : 1));
}

bool is_decode(const Shape& s) { return s.seqlen_q <= 16; }

// Decode calls rotate over copies of K/V until they total at least this:
// four times this machine's 32 MiB L3 (AMD's L3 is a victim cache, not
// strict LRU), so each call finds its K/V in DRAM, not in the L3.
constexpr size_t kDecodeRotateBytes = size_t{128} << 20;

// K/V storage aligned as attnkit's own tensors and caches are (64 bytes).
// A std::vector's 16-byte alignment splits every 64-byte load across two
// cache lines: a plain read of such a buffer ran 1.4x slower (23 vs 33
// GB/s, one thread) and resident decode 1.2x slower, so both the kernel
// and its paired-read yardstick measured split loads, not the cache.
class AlignedBytes {
 public:
  void resize(size_t n) {
    data_.reset(n ? static_cast<char*>(std::aligned_alloc(64, (n + 63) / 64 * 64)) : nullptr);
    if (n && !data_) throw std::bad_alloc();
    size_ = n;
  }
  char* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  size_t size_ = 0;
};

// Inputs of one shape, filled with random values once.
class Problem {
 public:
  explicit Problem(const Shape& s) : s_(s) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    q_.resize(static_cast<size_t>(s.batch * s.seqlen_q * s.heads * s.d));
    for (float& x : q_) x = u(rng);
    // Decode reads a KV cache, laid out as attnkit's KVCache lays it out
    // (token rows of whole 2 KiB padded by a line, kv_token_stride; 8-bit
    // rows with their scales, MLA's as LatentCache stores them).
    cache_layout_ = is_decode(s) && !s.mla_view;
    const KvRowLayout kl = kv_row_layout(s.kv_heads, s.d, s.kv, s.mla_view ? kLatentScaleBlock : 0);
    const KvRowLayout vl = kv_row_layout(s.kv_heads, s.dv, s.kv);
    k_layout_ = kl;
    v_layout_ = vl;
    const int64_t k_row = cache_layout_ || eight_bit(s.kv) ? kl.row : s.kv_heads * s.d;
    const int64_t v_row = cache_layout_ || eight_bit(s.kv) ? vl.row : s.kv_heads * s.dv;
    k_row_ = k_row;
    v_row_ = v_row;
    const size_t kn = static_cast<size_t>(s.batch * s.seqlen_k * k_row);
    const size_t vn = s.mla_view ? 0 : static_cast<size_t>(s.batch * s.seqlen_k * v_row);
    const size_t bytes = dtype_size(s.kv);
    const size_t set_bytes = (kn + vn) * bytes;
    sets_ = is_decode(s) && set_bytes > 0
                ? std::max<size_t>(1, (kDecodeRotateBytes + set_bytes - 1) / set_bytes)
                : 1;
    k_.resize(kn * bytes * sets_);
    v_.resize(vn * bytes * sets_);
    kn_ = kn * sets_;
    vn_ = vn * sets_;
    auto fill = [&](AlignedBytes& buf, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        const float x = u(rng);
        if (s.kv == DType::kBF16) {
          const bf16 h = float_to_bf16(x);
          std::memcpy(buf.data() + 2 * i, &h, 2);
        } else if (eight_bit(s.kv)) {  // codes of values in [-1, 1] at the scales below
          buf.data()[i] =
              static_cast<char>(s.kv == DType::kI8 ? static_cast<int8_t>(std::lround(x * 127))
                                                   : float_to_fp8_e4m3(x * 448));
        } else {
          std::memcpy(buf.data() + 4 * i, &x, 4);
        }
      }
    };
    fill(k_, kn_);
    fill(v_, vn_);
    // 8-bit: every scale 1/code_max, written over the filled rows' scale bytes.
    auto scales = [&](AlignedBytes& buf, size_t rows, const KvRowLayout& l, int64_t row) {
      const float scale = s.kv == DType::kI8 ? 1.0f / 127 : 1.0f / 448;
      for (size_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < s.kv_heads * l.scales_per_head; ++x)
          std::memcpy(buf.data() + r * row + l.scale_offset + 4 * x, &scale, 4);
    };
    if (eight_bit(s.kv)) {
      scales(k_, kn_ / k_row, kl, k_row);
      if (!s.mla_view) scales(v_, vn_ / v_row, vl, v_row);
    }
    for (int64_t b = 0; b < s.batch; ++b) k_len_.push_back(static_cast<int32_t>(keys_of(s, b)));
    for (int64_t h = 0; s.sinks && h < s.heads; ++h) sinks_.push_back(u(rng));
    out_.resize(static_cast<size_t>(s.batch * s.seqlen_q * s.heads * s.dv));
  }

  // A plain sequential read, on `threads` threads, of as many bytes of the
  // next set's K and V as a decode call needs (kv_bytes(): row padding is
  // not counted); returns its seconds.
  double read_next_set(int threads) {
    const size_t set = next_set_;
    next_set_ = (next_set_ + 1) % sets_;
    const char* parts[2] = {k_.data() + k_.size() / sets_ * set,
                            v_.data() + v_.size() / sets_ * set};
    double keys = 0;
    for (int64_t b = 0; b < s_.batch; ++b) keys += static_cast<double>(keys_of(s_, b));
    const double rows = keys * static_cast<double>(s_.kv_heads);
    const int64_t floats[2] = {
        static_cast<int64_t>(rows * head_row_bytes(s_, s_.d) / 4),
        s_.mla_view ? 0 : static_cast<int64_t>(rows * head_row_bytes(s_, s_.dv) / 4)};
    volatile float sink = 0;
    const auto t0 = Clock::now();
    parallel_for(threads, threads, [&](int64_t t, int) {
      for (int i = 0; i < 2; ++i) {
        const int64_t lo = floats[i] * t / threads / 32 * 32;
        const int64_t hi = floats[i] * (t + 1) / threads / 32 * 32;
        const float* base = reinterpret_cast<const float*>(parts[i]) + lo;
#if defined(__x86_64__)
        if (cpu_features().avx2) {
          sink = sink + read_avx2(base, hi - lo);
          continue;
        }
#endif
        sink = sink + read_plain(base, hi - lo);
      }
    });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // One call on the next K/V set of the rotation.
  Status run(Backend backend, int threads) {
    AttentionOptions o;
    o.causal = s_.causal;
    o.backend = backend;
    o.num_threads = threads;
    if (s_.ragged) o.seqlens_k = k_len_;
    if (s_.sinks) o.sinks = make_view(sinks_.data(), DType::kF32, {s_.heads});
    o.chunk_size = s_.chunk;
    o.window_size.left = s_.window_left;
    const size_t set = next_set_;
    next_set_ = (next_set_ + 1) % sets_;
    const size_t k_at = k_.size() / sets_ * set, v_at = v_.size() / sets_ * set;
    if (eight_bit(s_.kv) || s_.invariant)
      return run_params(backend, threads, k_.data() + k_at, v_.data() + v_at);
    auto shaped = [&](char* data, int64_t dim) {
      return cache_layout_ ? kv_cache_view(data, s_.kv, s_.batch, s_.seqlen_k, s_.kv_heads, dim)
                           : make_view(data, s_.kv, {s_.batch, s_.seqlen_k, s_.kv_heads, dim});
    };
    TensorView k = shaped(k_.data() + k_at, s_.d);
    TensorView v;
    if (s_.mla_view) {
      v = k;  // a strided view of the first dv columns of K's rows
      v.shape[3] = s_.dv;
    } else {
      v = shaped(v_.data() + v_at, s_.dv);
    }
    return sdpa(make_view(q_.data(), DType::kF32, {s_.batch, s_.seqlen_q, s_.heads, s_.d}), k, v,
                make_view(out_.data(), DType::kF32, {s_.batch, s_.seqlen_q, s_.heads, s_.dv}), o);
  }

  // 2 flops per multiply-add of QK^T and PV over visible (query, key) pairs.
  double flops() const {
    double pairs = 0;
    for (int64_t b = 0; b < s_.batch; ++b) {
      const int64_t keys = keys_of(s_, b);
      for (int64_t i = 0; i < s_.seqlen_q; ++i) {
        const int64_t p = i + keys - s_.seqlen_q;  // bottom-right aligned
        int64_t lo = 0, hi = s_.causal ? std::min(keys, p + 1) : keys;
        if (s_.window_left >= 0) lo = std::max(lo, p - s_.window_left);
        if (s_.chunk > 0) {
          lo = std::max(lo, p / s_.chunk * s_.chunk);
          hi = std::min(hi, p / s_.chunk * s_.chunk + s_.chunk);
        }
        pairs += static_cast<double>(std::max<int64_t>(0, hi - lo));
      }
    }
    return 2.0 * (s_.d + s_.dv) * pairs * s_.heads;
  }
  // K and V bytes a decode step must read once (V inside K for MLA; 8-bit
  // types with their scales).
  double kv_bytes() const {
    double keys = 0;
    for (int64_t b = 0; b < s_.batch; ++b) keys += static_cast<double>(keys_of(s_, b));
    return keys * static_cast<double>(s_.kv_heads) *
           (head_row_bytes(s_, s_.d) + (s_.mla_view ? 0 : head_row_bytes(s_, s_.dv)));
  }

 private:
  // sdpa() takes f32 and bf16 K/V only and plans for the call: 8-bit K/V
  // and batch-invariant calls are given to the kernels as KVCache,
  // LatentCache (src/ops/kv_cache.cc) and PagedKVCache give them.
  Status run_params(Backend backend, int threads, const char* k, const char* v) {
    kernels::AttentionParams p;
    p.batch = s_.batch;
    p.seqlen_q = s_.seqlen_q;
    p.seqlen_k = s_.seqlen_k;
    p.num_heads = s_.heads;
    p.num_kv_heads = s_.kv_heads;
    p.head_dim = s_.d;
    p.head_dim_v = s_.dv;
    p.q = q_.data();
    p.q_stride = {s_.seqlen_q * s_.heads * s_.d, s_.heads * s_.d, s_.d, 1};
    p.kv_dtype = s_.kv;
    p.k = k;
    p.k_stride = {s_.seqlen_k * k_row_, k_row_, s_.d, 1};
    p.v = s_.mla_view ? k : v;
    p.v_stride =
        s_.mla_view ? p.k_stride : kernels::Strides4{s_.seqlen_k * v_row_, v_row_, s_.dv, 1};
    if (eight_bit(s_.kv)) {
      const KvRowLayout& vl = s_.mla_view ? k_layout_ : v_layout_;
      const int64_t v_row = s_.mla_view ? k_row_ : v_row_;
      p.k_scale = reinterpret_cast<const float*>(k + k_layout_.scale_offset);
      p.k_scale_stride = {s_.seqlen_k * k_row_ / 4, k_row_ / 4, k_layout_.scales_per_head, 1};
      p.v_scale = reinterpret_cast<const float*>((s_.mla_view ? k : v) + vl.scale_offset);
      p.v_scale_stride = {s_.seqlen_k * v_row / 4, v_row / 4, vl.scales_per_head, 1};
      p.scale_block = s_.mla_view ? kLatentScaleBlock : 0;
    }
    p.out = out_.data();
    p.out_stride = {s_.seqlen_q * s_.heads * s_.dv, s_.heads * s_.dv, s_.dv, 1};
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s_.d)));
    p.causal = s_.causal;
    if (s_.ragged) p.k_len = k_len_.data();
    if (s_.sinks) p.sinks = sinks_.data();
    p.chunk_size = s_.chunk;
    p.window_left = s_.window_left;
    p.batch_invariant = s_.invariant;
    p.num_threads = threads;
    return kernels::run_attention(p, backend);
  }

  Shape s_;
  std::vector<float> q_, out_, sinks_;
  std::vector<int32_t> k_len_;
  KvRowLayout k_layout_, v_layout_;
  int64_t k_row_ = 0, v_row_ = 0;  // elements (8-bit: bytes) between token rows
  AlignedBytes k_, v_;             // `sets_` copies, one after the other (each a multiple of 64 B)
  size_t kn_ = 0, vn_ = 0, sets_ = 1, next_set_ = 0;
  bool cache_layout_ = false;  // K/V laid out as KVCache's (kv_cache_view)
};

// The best (lowest) seconds per call of each benchmark over its
// repetitions, with its work, for the summary.
struct Record {
  double seconds = 1e300;
  double flops = 0, kv_bytes = 0;
  bool decode = false;
  int threads = 0;
  int bits = 0;                // the vector width of the kernels, which the peak is measured at
  std::vector<double> paired;  // decode: read time / call time, alternated pairs
  double paired_median() const { return bench::median(paired); }
};
std::map<std::string, Record>& records() {
  static std::map<std::string, Record> m;
  return m;
}

void run_benchmark(benchmark::State& state, const std::string& name, Shape shape, Backend backend,
                   SimdTarget target) {
  if (!set_simd_target(target)) {
    state.SkipWithError("SIMD target not available on this CPU");
    return;
  }
  Problem problem(shape);
  const int threads = shape.threads > 0 ? shape.threads : bench_threads();
  if (Status st = problem.run(backend, threads); !st.ok()) {
    state.SkipWithError(st.to_string().c_str());
    return;
  }
  const auto t0 = Clock::now();
  int64_t calls = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(problem.run(backend, threads));
    ++calls;
  }
  const double per_call = std::chrono::duration<double>(Clock::now() - t0).count() / calls;
  Record& rec = records()[name];
  rec.seconds = std::min(rec.seconds, per_call);
  if (is_decode(shape) && backend == Backend::kFast) {
    // This VM's read bandwidth moves by 1.5x from one second to the next,
    // so a limit measured apart from the calls is a loose yardstick. Here
    // decode calls alternate with plain reads of the same number of bytes
    // (the next set of the rotation): the median of (read time / call time)
    // over the pairs is the fraction of the memory speed of that moment.
    std::vector<double> fractions;
    for (int pair = 0; pair < 11; ++pair) {
      const double read = problem.read_next_set(threads);
      const auto c0 = Clock::now();
      benchmark::DoNotOptimize(problem.run(backend, threads));
      fractions.push_back(read / std::chrono::duration<double>(Clock::now() - c0).count());
    }
    rec.paired.insert(rec.paired.end(), fractions.begin(), fractions.end());
    std::sort(fractions.begin(), fractions.end());
    state.counters["frac_paired_read"] = fractions[fractions.size() / 2];
  }
  rec.flops = problem.flops();
  rec.kv_bytes = problem.kv_bytes();
  rec.decode = is_decode(shape);
  rec.threads = threads;
  rec.bits = vector_bits(target);
  const Limits& lim = limits(threads, rec.bits);
  state.counters["GFLOPs"] = problem.flops() / per_call / 1e9;
  state.counters["frac_fma_peak"] = problem.flops() / per_call / 1e9 / lim.fma_gflops;
  if (is_decode(shape)) {
    state.counters["GBs"] = problem.kv_bytes() / per_call / 1e9;
    state.counters["frac_dram_bw"] = problem.kv_bytes() / per_call / 1e9 / lim.dram_gbs;
  }
  set_simd_target(default_target());
}

// Paired ratios: the 4-token target is a ratio of two call times, and this
// VM's memory speed moves by up to 2x between the moments two separate
// benchmarks run, so a ratio of their best times mixes two machine states.
// Prefill per query head (GQA/MQA against MHA) is paired for the same
// reason: separate best times put causal MHA s1024 fp32 10-15 % behind GQA
// in some runs, while alternated calls put it 2-7 % behind.
// Here calls of the two shapes alternate (each over its own rotation, the
// order flipped every pair so neither always runs on the other's heels) and
// the summary prints the median of the per-pair ratios.
std::map<std::string, std::vector<double>>& paired_ratios() {
  static std::map<std::string, std::vector<double>> m;
  return m;
}

void run_ratio_benchmark(benchmark::State& state, const std::string& name, const Shape& num,
                         const Shape& den) {
  Problem a(num), b(den);
  const int threads = bench_threads();
  for (Problem* p : {&a, &b})
    if (Status st = p->run(Backend::kFast, threads); !st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  auto seconds = [&](Problem& p) {
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(p.run(Backend::kFast, threads));
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  std::vector<double> ratios;
  bool num_first = true;
  for (auto _ : state) {
    double tn = 0, td = 0;
    if (num_first) {
      tn = seconds(a);
      td = seconds(b);
    } else {
      td = seconds(b);
      tn = seconds(a);
    }
    num_first = !num_first;
    ratios.push_back(tn / td);
  }
  std::vector<double>& all = paired_ratios()[name];
  all.insert(all.end(), ratios.begin(), ratios.end());
  state.counters["ratio_median"] = bench::median(ratios);
  // Shapes of different work (chunks against a window of the same size):
  // the ratio of time per visible (query, key) pair too.
  if (a.flops() != b.flops()) {
    std::vector<double>& per_pair = paired_ratios()[name + "/per_visible_pair"];
    for (double r : ratios) per_pair.push_back(r * b.flops() / a.flops());
    state.counters["ratio_per_pair_median"] = bench::median(ratios) * b.flops() / a.flops();
  }
}

// The same call with the AMX forms (kernels/amx.h) over without them,
// alternated as run_ratio_benchmark alternates its two shapes.
void run_amx_ratio_benchmark(benchmark::State& state, const std::string& name, const Shape& shape) {
  if (!kernels::amx_bf16_available()) {
    state.SkipWithError("no AMX tiles on this CPU");
    return;
  }
  Problem a(shape);
  const int threads = bench_threads();
  auto seconds = [&](bool amx) {
    kernels::set_amx_allowed(amx);
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(a.run(Backend::kFast, threads));
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  std::vector<double> ratios;
  bool amx_first = true;
  seconds(true);
  for (auto _ : state) {
    double tn = 0, td = 0;
    if (amx_first) {
      tn = seconds(true);
      td = seconds(false);
    } else {
      td = seconds(false);
      tn = seconds(true);
    }
    amx_first = !amx_first;
    ratios.push_back(tn / td);
  }
  kernels::set_amx_allowed(true);
  std::vector<double>& all = paired_ratios()[name];
  all.insert(all.end(), ratios.begin(), ratios.end());
  state.counters["ratio_median"] = bench::median(ratios);
}

void add_ratio(const std::string& name, const Shape& num, const Shape& den, int pairs = 15) {
  benchmark::RegisterBenchmark(
      name.c_str(), [=](benchmark::State& st) { run_ratio_benchmark(st, name, num, den); })
      ->UseRealTime()
      ->Iterations(pairs)
      ->Unit(benchmark::kMillisecond);
}

void add(const std::string& name, const Shape& shape, Backend backend = Backend::kFast,
         SimdTarget target = default_target()) {
  benchmark::RegisterBenchmark(
      name.c_str(), [=](benchmark::State& st) { run_benchmark(st, name, shape, backend, target); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

Shape gqa_prefill(int64_t kv_heads, DType kv, int64_t seqlen = 2048) {
  Shape s;
  s.seqlen_q = s.seqlen_k = seqlen;
  s.heads = 32;
  s.kv_heads = kv_heads;
  s.kv = kv;
  s.causal = true;
  return s;
}

Shape gqa_decode(int64_t tokens, DType kv, int64_t batch = 1, int64_t keys = 16384) {
  Shape s;
  s.batch = batch;
  s.seqlen_q = tokens;
  s.seqlen_k = keys;
  s.heads = 32;
  s.kv_heads = 8;
  s.kv = kv;
  s.causal = true;
  return s;
}

Shape with_sinks(Shape s) {
  s.sinks = true;
  return s;
}

// 32K-token causal prefill, GQA 8/2, head_dim 64 (a Llama 4 layer's
// chunk and a sliding-window layer's window at a smaller head count, so
// that a pair of calls takes seconds, not minutes): chunks of C, or a
// window of C (each query sees itself and C - 1 keys before it).
Shape long_prefill(int64_t chunk, int64_t window) {
  Shape s;
  s.seqlen_q = s.seqlen_k = 32768;
  s.heads = 8;
  s.kv_heads = 2;
  s.d = s.dv = 64;
  s.causal = true;
  s.chunk = chunk;
  s.window_left = window > 0 ? window - 1 : -1;
  return s;
}

Shape mla_decode(DType kv) {
  Shape s;
  s.seqlen_k = 4096;
  s.heads = 128;
  s.kv_heads = 1;
  s.d = 576;
  s.dv = 512;
  s.kv = kv;
  s.mla_view = true;
  s.causal = true;
  return s;
}

Shape on_threads(Shape s, int threads) {
  s.threads = threads;
  return s;
}

Shape invariant(Shape s) {
  s.invariant = true;
  return s;
}

Shape ragged(Shape s) {
  s.ragged = true;
  return s;
}

std::string kv_name(DType kv) {
  return kv == DType::kBF16 ? "bf16" : kv == DType::kF32 ? "f32" : dtype_name(kv);
}

// The shapes of the speed targets (docs/PERFORMANCE.md), then the thread
// scaling pair (1 thread against the default), the per-token decode
// scaling from 4K to 64K keys, and the reference twin on a small size.
void register_all() {
  add("prefill/causal/gqa32-8/s2048/f32", gqa_prefill(8, DType::kF32));
  add("prefill/causal/gqa32-8/s2048/bf16", gqa_prefill(8, DType::kBF16));
  add("prefill/causal/gqa32-8/s1024/f32", gqa_prefill(8, DType::kF32, 1024));
  add("prefill/causal/mha32/s1024/f32", gqa_prefill(32, DType::kF32, 1024));
  add("prefill/causal/mqa32-1/s1024/f32", gqa_prefill(1, DType::kF32, 1024));
  add("prefill/causal/mha32/s1024/bf16", gqa_prefill(32, DType::kBF16, 1024));
  add("prefill/causal/mqa32-1/s1024/bf16", gqa_prefill(1, DType::kBF16, 1024));
  add("prefill/causal/gqa32-8/s2048/f32/avx2", gqa_prefill(8, DType::kF32), Backend::kFast,
      SimdTarget::kAvx2);
  for (int64_t tokens : {1, 2, 4, 8, 16})
    add("decode/gqa32-8/k16384/q" + std::to_string(tokens) + "/f32",
        gqa_decode(tokens, DType::kF32));
  for (DType kv : {DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
    add("decode/gqa32-8/k16384/q1/" + kv_name(kv), gqa_decode(1, kv));
    add("decode/gqa32-8/k16384/q4/" + kv_name(kv), gqa_decode(4, kv));
  }
  add("decode/gqa32-8/k16384/b8/q1/f32", gqa_decode(1, DType::kF32, 8));
  add("decode/gqa32-8/k16384/b8/q1/bf16", gqa_decode(1, DType::kBF16, 8));
  add("decode/gqa32-8/k16384/b8/q4/f32", gqa_decode(4, DType::kF32, 8));
  // Batch 8 of 1K-16K keys (the issue-25 target's ragged batch).
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    add("decode/gqa32-8/k1024-16384/b8/q1/" + kv_name(kv), ragged(gqa_decode(1, kv, 8)));
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    add_ratio("paired/decode/gqa32-8/k16384/q4_over_q1/" + kv_name(kv), gqa_decode(4, kv),
              gqa_decode(1, kv));
  for (DType kv : {DType::kBF16, DType::kI8, DType::kFp8E4M3})
    add_ratio("paired/decode/gqa32-8/k16384/q2_over_q1/" + kv_name(kv), gqa_decode(2, kv),
              gqa_decode(1, kv));
  // Multi-token decode with AMX tiles over without (tile_policy.h,
  // scores_on_amx); 1 token never takes them (a ratio of 1 but for noise).
  for (int64_t tokens : {1, 2, 3, 4})
    for (DType kv : {DType::kBF16, DType::kI8, DType::kFp8E4M3}) {
      const std::string name = "paired/decode/gqa32-8/k16384/q" + std::to_string(tokens) +
                               "/amx_over_none/" + kv_name(kv);
      const Shape shape = gqa_decode(tokens, kv);
      benchmark::RegisterBenchmark(
          name.c_str(), [=](benchmark::State& st) { run_amx_ratio_benchmark(st, name, shape); })
          ->UseRealTime()
          ->Iterations(15)
          ->Unit(benchmark::kMillisecond);
    }
  // 8-bit against 16-bit and 32-bit storage, 1 token.
  for (DType kv : {DType::kI8, DType::kFp8E4M3})
    for (DType wide : {DType::kBF16, DType::kF32})
      add_ratio("paired/decode/gqa32-8/k16384/q1/" + kv_name(kv) + "_over_" + kv_name(wide),
                gqa_decode(1, kv), gqa_decode(1, wide));
  // Sinks on decode: the same call with and without them (their cost is
  // one exp per row where the row is written or its splits merged).
  for (DType kv : {DType::kF32, DType::kBF16})
    add_ratio("paired/decode/gqa32-8/k16384/q1/sinks_over_plain/" + kv_name(kv),
              with_sinks(gqa_decode(1, kv)), gqa_decode(1, kv), 31);
  // Chunked prefill against a sliding window of the same size: key tiles
  // outside a query block's chunk are skipped as tiles outside a window
  // are. Chunks see about half the (query, key) pairs of such a window, so
  // the summary gives the ratio per visible pair too.
  add_ratio("paired/prefill/causal/gqa8-2/d64/s32768/chunk8192_over_window8192/f32",
            long_prefill(8192, 0), long_prefill(0, 8192), 5);
  add_ratio("paired/prefill/causal/s1024/gqa32-8_over_mha32/f32", gqa_prefill(8, DType::kF32, 1024),
            gqa_prefill(32, DType::kF32, 1024));
  add_ratio("paired/prefill/causal/s1024/mqa32-1_over_mha32/f32", gqa_prefill(1, DType::kF32, 1024),
            gqa_prefill(32, DType::kF32, 1024));
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    add("mla/h128/k4096/q1/" + kv_name(kv), mla_decode(kv));
  for (DType kv : {DType::kI8, DType::kFp8E4M3})
    add_ratio("paired/mla/h128/k4096/q1/" + kv_name(kv) + "_over_bf16", mla_decode(kv),
              mla_decode(DType::kBF16));
  // What batch invariance (PagedKVCache::attend's plans) costs: the same
  // call planned batch-invariant and as usual.
  for (auto [name, shape] :
       {std::pair{"prefill/causal/gqa32-8/s2048/f32", gqa_prefill(8, DType::kF32)},
        std::pair{"prefill/causal/gqa32-8/s2048/bf16", gqa_prefill(8, DType::kBF16)},
        std::pair{"decode/gqa32-8/k16384/q1/f32", gqa_decode(1, DType::kF32)},
        std::pair{"decode/gqa32-8/k16384/q1/bf16", gqa_decode(1, DType::kBF16)},
        std::pair{"decode/gqa32-8/k16384/q4/f32", gqa_decode(4, DType::kF32)},
        std::pair{"decode/gqa32-8/k16384/b8/q1/bf16", gqa_decode(1, DType::kBF16, 8)},
        std::pair{"decode/gqa32-8/k16384/q1/int8", gqa_decode(1, DType::kI8)},
        std::pair{"decode/gqa32-8/k16384/q1/fp8_e4m3", gqa_decode(1, DType::kFp8E4M3)},
        std::pair{"decode/gqa32-8/k16384/b8/q1/int8", gqa_decode(1, DType::kI8, 8)},
        std::pair{"decode/gqa32-8/k16384/b8/q1/fp8_e4m3", gqa_decode(1, DType::kFp8E4M3, 8)},
        std::pair{"prefill/causal/gqa32-8/s2048/int8", gqa_prefill(8, DType::kI8)},
        std::pair{"mla/h128/k4096/q1/bf16", mla_decode(DType::kBF16)}})
    add_ratio(std::string("paired/invariant_over_default/") + name, invariant(shape), shape);
  // Thread scaling: the same shapes on one thread.
  add("threads1/prefill/causal/gqa32-8/s2048/f32", on_threads(gqa_prefill(8, DType::kF32), 1));
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
    add("threads1/decode/gqa32-8/k16384/q1/" + kv_name(kv), on_threads(gqa_decode(1, kv), 1));
  add("threads1/mla/h128/k4096/q1/f32", on_threads(mla_decode(DType::kF32), 1));
  // Per-token decode time from 4K to 64K keys.
  add("decode/gqa32-8/k4096/q1/f32", gqa_decode(1, DType::kF32, 1, 4096));
  add("decode/gqa32-8/k65536/q1/f32", gqa_decode(1, DType::kF32, 1, 65536));
  // Against the reference twin, on a size it finishes in reasonable time.
  Shape small = gqa_prefill(8, DType::kF32, 256);
  add("prefill/causal/gqa32-8/s256/f32", small);
  add("prefill/causal/gqa32-8/s256/f32/reference", small, Backend::kReference);
  add("smoke/prefill", [] {
    Shape s;
    s.seqlen_q = s.seqlen_k = 64;
    s.heads = 4;
    s.kv_heads = 2;
    s.d = s.dv = 32;
    s.causal = true;
    return s;
  }());
}

void ratio(const char* what, const std::string& num, const std::string& den, double scale = 1.0) {
  const auto& m = records();
  if (!m.count(num) || !m.count(den)) return;
  std::printf("  %-52s %.3f\n", what, scale * m.at(num).seconds / m.at(den).seconds);
}

void summary() {
  // (threads, vector bits) -> (before, after)
  std::map<std::pair<int, int>, std::pair<Limits, Limits>> lim;
  for (const auto& [name, r] : records()) {
    const std::pair key{r.threads, r.bits};
    if (!lim.count(key)) lim[key] = {limits(r.threads, r.bits), measure_limits(r.threads, r.bits)};
  }
  std::printf(
      "\nsummary: best time per call; fractions of the higher of the limits measured\n"
      "before and after the run, on the benchmark's thread count and vector width\n"
      "(bits: the FMA peak of the vectors its kernels use):\n");
  for (const auto& [key, ba] : lim)
    std::printf(
        "  %d thread(s), %d-bit: before %.1f GFLOP/s, %.1f GB/s; after %.1f GFLOP/s, %.1f GB/s\n",
        key.first, key.second, ba.first.fma_gflops, ba.first.dram_gbs, ba.second.fma_gflops,
        ba.second.dram_gbs);
  std::printf("  %-46s %3s %4s %10s %9s %8s %8s %8s %8s\n", "benchmark", "thr", "bits", "ms",
              "GFLOP/s", "of peak", "GB/s", "of DRAM", "of read");
  for (const auto& [name, r] : records()) {
    const auto& [before, after] = lim.at({r.threads, r.bits});
    const double peak = std::max(before.fma_gflops, after.fma_gflops);
    const double bw = std::max(before.dram_gbs, after.dram_gbs);
    const double gflops = r.flops / r.seconds / 1e9, gbs = r.kv_bytes / r.seconds / 1e9;
    std::printf("  %-46s %3d %4d %10.3f %9.1f %8.3f", name.c_str(), r.threads, r.bits,
                r.seconds * 1e3, gflops, gflops / peak);
    if (r.decode) std::printf(" %8.1f %8.3f %8.3f", gbs, gbs / bw, r.paired_median());
    std::printf("\n");
  }
  std::printf("ratios of best time per call:\n");
  ratio("decode q4 / q1 (f32)", "decode/gqa32-8/k16384/q4/f32", "decode/gqa32-8/k16384/q1/f32");
  ratio("decode q16 / q1 (f32)", "decode/gqa32-8/k16384/q16/f32", "decode/gqa32-8/k16384/q1/f32");
  ratio("decode q4 / q1 (bf16)", "decode/gqa32-8/k16384/q4/bf16", "decode/gqa32-8/k16384/q1/bf16");
  ratio("decode q4 / q1 (f32, batch 8)", "decode/gqa32-8/k16384/b8/q4/f32",
        "decode/gqa32-8/k16384/b8/q1/f32");
  ratio("decode per key, 4K / 16K keys", "decode/gqa32-8/k4096/q1/f32",
        "decode/gqa32-8/k16384/q1/f32", 4.0);
  ratio("decode per key, 64K / 16K keys", "decode/gqa32-8/k65536/q1/f32",
        "decode/gqa32-8/k16384/q1/f32", 0.25);
  ratio("prefill GQA / MHA (same query heads, s1024)", "prefill/causal/gqa32-8/s1024/f32",
        "prefill/causal/mha32/s1024/f32");
  ratio("prefill MQA / MHA (same query heads, s1024)", "prefill/causal/mqa32-1/s1024/f32",
        "prefill/causal/mha32/s1024/f32");
  ratio("speedup 1 -> default threads, prefill GQA s2048",
        "threads1/prefill/causal/gqa32-8/s2048/f32", "prefill/causal/gqa32-8/s2048/f32");
  ratio("speedup 1 -> default threads, decode q1 f32", "threads1/decode/gqa32-8/k16384/q1/f32",
        "decode/gqa32-8/k16384/q1/f32");
  ratio("speedup 1 -> default threads, absorbed MLA f32", "threads1/mla/h128/k4096/q1/f32",
        "mla/h128/k4096/q1/f32");
  ratio("prefill reference / fast (s256)", "prefill/causal/gqa32-8/s256/f32/reference",
        "prefill/causal/gqa32-8/s256/f32");
  if (paired_ratios().empty()) return;
  std::printf("paired ratios (calls alternated; median [quartiles] of per-pair ratios):\n");
  for (auto [name, v] : paired_ratios()) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    std::printf("  %-52s %.3f [%.3f, %.3f] over %zu pairs\n", name.c_str(), v[n / 2], v[n / 4],
                v[(3 * n) / 4], n);
  }
}

}  // namespace
}  // namespace attnkit

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  attnkit::register_all();
  const attnkit::SimdTarget target = attnkit::default_target();
  const int bits = attnkit::vector_bits(target);
  const attnkit::Limits& lim = attnkit::limits(attnkit::bench_threads(), bits);
  std::printf(
      "threads %d, kernels %s; measured fp32 FMA peak %.1f GFLOP/s (%d-bit), DRAM read %.1f GB/s\n",
      attnkit::bench_threads(), attnkit::simd_target_name(target), lim.fma_gflops, bits,
      lim.dram_gbs);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  attnkit::summary();
  return 0;
}
