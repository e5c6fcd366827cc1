// dsa_decode_bench: one decode step's attention at DeepSeek-V3.2's layer
// shape, dense absorbed MLA vs DeepSeek sparse attention (DSA), over the
// same cache of L tokens (public API only, random data).
//
//   dsa_decode_bench [--contexts 8192,32768,65536] [--reps 5] [--threads 0]
//                    [--cache f32|bf16] [--cold 0|1]
//
// dense: sdpa over the whole latent cache in the absorbed form (128 heads,
//        key = the 576-value latent row, value = its first 512 values).
// dsa:   lightning_indexer_topk (64 heads x 128 fp8 over every cached
//        indexer key, top 2048) + sdpa with key_indices over the chosen
//        latent rows, read in place.
// read:  the paired memory read: every byte the indexer pass reads (fp8
//        codes and scales of every cached token), summed as 64-bit words
//        on as many threads, right after the DSA run; idx_rate = read_s /
//        indexer_s is the indexer's fraction of that read's speed.
// --threads 1 adds cpu_rate, the same ratio of the calling thread's CPU
// seconds (CLOCK_THREAD_CPUTIME_ID): on a machine shared with other work a
// 2 ms read fits in one time slice where a longer indexer pass is
// preempted, which wall seconds charge to the indexer.
// The projections both share (and the indexer's own, ~14M MACs per token)
// are not timed. Runs are paired and alternate which goes first; each
// cell is the median over --reps of wall seconds; dsa/dense and idx_rate
// are medians of the per-rep ratios.
// --cold 1 reads a buffer of twice the last-level cache (1 GiB where the
// OS does not say) before each DSA run and before each read, so that the
// indexer pass and its paired read both find their bytes in DRAM, as a
// decode step of a whole model does (at 128K tokens each of V3.2's 61
// layers has 17 MB of indexer keys). By default the read follows the DSA
// run and finds those bytes as the indexer left them, while the indexer
// follows the dense pass (300 MB) on every other rep: a stricter pairing.
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/sparse_attention.h"
#include "bench_stats.h"
#include "dsa_setup.h"

