// The paged KV pool's speed targets (docs/PAGED.md), as ratios of calls
// alternated in one process, so that the machine's moment-to-moment speed
// cancels out. Public API only; no benchmark framework.
//
//   decode    GQA 32/8, head_dim 128, pages of 16 tokens (or argument 3), f32 and bf16:
//             a step through PagedKVCache (append 1 token per sequence,
//             attend, truncate back) against sdpa() over a dense cache of
//             the same tokens (KVCache's layout, seqlens_k for the ragged
//             batch) — batch 1 at 16K keys and batch 8 with lengths spread
//             over 1K-16K, each with a sequence's pages consecutive (a
//             fresh pool) and interleaved with another's (no two adjacent).
//             Both rotate over copies of their K/V totalling >= 1 GiB, so
//             that each call reads memory, not a cache.
//   mixed     one step of a 512-token prompt chunk (after 1K cached tokens)
//             and 31 decodes over 1K-16K keys as one attend() call, against
//             the same work as two calls (the chunk; the 31 decodes) and as
//             32 calls (each sequence alone).
//   pages     the bookkeeping of one decode step (append 1 token to 64
//             sequences, truncate them back) in pools of 2^10 and 2^20
//             pages: the same time, since it touches only the sequences'
//             last pages.
//   prefix    prefix caching's own cost, in ns per page (medians of
//             repeats): add_sequence of a 1025-token prompt whose 1024
//             first tokens are cached (a hit of 64 pages of 16, taken from
//             the LRU list and put back by remove), the same prompt with
//             nothing cached (a miss: one hash), and the keying of
//             appended pages (append with ids + store of 1024 tokens +
//             remove, in a pool with prefix caching minus one without, tiny
//             K/V); against one layer's decode step of one sequence at 4K
//             keys (GQA 32/8, head_dim 128, f32).
//
//   build/bench/paged_bench [threads, default 2] [pairs, default 25] [page size, default 16]
//                           [prefix: run only the prefix section]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/paged_kv_cache.h"
#include "bench_stats.h"

namespace {

using attnkit::DType;
using attnkit::PagedKVCache;
using attnkit::TensorView;
using Clock = std::chrono::steady_clock;

constexpr int64_t kHeads = 32, kKvHeads = 8, kDim = 128;
// Tokens per page of the decode and mixed pools (argument 3, default 16).
int64_t g_page_size = 16;
constexpr size_t kRotateBytes = size_t{1} << 30;

void check(const attnkit::Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "paged_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

double seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Median and quartiles of a/b over `pairs` alternated pairs (the order
// flipped every pair, so neither always runs on the other's heels).
void report(const char* what, int pairs, const std::function<void()>& a,
            const std::function<void()>& b) {
  a();
  b();
  std::vector<double> ratios;
  for (int p = 0; p < pairs; ++p) {
    double ta, tb;
    if (p % 2 == 0) {
      ta = seconds(a);
      tb = seconds(b);
    } else {
      tb = seconds(b);
      ta = seconds(a);
    }
    ratios.push_back(ta / tb);
  }
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  std::printf("  %-62s %.3f [%.3f, %.3f]\n", what, ratios[n / 2], ratios[n / 4], ratios[3 * n / 4]);
}

float random_value(std::mt19937& rng) { return std::uniform_real_distribution<float>(-1, 1)(rng); }

struct PagedSet {
  PagedKVCache pool;
  std::vector<std::vector<int64_t>> ids;  // [copy][sequence]
  std::vector<int64_t> lengths;
};

// Sequences of the given lengths, `copies` times over, in one pool, K/V
// written with store(). Contiguous: each sequence filled at once, so a
// fresh pool hands it consecutive pages (which the kernel reads as one
// run). Interleaved: the sequences of a copy (and, for a single sequence, a
// second one that is never attended) take one page each in turn, so no two
// pages of a sequence are adjacent: the worst case for the walk.
PagedSet make_paged(const std::vector<int64_t>& lengths, int copies, DType dtype,
                    bool interleaved = false) {
  std::vector<int64_t> filled = lengths;
  if (interleaved && filled.size() == 1) filled.push_back(filled[0]);
  int64_t pages = 0;
  for (int64_t n : filled) pages += (n + 1 + g_page_size - 1) / g_page_size + 1;
  attnkit::PagedKVCacheSpec spec;
  spec.num_pages = pages * copies;
  spec.page_size = g_page_size;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kDim;
  spec.dtype = dtype;
  auto pool = PagedKVCache::create(spec);
  check(pool.status(), "create");
  PagedSet set{std::move(pool).value(), {}, lengths};
  std::mt19937 rng(1);
  const int64_t chunk = interleaved ? g_page_size : 2048;
  std::vector<float> kv(size_t(chunk * kKvHeads * kDim));
  for (float& x : kv) x = random_value(rng);
  for (int c = 0; c < copies; ++c) {
    std::vector<int64_t> ids, done(filled.size(), 0);
    for (size_t s = 0; s < filled.size(); ++s) ids.push_back(set.pool.add_sequence());
    set.ids.emplace_back(ids.begin(), ids.begin() + int64_t(lengths.size()));
    for (bool more = true; more;) {
      more = false;
      for (size_t s = 0; s < filled.size(); ++s) {
        const int64_t t = std::min(chunk, filled[s] - done[s]);
        if (t == 0) continue;
        more = true;
        check(set.pool.append(std::vector<int64_t>{ids[s]}, std::vector<int64_t>{t}), "append");
        check(set.pool.store(0, attnkit::make_view(kv.data(), DType::kF32, {t, kKvHeads, kDim}),
                             attnkit::make_view(kv.data(), DType::kF32, {t, kKvHeads, kDim}),
                             std::vector<int32_t>{0, int32_t(t)}, std::vector<int64_t>{ids[s]}),
              "store");
        done[s] += t;
      }
    }
  }
  return set;
}

// One decode step of the given sequences: append `tokens` each, attend,
// truncate back.
struct Step {
  std::vector<float> q, kv, out;
  std::vector<int32_t> cu;
  std::vector<int64_t> counts;
};

void paged_step(PagedKVCache& pool, const std::vector<int64_t>& ids,
                const std::vector<int64_t>& tokens, Step& s, int threads) {
  s.cu.assign(1, 0);
  for (int64_t t : tokens) s.cu.push_back(s.cu.back() + int32_t(t));
  const int64_t total = s.cu.back();
  s.q.resize(size_t(total * kHeads * kDim), 0.5f);
  s.kv.resize(size_t(total * kKvHeads * kDim), 0.25f);
  s.out.resize(size_t(total * kHeads * kDim));
  std::vector<int64_t> before;
  for (int64_t id : ids) before.push_back(*pool.length(id));
  check(pool.append(ids, tokens), "append");
  attnkit::AttentionOptions o;
  o.num_threads = threads;
  check(pool.attend(0, attnkit::make_view(s.q.data(), DType::kF32, {total, kHeads, kDim}),
                    attnkit::make_view(s.kv.data(), DType::kF32, {total, kKvHeads, kDim}),
                    attnkit::make_view(s.kv.data(), DType::kF32, {total, kKvHeads, kDim}), s.cu,
                    ids, attnkit::make_view(s.out.data(), DType::kF32, {total, kHeads, kDim}), o),
        "attend");
  for (size_t i = 0; i < ids.size(); ++i) check(pool.truncate(ids[i], before[i]), "truncate");
}

// Dense K/V in KVCache's layout, `copies` times over: [batch, max_len, ...].
struct DenseSet {
  std::vector<attnkit::Tensor> k, v;
  std::vector<int32_t> lengths;
  int64_t max_len = 0;
};

DenseSet make_dense(const std::vector<int64_t>& lengths, int copies, DType dtype) {
  DenseSet d;
  for (int64_t n : lengths) {
    d.lengths.push_back(int32_t(n));
    d.max_len = std::max(d.max_len, n);
  }
  const int64_t batch = int64_t(lengths.size());
  const int64_t stride = attnkit::kv_token_stride(kKvHeads, kDim, dtype);
  std::mt19937 rng(2);
  for (int c = 0; c < copies; ++c)
    for (auto* t : {&d.k, &d.v}) {
      auto buf = attnkit::Tensor::zeros(dtype, {batch, d.max_len, stride});
      check(buf.status(), "dense alloc");
      t->push_back(std::move(buf).value());
      // Values in [-1, 1), as the pool's (a subnormal fp32 value would
      // slow the dense side's arithmetic down instead).
      const int64_t n = t->back().numel();
      for (int64_t i = 0; i < n; ++i) {
        const float x = random_value(rng);
        if (dtype == DType::kBF16)
          t->back().ptr<attnkit::bf16>()[i] = attnkit::float_to_bf16(x);
        else
          t->back().ptr<float>()[i] = x;
      }
    }
  return d;
}

void dense_step(const DenseSet& d, int copy, Step& s, int threads, DType dtype) {
  const int64_t batch = int64_t(d.lengths.size());
  s.q.resize(size_t(batch * kHeads * kDim), 0.5f);
  s.out.resize(s.q.size());
  attnkit::AttentionOptions o;
  o.causal = true;
  o.seqlens_k = d.lengths;
  o.num_threads = threads;
  const TensorView k =
      attnkit::kv_cache_view(d.k[size_t(copy)].data(), dtype, batch, d.max_len, kKvHeads, kDim);
  const TensorView v =
      attnkit::kv_cache_view(d.v[size_t(copy)].data(), dtype, batch, d.max_len, kKvHeads, kDim);
  check(attnkit::sdpa(attnkit::make_view(s.q.data(), DType::kF32, {batch, 1, kHeads, kDim}), k, v,
                      attnkit::make_view(s.out.data(), DType::kF32, {batch, 1, kHeads, kDim}), o),
        "sdpa");
}

void decode_vs_dense(const char* name, const std::vector<int64_t>& lengths, DType dtype,
                     bool interleaved, int threads, int pairs) {
  int64_t tokens = 0;
  for (int64_t n : lengths) tokens += n;
  const size_t set_bytes = size_t(tokens) * kKvHeads * kDim * 2 * attnkit::dtype_size(dtype);
  const int copies = int(std::max<size_t>(1, (kRotateBytes + set_bytes - 1) / set_bytes));
  PagedSet paged = make_paged(lengths, copies, dtype, interleaved);
  const DenseSet dense = make_dense(lengths, copies, dtype);
  Step ps, ds;
  int next_paged = 0, next_dense = 0;
  const std::vector<int64_t> ones(lengths.size(), 1);
  const std::string what = std::string(name) + " " + attnkit::dtype_name(dtype) +
                           (interleaved ? ", interleaved" : ", contiguous") +
                           " pages: paged / dense (" + std::to_string(copies) + " copies)";
  report(
      what.c_str(), pairs,
      [&] {
        paged_step(paged.pool, paged.ids[size_t(next_paged)], ones, ps, threads);
        next_paged = (next_paged + 1) % copies;
      },
      [&] {
        dense_step(dense, next_dense, ds, threads, dtype);
        next_dense = (next_dense + 1) % copies;
      });
}

void mixed_step(int threads, int pairs) {
  std::mt19937 rng(3);
  std::vector<int64_t> lengths{1024};  // the prompt's first 1K tokens, already cached
  for (int s = 0; s < 31; ++s) lengths.push_back(1024 + int64_t(rng() % (15 * 1024)));
  PagedSet set = make_paged(lengths, 1, DType::kF32);
  std::vector<int64_t> tokens(lengths.size(), 1);
  tokens[0] = 512;
  const std::vector<int64_t>& ids = set.ids[0];
  const std::vector<int64_t> decode_ids(ids.begin() + 1, ids.end());
  const std::vector<int64_t> decode_tokens(tokens.begin() + 1, tokens.end());
  Step a, b, c;
  report(
      "mixed: 512-token chunk + 31 decodes, one call / two calls", pairs,
      [&] { paged_step(set.pool, ids, tokens, a, threads); },
      [&] {
        paged_step(set.pool, {ids[0]}, {512}, b, threads);
        paged_step(set.pool, decode_ids, decode_tokens, c, threads);
      });
  report(
      "mixed: 512-token chunk + 31 decodes, one call / 32 calls", pairs,
      [&] { paged_step(set.pool, ids, tokens, a, threads); },
      [&] {
        for (size_t s = 0; s < ids.size(); ++s)
          paged_step(set.pool, {ids[s]}, {tokens[s]}, b, threads);
      });
}

// Bookkeeping only: append 1 token to 64 sequences twice and truncate
// back, 100 times, in a small and a large pool (tiny pages: head_dim 8, one
// kv head), the two alternated by report().
struct Bookkeeping {
  explicit Bookkeeping(int64_t num_pages) {
    attnkit::PagedKVCacheSpec spec;
    spec.num_pages = num_pages;
    spec.page_size = 16;
    spec.num_kv_heads = 1;
    spec.head_dim = 8;
    auto created = PagedKVCache::create(spec);
    check(created.status(), "create");
    pool.emplace(std::move(created).value());
    for (int s = 0; s < 64; ++s) ids.push_back(pool->add_sequence());
    // 15 tokens each: the next token fills the page, the one after opens a new one.
    check(pool->append(ids, std::vector<int64_t>(64, 15)), "append");
  }
  void step() {
    const std::vector<int64_t> ones(64, 1);
    for (int i = 0; i < 100; ++i) {
      check(pool->append(ids, ones), "append");
      check(pool->append(ids, ones), "append");
      for (int64_t id : ids) check(pool->truncate(id, 15), "truncate");
    }
  }
  std::optional<PagedKVCache> pool;
  std::vector<int64_t> ids;
};

// Median seconds per call of f over `repeats` timed runs of `calls` calls.
double per_call(int repeats, int calls, const std::function<void()>& f) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r)
    t.push_back(seconds([&] {
                  for (int c = 0; c < calls; ++c) f();
                }) /
                calls);
  return attnkit::bench::median(t);
}

PagedKVCache prefix_pool(int64_t pages, bool caching, int64_t heads, int64_t dim) {
  attnkit::PagedKVCacheSpec spec;
  spec.num_pages = pages;
  spec.page_size = 16;
  spec.num_kv_heads = heads;
  spec.head_dim = dim;
  spec.prefix_caching = caching;
  auto pool = PagedKVCache::create(spec);
  check(pool.status(), "create");
  return std::move(pool).value();
}

// Appends `tokens` (ids given) to a new sequence, stores their K/V (kv:
// at least tokens rows of the pool's width) and returns its id.
int64_t fill(PagedKVCache& pool, const std::vector<int32_t>& tokens, std::vector<float>& kv) {
  const int64_t id = pool.add_sequence();
  const int64_t n = int64_t(tokens.size()), h = pool.spec().num_kv_heads, d = pool.spec().head_dim;
  check(pool.append(std::vector<int64_t>{id}, std::vector<int64_t>{n}, tokens), "append");
  const TensorView v = attnkit::make_view(kv.data(), DType::kF32, {n, h, d});
  check(pool.store(0, v, v, std::vector<int32_t>{0, int32_t(n)}, std::vector<int64_t>{id}),
        "store");
  return id;
}

void prefix_costs(int threads, int pairs) {
  std::mt19937 rng(4);
  std::vector<int32_t> prompt(1025);
  for (int32_t& t : prompt) t = int32_t(rng() % 128000);
  std::vector<float> kv(size_t(1024 * 8), 0.5f);
  const std::vector<int32_t> first(prompt.begin(), prompt.end() - 1);
  // Hit and miss: 64 pages cached-free, then add_sequence + remove.
  PagedKVCache pool = prefix_pool(1024, true, 1, 8);
  check(pool.remove(fill(pool, first, kv)), "remove");
  std::vector<int32_t> other = prompt;
  other[0] += 1;  // misses at its first page
  int64_t cached = 0;
  const double hit = per_call(pairs, 200, [&] {
    const attnkit::PrefixMatch m = pool.add_sequence(prompt).value();
    cached = m.cached_tokens;
    check(pool.remove(m.seq_id), "remove");
  });
  const double miss = per_call(
      pairs, 200, [&] { check(pool.remove(pool.add_sequence(other).value().seq_id), "remove"); });
  if (cached != 1024) check(attnkit::Status(attnkit::StatusCode::kInternal, "no hit"), "hit");
  // Keying: the same fill in pools with and without prefix caching (the
  // former also evicts the pages the call before left cached).
  PagedKVCache keyed = prefix_pool(1024, true, 1, 8), plain = prefix_pool(1024, false, 1, 8);
  const double with =
      per_call(pairs, 50, [&] { check(keyed.remove(fill(keyed, first, kv)), "rm"); });
  const double without =
      per_call(pairs, 50, [&] { check(plain.remove(fill(plain, first, kv)), "rm"); });
  // One layer's decode step of one sequence at 4K keys (GQA 32/8, 128).
  PagedSet set = make_paged({4096}, 1, DType::kF32);
  Step st;
  const double decode =
      per_call(pairs, 20, [&] { paged_step(set.pool, set.ids[0], {1}, st, threads); });
  std::printf("  prefix hit of 1024 tokens: add_sequence + remove  %8.1f ns per page\n",
              hit * 1e9 / 64);
  std::printf("  prefix miss (1025-token prompt): add_sequence + remove %8.1f ns\n", miss * 1e9);
  std::printf(
      "  keying on append (fill 1024 tokens, cached - plain)  %8.1f ns per page "
      "(%.1f vs %.1f us a fill)\n",
      (with - without) * 1e9 / 64, with * 1e6, without * 1e6);
  std::printf(
      "  one layer's decode step, 1 sequence at 4K keys       %8.1f us; keying a page = "
      "%.2f %% of it, a 1024-token hit = %.2f %%\n",
      decode * 1e6, 100.0 * (with - without) / 64 / decode, 100.0 * hit / decode);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::max(1, std::atoi(argv[1])) : 2;
  const int pairs = argc > 2 ? std::max(3, std::atoi(argv[2])) : 25;
  if (argc > 3) g_page_size = std::max(1, std::atoi(argv[3]));
  std::printf(
      "paged_bench: %s, %d threads, %d pairs, pages of %lld tokens; median [quartiles] of paired "
      "ratios\n",
      attnkit::bench::cpu_name().c_str(), threads, pairs, static_cast<long long>(g_page_size));
  if (argc > 4 && std::string(argv[4]) == "prefix") {
    prefix_costs(threads, pairs);
    return 0;
  }
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (bool interleaved : {false, true})
      decode_vs_dense("batch 1, 16K keys", {16384}, dtype, interleaved, threads, pairs);
    std::vector<int64_t> ragged;
    for (int s = 0; s < 8; ++s) ragged.push_back(1024 + s * 15 * 1024 / 7);
    for (bool interleaved : {false, true})
      decode_vs_dense("batch 8, 1K-16K keys", ragged, dtype, interleaved, threads, pairs);
  }
  mixed_step(threads, pairs);
  Bookkeeping small(int64_t{1} << 10), large(int64_t{1} << 20);
  report(
      "bookkeeping of a 64-sequence step, 2^20 pages / 2^10", pairs, [&] { large.step(); },
      [&] { small.step(); });
  prefix_costs(threads, pairs);
  return 0;
}