namespace {

using attnkit::Backend;
using attnkit::DType;
using attnkit::make_view;
using attnkit::TensorView;

// DeepSeek-V3.2's sizes, Fill and seconds_since (dsa_setup.h).
using namespace attnkit::bench::dsa;

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Sum of the 64-bit words of each of `parts` (sizes multiples of 8) on
// `threads` threads (the caller's one of them), so the read cannot be
// elided; returns the wall seconds of the read alone: the helper threads
// are started before the clock and spin until it starts.
double read_words(const std::vector<std::pair<const uint8_t*, size_t>>& parts, int threads,
                  uint64_t* sink) {
  std::atomic<bool> go{false};
  std::atomic<int> done{0};
  std::vector<uint64_t> sums(static_cast<size_t>(threads), 0);
  const auto work = [&](int t) {
    uint64_t a[8] = {};
    for (const auto& [p, bytes] : parts) {
      const size_t words = bytes / 8, per = (words + static_cast<size_t>(threads) - 1) / threads;
      const size_t w0 = std::min(words, per * static_cast<size_t>(t)),
                   w1 = std::min(words, w0 + per);
      size_t w = w0;
      for (; w + 8 <= w1; w += 8)
        for (size_t l = 0; l < 8; ++l) {
          uint64_t x;
          std::memcpy(&x, p + 8 * (w + l), 8);
          a[l] += x;
        }
      for (; w < w1; ++w) {
        uint64_t x;
        std::memcpy(&x, p + 8 * w, 8);
        a[0] += x;
      }
    }
    for (int l = 0; l < 8; ++l) sums[static_cast<size_t>(t)] += a[l];
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] {
      while (!go.load(std::memory_order_acquire)) {
      }
      work(t);
      done.fetch_add(1, std::memory_order_release);
    });
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  work(0);
  while (done.load(std::memory_order_acquire) < threads - 1) {
  }
  const double seconds = seconds_since(t0);
  for (std::thread& th : pool) th.join();
  for (uint64_t s : sums) *sink += s;
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {8192, 32768, 65536};
  int reps = 5, threads = 0;
  bool cold = false;
  DType cache_dtype = DType::kF32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--contexts") {
      contexts.clear();
      for (size_t p = 0; p < v.size();) {
        const size_t e = std::min(v.find(',', p), v.size());
        contexts.push_back(std::stoll(v.substr(p, e - p)));
        p = e + 1;
      }
    } else if (a == "--reps") {
      reps = std::stoi(v);
    } else if (a == "--threads") {
      threads = std::stoi(v);
    } else if (a == "--cold") {
      cold = v == "1";
    } else if (a == "--cache") {
      cache_dtype = v == "bf16" ? DType::kBF16 : DType::kF32;
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::printf("# %s; cache %s; %d reps; threads %d (0 = all); %s\n",
              attnkit::bench::cpu_name().c_str(), attnkit::dtype_name(cache_dtype), reps, threads,
              cold ? "indexer and read from DRAM (--cold 1)" : "read after the indexer");
  std::printf("%10s %12s %12s %12s %10s %12s %10s%s\n", "context", "dense_s", "dsa_s", "indexer_s",
              "dsa/dense", "read_s", "idx_rate", threads == 1 ? "   cpu_rate" : "");
  const int read_threads =
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  uint64_t sink = 0;
  Fill fill;
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  std::vector<uint8_t> evict(cold ? (llc > 0 ? 2 * static_cast<size_t>(llc) : size_t{1} << 30) : 0,
                             1);
  const auto evict_caches = [&] {
    if (cold) read_words({{evict.data(), evict.size()}}, read_threads, &sink);
  };
  for (const int64_t L : contexts) {
    // Latent cache [1, L, 1, 576]; value = the first 512 of each row.
    const size_t esz = cache_dtype == DType::kF32 ? 4 : 2;
    std::vector<char> latent(static_cast<size_t>(L * kRow) * esz);
    if (cache_dtype == DType::kF32) {
      auto* p = reinterpret_cast<float*>(latent.data());
      for (int64_t e = 0; e < L * kRow; ++e) p[e] = fill.next();
    } else {
      auto* p = reinterpret_cast<attnkit::bf16*>(latent.data());
      for (int64_t e = 0; e < L * kRow; ++e) p[e] = attnkit::float_to_bf16(fill.next());
    }
    TensorView k = make_view(latent.data(), cache_dtype, {1, L, 1, kRow});
    TensorView v = make_view(latent.data(), cache_dtype, {1, L, 1, kLatent});
    v.strides = k.strides;
    std::vector<float> q(kHeads * kRow), out(kHeads * kLatent);
    for (float& e : q) e = fill.next() * 0.05f;
    // Indexer: fp8 keys for every token, one query. The keys in a library
    // Tensor, on a 64-byte line as LatentCache holds them (a std::vector's
    // 16 MB sit 16 bytes into a page, and every row's 64-byte loads would
    // then split two cache lines).
    attnkit::Result<attnkit::Tensor> kc_tensor =
        attnkit::Tensor::zeros(DType::kFp8E4M3, {1, L, kIndexDim});
    if (!kc_tensor.ok()) std::abort();
    const std::span<uint8_t> kc(static_cast<uint8_t*>(kc_tensor.value().data()),
                                static_cast<size_t>(L * kIndexDim));
    std::vector<uint8_t> qc(kIndexHeads * kIndexDim);
    for (auto& e : kc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
    for (auto& e : qc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
    std::vector<float> ks(static_cast<size_t>(L), 0.01f), qs(kIndexHeads, 0.01f), w(kIndexHeads);
    for (float& e : w) e = fill.next();
    std::vector<int32_t> idx(kTopk);

    attnkit::AttentionOptions dense;
    dense.softmax_scale = 0.1f;
    dense.causal = true;
    dense.num_threads = threads;
    attnkit::AttentionOptions sparse = dense;
    sparse.key_indices = make_view(idx.data(), DType::kI32, {1, 1, kTopk});
    attnkit::IndexerOptions io;
    io.num_threads = threads;
    const TensorView qv = make_view(q.data(), DType::kF32, {1, 1, kHeads, kRow});
    const TensorView ov = make_view(out.data(), DType::kF32, {1, 1, kHeads, kLatent});

    const auto run_dense = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      if (!attnkit::sdpa(qv, k, v, ov, dense).ok()) std::abort();
      return seconds_since(t0);
    };
    double index_s = 0, index_cpu = 0;
    const auto run_dsa = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = thread_cpu_seconds();
      const attnkit::Status st = attnkit::lightning_indexer_topk(
          make_view(qc.data(), DType::kFp8E4M3, {1, 1, kIndexHeads, kIndexDim}),
          make_view(qs.data(), DType::kF32, {1, 1, kIndexHeads, 1}),
          make_view(w.data(), DType::kF32, {1, 1, kIndexHeads}),
          make_view(kc.data(), DType::kFp8E4M3, {1, L, kIndexDim}),
          make_view(ks.data(), DType::kF32, {1, L, 1}), kTopk,
          make_view(idx.data(), DType::kI32, {1, 1, kTopk}), {}, io);
      if (!st.ok()) std::abort();
      index_s = seconds_since(t0);
      index_cpu = thread_cpu_seconds() - c0;
      if (!attnkit::sdpa(qv, k, v, ov, sparse).ok()) std::abort();
      return seconds_since(t0);
    };
    // The indexer's own buffers, read where the indexer reads them.
    const auto run_read = [&] {
      return read_words({{kc.data(), kc.size()},
                         {reinterpret_cast<const uint8_t*>(ks.data()), ks.size() * sizeof(float)}},
                        read_threads, &sink);
    };
    std::vector<double> d, s, ix, ratio, rd, rate, cpu_rate;
    run_dense();  // warm
    run_dsa();
    for (int r = 0; r < reps; ++r) {
      double td, ts;
      if (r % 2) {
        evict_caches();
        ts = run_dsa();
        td = run_dense();
      } else {
        td = run_dense();
        evict_caches();
        ts = run_dsa();
      }
      d.push_back(td);
      s.push_back(ts);
      ix.push_back(index_s);
      ratio.push_back(ts / td);
      evict_caches();
      const double c0 = thread_cpu_seconds();
      const double tr = run_read();
      cpu_rate.push_back((thread_cpu_seconds() - c0) / index_cpu);
      rd.push_back(tr);
      rate.push_back(tr / index_s);
    }
    std::printf("%10lld %12.5f %12.5f %12.5f %10.3f %12.6f %10.3f", static_cast<long long>(L),
                attnkit::bench::median(d), attnkit::bench::median(s), attnkit::bench::median(ix),
                attnkit::bench::median(ratio), attnkit::bench::median(rd),
                attnkit::bench::median(rate));
    if (threads == 1) std::printf(" %10.3f", attnkit::bench::median(cpu_rate));
    std::printf("\n");
    std::fflush(stdout);
  }
  return sink == 42 ? 1 : 0;  // uses the sums, so that the reads stay
}
