// PagedKVCache's prefix cache. The K, V and query of a token are a fixed
// function of (token id, position, layer), as a model's are, so a
// sequence's attention depends on its token ids alone: a request that takes
// its prefix from the cache must give the same bits as one that computed
// it, and every output row must equal the float64 oracle over the
// sequence's tokens. Between operations every plain free page is filled
// with NaN (cached-free pages keep their K/V), so a read of a page no one
// holds shows. Also: LRU order, eviction under pressure, the chain key,
// collisions (keys narrowed to a few bits), truncate and fork, stats, and
// every bad argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attnkit/paged_kv_cache.h"
#include "common/attention_bounds.h"
#include "common/attention_f64.h"
#include "common/paged_pool_state.h"
#include "common/random.h"

namespace {

using attnkit::DType;
using attnkit::PagedKVCache;
using attnkit::PagedKVCacheSpec;
using attnkit::PrefixCacheStats;
using attnkit::StatusCode;
using attnkit::TensorView;
using Tokens = std::vector<int32_t>;

struct Shape {
  const char* name;
  int64_t num_heads, num_kv_heads, head_dim, head_dim_v;
  int64_t kv_lora_rank = 0, qk_rope_head_dim = 0;
};
const Shape kGqa{"GQA", 4, 2, 8, 6};
const Shape kMla{"MLA", 4, 0, 0, 0, 8, 4};

PagedKVCacheSpec spec_for(const Shape& sh, int64_t layers, int64_t pages, int64_t page_size,
                          DType dtype = DType::kF32, bool caching = true) {
  PagedKVCacheSpec s;
  s.num_layers = layers;
  s.num_pages = pages;
  s.page_size = page_size;
  s.num_kv_heads = sh.num_kv_heads;
  s.head_dim = sh.head_dim;
  s.head_dim_v = sh.head_dim_v;
  s.kv_lora_rank = sh.kv_lora_rank;
  s.qk_rope_head_dim = sh.qk_rope_head_dim;
  s.dtype = dtype;
  s.prefix_caching = caching;
  return s;
}

// Element `index` of the K (which 0), V (1) or query (2) of token `token`
// at `position` in `layer`: uniform in [-1, 1), a hash of all five.
float model_value(int32_t token, int64_t position, int64_t layer, int which, int64_t index) {
  uint64_t x = uint64_t(uint32_t(token)) * 0x9e3779b97f4a7c15ull ^
               uint64_t(position) * 0xc2b2ae3d27d4eb4full ^ uint64_t(layer) << 56 ^
               uint64_t(which) << 60 ^ uint64_t(index) * 0x165667b19e3779f9ull;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return float(double(x >> 40) * 0x1p-23 - 1.0);
}

// Drives a pool as an engine would: each sequence's token ids are known to
// the test, and each step's K/V and queries come from model_value.
class Engine {
 public:
  Engine(const Shape& sh, const PagedKVCacheSpec& spec)
      : sh_(sh), pool_(PagedKVCache::create(spec).value()) {}
  PagedKVCache& pool() { return pool_; }
  const Tokens& tokens(int64_t id) const { return tokens_.at(id); }

  // A request: add_sequence(prompt), then the whole uncached rest of the
  // prompt in one step. Returns the id; *cached gets the cached tokens.
  int64_t request(const Tokens& prompt, int64_t* cached = nullptr,
                  std::vector<float>* out = nullptr) {
    const attnkit::PrefixMatch m = pool_.add_sequence(prompt).value();
    if (cached) *cached = m.cached_tokens;
    tokens_[m.seq_id] = prompt;
    EXPECT_TRUE(step({m.seq_id}, {int64_t(prompt.size()) - m.cached_tokens}, false, out));
    return m.seq_id;
  }

  // add_sequence(prompt) alone: the prompt is known, nothing is written.
  int64_t add(const Tokens& prompt) {
    const int64_t id = pool_.add_sequence(prompt).value().seq_id;
    tokens_[id] = prompt;
    return id;
  }

  // Appends counts[i] tokens to ids[i] (the tokens past its length in
  // tokens(id), extended with `more` when given) with their ids when
  // with_ids, attends every layer and checks every row against the oracle.
  // out (optional) gets every layer's rows.
  bool step(const std::vector<int64_t>& ids, const std::vector<int64_t>& counts, bool with_ids,
            std::vector<float>* out = nullptr) {
    std::vector<int32_t> new_ids;
    std::vector<int64_t> first;
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t len = pool_.length(ids[i]).value();
      first.push_back(len);
      const Tokens& t = tokens_.at(ids[i]);
      for (int64_t p = len; p < len + counts[i]; ++p) new_ids.push_back(t.at(size_t(p)));
    }
    attnkit_test::poison_free_pages(pool_);
    const attnkit::Status st =
        with_ids ? pool_.append(ids, counts, new_ids) : pool_.append(ids, counts);
    if (!st.ok()) {
      ADD_FAILURE() << st.to_string();
      return false;
    }
    attnkit_test::poison_free_pages(pool_);
    const PagedKVCacheSpec& s = pool_.spec();
    const int64_t H = sh_.num_heads, Hkv = s.num_kv_heads, D = s.head_dim, Dv = s.head_dim_v;
    std::vector<int32_t> cu{0};
    for (int64_t c : counts) cu.push_back(cu.back() + int32_t(c));
    const int64_t total = cu.back();
    for (int64_t l = 0; l < s.num_layers; ++l) {
      std::vector<float> q(size_t(total * H * D)), k(size_t(total * Hkv * D)),
          v(size_t(total * Hkv * Dv)), o(size_t(total * H * Dv));
      for (size_t i = 0; i < ids.size(); ++i)
        for (int64_t r = 0; r < counts[i]; ++r) {
          const int64_t row = cu[i] + r, pos = first[i] + r;
          const int32_t tok = tokens_.at(ids[i])[size_t(pos)];
          for (int64_t x = 0; x < H * D; ++x)
            q[size_t(row * H * D + x)] = model_value(tok, pos, l, 2, x);
          for (int64_t x = 0; x < Hkv * D; ++x)
            k[size_t(row * Hkv * D + x)] = model_value(tok, pos, l, 0, x);
          for (int64_t x = 0; x < Hkv * Dv; ++x)
            v[size_t(row * Hkv * Dv + x)] = model_value(tok, pos, l, 1, x);
        }
      const attnkit::Status a = pool_.attend(
          l, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
          attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
          s.latent() ? TensorView{} : attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}),
          cu, ids, attnkit::make_view(o.data(), DType::kF32, {total, H, Dv}));
      if (!a.ok()) {
        ADD_FAILURE() << a.to_string();
        return false;
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        if (counts[i] == 0) continue;
        const std::vector<double> want = oracle(ids[i], l, first[i], counts[i]);
        const std::vector<float> got(o.begin() + cu[i] * H * Dv, o.begin() + cu[i + 1] * H * Dv);
        const auto tol = attnkit_test::attention_tolerance(D, first[i] + counts[i], s.dtype,
                                                           attnkit::Backend::kAuto);
        if (!attnkit_test::all_close("out", got, want, tol)) {
          ADD_FAILURE() << "sequence " << ids[i] << " layer " << l << " rows from " << first[i]
                        << ": " << attnkit_test::all_close("out", got, want, tol).message();
          return false;
        }
      }
      if (out) out->insert(out->end(), o.begin(), o.end());
    }
    const std::string bad = attnkit_test::pool_state_error(pool_);
    EXPECT_EQ(bad, "");
    return bad.empty();
  }

  // Decodes `n` tokens of each sequence one step at a time, the ids drawn
  // from `next` and given to append().
  bool decode(const std::vector<int64_t>& ids, int n, const std::function<int32_t()>& next,
              std::vector<float>* out = nullptr) {
    for (int s = 0; s < n; ++s) {
      for (int64_t id : ids) tokens_.at(id).push_back(next());
      if (!step(ids, std::vector<int64_t>(ids.size(), 1), true, out)) return false;
    }
    return true;
  }

  int64_t fork(int64_t id) {
    const int64_t child = pool_.fork(id).value();
    tokens_[child] = tokens_.at(id);
    tokens_[child].resize(size_t(pool_.length(id).value()));
    return child;
  }
  void remove(int64_t id) {
    EXPECT_TRUE(pool_.remove(id).ok());
    tokens_.erase(id);
  }
  void truncate(int64_t id, int64_t to) {
    EXPECT_TRUE(pool_.truncate(id, to).ok());
    tokens_.at(id).resize(size_t(to));
  }
  // Replaces the tokens from the sequence's length on (what it will
  // append next).
  void set_next(int64_t id, const Tokens& more) {
    Tokens& t = tokens_.at(id);
    t.resize(size_t(pool_.length(id).value()));
    t.insert(t.end(), more.begin(), more.end());
  }

 private:
  // The float64 attention of tokens first ... first + n - 1 of a sequence
  // in `layer` over its tokens, as the pool stores K/V (bf16 rounded).
  std::vector<double> oracle(int64_t id, int64_t layer, int64_t first, int64_t n) const {
    const PagedKVCacheSpec& s = pool_.spec();
    const int64_t H = sh_.num_heads, Hkv = s.num_kv_heads, D = s.head_dim, Dv = s.head_dim_v;
    const Tokens& t = tokens_.at(id);
    const int64_t L = first + n;
    auto stored = [&](float x) {
      return s.dtype == DType::kBF16 ? double(attnkit_test::round_bf16(x)) : double(x);
    };
    std::vector<double> q, k, v;
    for (int64_t p = 0; p < L; ++p) {
      for (int64_t x = 0; x < Hkv * D; ++x)
        k.push_back(stored(model_value(t[size_t(p)], p, layer, 0, x)));
      for (int64_t x = 0; x < Hkv * Dv; ++x)
        v.push_back(s.latent() ? k[size_t(p * D + x)]
                               : stored(model_value(t[size_t(p)], p, layer, 1, x)));
    }
    for (int64_t p = first; p < L; ++p)
      for (int64_t x = 0; x < H * D; ++x) q.push_back(model_value(t[size_t(p)], p, layer, 2, x));
    attnkit_test::OracleOptions o;
    o.seqlen_q = n;
    o.seqlen_k = L;
    o.num_heads = H;
    o.num_kv_heads = Hkv;
    o.head_dim = D;
    o.head_dim_v = Dv;
    o.causal = true;
    return attnkit_test::attention_f64(o, q, k, v).out;
  }

  Shape sh_;
  PagedKVCache pool_;
  std::map<int64_t, Tokens> tokens_;
};

Tokens random_tokens(std::mt19937_64& rng, size_t n, int32_t vocab) {
  Tokens t(n);
  for (int32_t& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A second request with the prompt of a finished one takes its full pages
// (all but the last token's page) and gives the same bits as a pool without
// prefix caching that computed the same prefix in a step of its own; a
// third, while the second runs, shares its pages.
TEST(PagedPrefixCache, ASecondRequestReusesThePrefixAndGivesTheSameBits) {
  for (const Shape& sh : {kGqa, kMla})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string(sh.name) + " " + attnkit::dtype_name(dtype));
      std::mt19937_64 rng(7);
      const Tokens prompt = random_tokens(rng, 23, 1000);
      Engine e(sh, spec_for(sh, 2, 40, 4, dtype));
      int64_t cached = -1;
      const int64_t a = e.request(prompt, &cached);
      EXPECT_EQ(cached, 0);
      const std::vector<int32_t> table_a = e.pool().page_table(a).value();
      int32_t next = 500;
      ASSERT_TRUE(e.decode({a}, 3, [&] { return next++; }));
      e.remove(a);
      EXPECT_EQ(e.pool().prefix_cache_stats().cached_free_pages, 6);  // 26 tokens: 6 full pages

      // probe_prefix tells what add_sequence would take, changing nothing.
      const attnkit_test::PoolSnapshot before_probe = attnkit_test::snapshot(e.pool());
      const attnkit::PrefixProbe probe = e.pool().probe_prefix(prompt).value();
      EXPECT_EQ(probe.cached_tokens, 20);
      EXPECT_EQ(probe.cached_free_pages, 5);
      EXPECT_TRUE(attnkit_test::snapshot(e.pool()) == before_probe);
      std::vector<float> out_b, out_fresh;
      const int64_t free_before = e.pool().free_pages();
      const int64_t b = e.request(prompt, &cached, &out_b);
      EXPECT_EQ(e.pool().free_pages(), free_before - 5 - 1);  // 5 taken, 1 computed
      EXPECT_EQ(cached, 20);  // 5 of the 23 tokens' 6 pages; the last page is computed
      const std::vector<int32_t> table_b = e.pool().page_table(b).value();
      EXPECT_TRUE(std::equal(table_b.begin(), table_b.begin() + 5, table_a.begin()));
      next = 700;
      ASSERT_TRUE(e.decode(
          {b}, 5, [&] { return next++; }, &out_b));

      // The same tokens, computed, in a pool without prefix caching: the
      // prefix in a step of its own, then the same steps.
      Engine fresh(sh, spec_for(sh, 2, 40, 4, dtype, false));
      const int64_t f = fresh.request(Tokens(prompt.begin(), prompt.begin() + 20));
      fresh.set_next(f, Tokens(prompt.begin() + 20, prompt.end()));
      ASSERT_TRUE(fresh.step({f}, {3}, false, &out_fresh));
      next = 700;
      ASSERT_TRUE(fresh.decode(
          {f}, 5, [&] { return next++; }, &out_fresh));
      ASSERT_EQ(out_b.size(), out_fresh.size());
      EXPECT_EQ(0, std::memcmp(out_b.data(), out_fresh.data(), out_b.size() * sizeof(float)));

      EXPECT_EQ(e.pool().probe_prefix(prompt).value().cached_free_pages, 0);  // b holds them
      // A third request while b runs shares b's pages (not copies).
      const int64_t c = e.request(prompt, &cached);
      EXPECT_EQ(cached, 20);
      const std::vector<int32_t> table_c = e.pool().page_table(c).value();
      EXPECT_TRUE(std::equal(table_c.begin(), table_c.begin() + 5, table_b.begin()));
      // b's decoded tokens filled pages 5 and 6 (28 tokens): a prompt that
      // continues them takes those too.
      int64_t cached_d = 0;
      const Tokens longer = concat(e.tokens(b), {999});
      e.request(longer, &cached_d);
      EXPECT_EQ(cached_d, 28);
      const PrefixCacheStats st = e.pool().prefix_cache_stats();
      EXPECT_EQ(st.queries, 4);
      EXPECT_EQ(st.query_tokens, 23 * 3 + 29);
      EXPECT_EQ(st.hits, 3);
      EXPECT_EQ(st.hit_pages, 5 + 5 + 7);
      EXPECT_EQ(st.hit_tokens, 20 + 20 + 28);
      EXPECT_EQ(st.evictions, 0);
    }
}

// A prompt of exactly k pages takes k - 1: its last token must be computed
// (the engine needs its logits). Prompts of 0 or 1 tokens take nothing.
TEST(PagedPrefixCache, APromptOfWholePagesLeavesItsLastPageToCompute) {
  Engine e(kGqa, spec_for(kGqa, 1, 20, 4));
  const Tokens p{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  e.request(p);
  int64_t cached = -1;
  e.request(p, &cached);
  EXPECT_EQ(cached, 12);
  e.request(Tokens(p.begin(), p.begin() + 13), &cached);
  EXPECT_EQ(cached, 12);
  e.request(Tokens(p.begin(), p.begin() + 12), &cached);
  EXPECT_EQ(cached, 8);
  EXPECT_EQ(e.pool().add_sequence(Tokens{1}).value().cached_tokens, 0);
  EXPECT_EQ(e.pool().add_sequence(Tokens{}).value().cached_tokens, 0);
}

// Only full pages are keyed, and only once every layer wrote them.
TEST(PagedPrefixCache, OnlyFullPagesWrittenByEveryLayerAreKeyed) {
  Engine e(kGqa, spec_for(kGqa, 2, 20, 4));
  const Tokens p{5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  const int64_t a = e.request(p);
  EXPECT_EQ(e.pool().prefix_cache_stats().cached_pages, 2);  // the third page holds 2 of 4
  int64_t cached = -1;
  e.request(concat(p, {15, 16, 17, 18, 19}), &cached);
  EXPECT_EQ(cached, 8);  // not the partly filled page, though its 2 tokens match
  // Layer 0 alone writing a full page does not key it.
  const attnkit::PrefixMatch m = e.pool().add_sequence(Tokens{40, 41, 42, 43, 44}).value();
  ASSERT_TRUE(e.pool().append(std::vector<int64_t>{m.seq_id}, std::vector<int64_t>{4}).ok());
  std::vector<float> k(size_t(4 * 2 * 8), 0.5f), v(size_t(4 * 2 * 6), 0.5f);
  const std::vector<int32_t> cu{0, 4};
  const TensorView kv = attnkit::make_view(k.data(), DType::kF32, {4, 2, 8});
  const TensorView vv = attnkit::make_view(v.data(), DType::kF32, {4, 2, 6});
  const int64_t keyed = e.pool().prefix_cache_stats().cached_pages;
  ASSERT_TRUE(e.pool().store(0, kv, vv, cu, std::vector<int64_t>{m.seq_id}).ok());
  EXPECT_EQ(e.pool().prefix_cache_stats().cached_pages, keyed);
  ASSERT_TRUE(e.pool().store(1, kv, vv, cu, std::vector<int64_t>{m.seq_id}).ok());
  EXPECT_EQ(e.pool().prefix_cache_stats().cached_pages, keyed + 1);
  (void)a;
}

// The key chains the whole prefix: the same page content after another
// first page does not hit; a prefix that differs in its second page takes
// the first.
TEST(PagedPrefixCache, TheKeyChainsThePrefix) {
  Engine e(kGqa, spec_for(kGqa, 1, 30, 2));
  int64_t cached = -1;
  e.request({1, 2, 3, 4, 5, 6, 7});
  e.request({9, 9, 3, 4, 5, 6, 7}, &cached);
  EXPECT_EQ(cached, 0);
  e.request({1, 2, 3, 9, 5, 6, 7}, &cached);
  EXPECT_EQ(cached, 2);
  e.request({1, 2, 3, 4, 5, 6, 7, 8}, &cached);
  EXPECT_EQ(cached, 6);
}

// Keys narrowed to 0-2 bits collide all the time: the token ids and the
// parent stored with each page keep every lookup exact.
TEST(PagedPrefixCache, CollidingKeysNeverAlias) {
  for (uint64_t mask : {0ull, 1ull, 3ull}) {
    SCOPED_TRACE("key mask " + std::to_string(mask));
    Engine e(kGqa, spec_for(kGqa, 1, 60, 2));
    attnkit::PagedKVCacheTesting::set_key_mask(e.pool(), mask);
    int64_t cached = -1;
    const Tokens a{1, 2, 3, 4, 5, 6, 7}, b{1, 2, 8, 8, 5, 6, 7}, c{3, 4, 1, 2, 5, 6, 7};
    for (const Tokens& p : {a, b, c}) e.request(p);  // every row checked by the oracle
    e.request(a, &cached);
    EXPECT_LE(cached, 6);
    e.request(b, &cached);
    e.request(c, &cached);
    std::mt19937_64 rng(mask + 1);
    for (int i = 0; i < 30; ++i) {
      const Tokens p = random_tokens(rng, size_t(3 + rng() % 8), 3);
      const int64_t id = e.request(p, &cached);
      EXPECT_EQ(cached % 2, 0);
      if (i % 5 != 0) e.remove(id);
    }
  }
}

// Cached-free pages are evicted least recently freed first, a sequence's
// deepest page before its first; a hit takes a page out of the LRU list.
TEST(PagedPrefixCache, EvictsTheLeastRecentlyFreedPageFirst) {
  Engine e(kGqa, spec_for(kGqa, 1, 8, 2));
  const int64_t a = e.request({1, 2, 3, 4, 5});  // pages a0 a1 keyed, a2 partly filled
  const int64_t b = e.request({6, 7, 8, 9, 10});
  const std::vector<int32_t> ta = e.pool().page_table(a).value(),
                             tb = e.pool().page_table(b).value();
  e.remove(a);
  e.remove(b);
  EXPECT_EQ(e.pool().cached_free_pages(), (std::vector<int32_t>{ta[1], ta[0], tb[1], tb[0]}));
  EXPECT_EQ(e.pool().free_pages(), 8);
  int64_t cached = -1;
  const int64_t a2 = e.request({1, 2, 3, 4, 5}, &cached);  // takes a0 a1 back
  EXPECT_EQ(cached, 4);
  EXPECT_EQ(e.pool().cached_free_pages(), (std::vector<int32_t>{tb[1], tb[0]}));
  e.remove(a2);
  EXPECT_EQ(e.pool().cached_free_pages(), (std::vector<int32_t>{tb[1], tb[0], ta[1], ta[0]}));
  // 8 free pages: 4 plain, then b1, b0, a1, a0 in that order. 12 new
  // tokens take 6: the plain ones, then b1 and b0.
  const Tokens c_prompt{100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111};
  const int64_t c = e.request(c_prompt);
  EXPECT_EQ(e.pool().prefix_cache_stats().evictions, 2);
  EXPECT_EQ(e.pool().cached_free_pages(), (std::vector<int32_t>{ta[1], ta[0]}));
  const std::vector<int32_t> tc = e.pool().page_table(c).value();
  e.remove(c);  // its 6 full pages join the list, the deepest first
  EXPECT_EQ(e.pool().cached_free_pages(),
            (std::vector<int32_t>{ta[1], ta[0], tc[5], tc[4], tc[3], tc[2], tc[1], tc[0]}));
  const int64_t a3 = e.request({1, 2, 3, 4, 5}, &cached);  // a0 a1 hit; evicts c5
  EXPECT_EQ(cached, 4);
  EXPECT_EQ(e.pool().prefix_cache_stats().evictions, 3);
  EXPECT_EQ(e.pool().page_table(a3).value()[2], tc[5]);
  e.request({6, 7, 8, 9, 10}, &cached);  // b's pages were evicted; evicts c4, c3, c2
  EXPECT_EQ(cached, 0);
  e.remove(a3);
  EXPECT_EQ(e.pool().add_sequence(c_prompt).value().cached_tokens, 4);  // c0 and c1 are left
  EXPECT_EQ(e.pool().prefix_cache_stats().evictions, 6);
}

// Under pressure append takes the plain free pages, then evicts cached-free
// ones, never a page a sequence holds (shared ones included), and refuses
// all or nothing past the free count.
TEST(PagedPrefixCache, EvictionUnderPressureNeverTakesAHeldPage) {
  Engine e(kGqa, spec_for(kGqa, 1, 10, 2));
  const int64_t a = e.request({1, 2, 3, 4, 5, 6, 7});  // 4 pages, 3 keyed
  int64_t cached = -1;
  const int64_t b = e.request({1, 2, 3, 4, 5, 6, 7}, &cached);  // shares 3, 1 of its own
  ASSERT_EQ(cached, 6);
  const int64_t c = e.request({9, 9, 9, 9, 9});
  e.remove(c);  // 2 cached-free pages, 1 plain
  EXPECT_EQ(e.pool().free_pages(), 5);
  EXPECT_EQ(e.pool().prefix_cache_stats().cached_free_pages, 2);
  e.set_next(a, {20, 21, 22, 23, 24, 25, 26, 27, 28});
  ASSERT_TRUE(e.step({a}, {9}, true));  // 4 new pages: 3 plain, 1 evicted
  EXPECT_EQ(e.pool().prefix_cache_stats().evictions, 1);
  const std::vector<int32_t> ta = e.pool().page_table(a).value(),
                             tb = e.pool().page_table(b).value();
  for (size_t i = 3; i < ta.size(); ++i)
    EXPECT_EQ(std::count(tb.begin(), tb.end(), ta[i]), 0) << "page " << ta[i];
  int32_t next = 40;
  ASSERT_TRUE(e.decode({b}, 2, [&] { return next++; }));  // b's rows still exact
  const attnkit_test::PoolSnapshot before = attnkit_test::snapshot(e.pool());
  EXPECT_EQ(e.pool().append(std::vector<int64_t>{a}, std::vector<int64_t>{2 * 2 + 1}).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(attnkit_test::snapshot(e.pool()) == before);
}

// A sequence cut back into a keyed page that another sequence shares
// copies it before writing, so the other's outputs stay exact; one that
// holds it alone unkeys it and writes in place.
TEST(PagedPrefixCache, TruncateIntoAKeyedPageNeverChangesWhatOthersRead) {
  Engine e(kGqa, spec_for(kGqa, 2, 30, 4));
  const Tokens p{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  const int64_t a = e.request(p);  // pages 0-2 keyed
  int64_t cached = -1;
  const int64_t b = e.request(p, &cached);
  ASSERT_EQ(cached, 12);
  const std::vector<int32_t> shared = e.pool().page_table(b).value();
  e.truncate(a, 6);  // into page 1, which b reads
  e.set_next(a, {50, 51, 52, 53});
  ASSERT_TRUE(e.step({a}, {4}, true));
  EXPECT_NE(e.pool().page_table(a).value()[1], shared[1]);  // copied
  EXPECT_EQ(e.pool().page_table(b).value(), shared);
  int32_t next = 90;
  ASSERT_TRUE(e.decode({a, b}, 6, [&] { return next++; }));  // b's rows checked by the oracle
  // a's own page 1 now holds 5 6 50 51: a prompt of those tokens takes it,
  // and the original (b's) still serves p.
  e.request(concat({1, 2, 3, 4, 5, 6, 50, 51}, {52}), &cached);
  EXPECT_EQ(cached, 8);
  e.request(p, &cached);
  EXPECT_EQ(cached, 12);

  // Held alone: cut into, it is unkeyed and written in place, so p no
  // longer finds it (its slot 2 now holds token 60's K/V); p's own second
  // page is keyed anew, and its third replaces the old third page's key
  // (same ids, but its parent is gone).
  Engine f(kGqa, spec_for(kGqa, 1, 30, 4));
  const int64_t c = f.request(p);
  const std::vector<int32_t> tc = f.pool().page_table(c).value();
  f.truncate(c, 6);
  f.set_next(c, {60});
  ASSERT_TRUE(f.step({c}, {1}, true));
  EXPECT_EQ(f.pool().page_table(c).value()[1], tc[1]);
  EXPECT_EQ(f.pool().prefix_cache_stats().cached_pages, 2);  // page 0, and page 2 cached-free
  const int64_t d = f.request(p, &cached);
  EXPECT_EQ(cached, 4);
  EXPECT_EQ(f.pool().prefix_cache_stats().cached_pages, 3);
  EXPECT_EQ(f.pool().cached_free_pages(), std::vector<int32_t>{});  // the old page 2 is plain free
  f.remove(d);
  f.request(p, &cached);
  EXPECT_EQ(cached, 12);
}

// A fork shares its parent's keyed pages; they become cached-free only
// when the last of the two goes.
TEST(PagedPrefixCache, ForksShareKeyedPages) {
  Engine e(kMla, spec_for(kMla, 2, 30, 4));
  const Tokens p{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  const int64_t a = e.request(p);
  const int64_t b = e.fork(a);
  int32_t next = 20;
  ASSERT_TRUE(e.decode({a, b}, 3, [&] { return next++; }));  // a 20 22 24, b 21 23 25
  e.remove(a);
  EXPECT_EQ(e.pool().prefix_cache_stats().cached_free_pages, 1);  // a's own third page
  int64_t cached = -1;
  e.request(concat(p, {21, 23, 25}), &cached);  // b's keyed third page, shared
  EXPECT_EQ(cached, 12);
  e.request(concat(p, {20, 22, 24}), &cached);  // a's, cached-free
  EXPECT_EQ(cached, 12);
  e.remove(b);
  EXPECT_EQ(attnkit_test::pool_state_error(e.pool()), "");
}

// A fork knows the tokens its parent has written, not a prompt the parent
// has yet to write: the child's own tokens, appended without ids, key no
// page under that prompt, so a later request for it computes it rather
// than reading the child's rows (paged_fuzz found the pool keying them).
TEST(PagedPrefixCache, AForkDoesNotInheritAnUnwrittenPrompt) {
  Engine e(kGqa, spec_for(kGqa, 2, 30, 4));
  const Tokens p{1, 2, 3, 4, 5, 6, 7, 8, 9};
  const int64_t a = e.add(p);
  const int64_t b = e.fork(a);
  e.set_next(b, {20, 21, 22, 23, 24, 25, 26, 27, 28});
  ASSERT_TRUE(e.step({b}, {9}, false));
  int64_t cached = -1;
  e.request(p, &cached);  // checks every row against the oracle
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(attnkit_test::pool_state_error(e.pool()), "");
}

// Random serving: requests drawn from a few shared system prompts and a
// small vocabulary (so pages repeat under different prefixes), decoding
// with ids, forks, truncations, removals and a pool small enough to evict
// all the time; keys narrowed at times so they collide. Every output row
// is held to the oracle, and the page accounting to pool_state_error.
TEST(PagedPrefixCache, RandomServingTraces) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const Shape& sh = seed % 3 == 0 ? kMla : kGqa;
    const int64_t ps = int64_t(1 + seed % 4);
    SCOPED_TRACE("seed " + std::to_string(seed));
    Engine e(sh, spec_for(sh, 2, 48 / ps + 4, ps, seed % 2 ? DType::kF32 : DType::kBF16));
    const bool narrow = seed % 4 == 1;  // keys of 1 or 3 bits: few hits, collisions all the time
    if (narrow) attnkit::PagedKVCacheTesting::set_key_mask(e.pool(), seed % 8 == 1 ? 1 : 7);
    std::mt19937_64 rng(seed);
    auto pick = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    std::vector<Tokens> systems;
    for (int i = 0; i < 3; ++i) systems.push_back(random_tokens(rng, size_t(pick(1, 14)), 4));
    int64_t hits = 0;
    for (int op = 0; op < 150 && !testing::Test::HasFailure(); ++op) {
      std::vector<int64_t> ids = e.pool().sequence_ids();
      const int64_t kind = pick(0, 9);
      if (kind <= 2 && ids.size() < 5) {
        const Tokens p =
            concat(systems[size_t(pick(0, 2))], random_tokens(rng, size_t(pick(0, 9)), 4));
        // Admission as an engine does it: enough free pages for the prompt.
        if (int64_t(p.size() / size_t(ps)) + 2 > e.pool().free_pages()) {
          if (!ids.empty()) e.remove(ids[size_t(pick(0, int64_t(ids.size()) - 1))]);
          continue;
        }
        int64_t cached = 0;
        e.request(p, &cached);
        hits += cached > 0;
      } else if (kind == 3 && !ids.empty()) {
        e.fork(ids[size_t(pick(0, int64_t(ids.size()) - 1))]);
      } else if (kind == 4 && !ids.empty()) {
        const int64_t id = ids[size_t(pick(0, int64_t(ids.size()) - 1))];
        e.truncate(id, std::max<int64_t>(0, e.pool().length(id).value() - pick(0, 2 * ps)));
      } else if (kind == 5 && !ids.empty()) {
        e.remove(ids[size_t(pick(0, int64_t(ids.size()) - 1))]);
      } else if (!ids.empty()) {
        int64_t need = 0;
        for (int64_t id : ids) need += e.pool().length(id).value() % ps == 0 ? 2 : 1;
        if (need > e.pool().free_pages()) {
          e.remove(ids.back());
          continue;
        }
        for (int64_t id : ids) e.set_next(id, {int32_t(pick(0, 3))});
        e.step(ids, std::vector<int64_t>(ids.size(), 1), pick(0, 7) != 0);
      }
      ASSERT_EQ(attnkit_test::pool_state_error(e.pool()), "") << "op " << op;
    }
    if (!narrow) {
      EXPECT_GT(hits, 2);
    }
    EXPECT_EQ(e.pool().prefix_cache_stats().hits, hits);
  }
}

TEST(PagedPrefixCache, WithoutCachingAPromptGivesAnEmptySequence) {
  Engine e(kGqa, spec_for(kGqa, 1, 10, 4, DType::kF32, false));
  const Tokens p{1, 2, 3, 4, 5, 6, 7, 8, 9};
  int64_t cached = -1;
  e.request(p);
  e.request(p, &cached);
  EXPECT_EQ(cached, 0);
  EXPECT_TRUE(e.pool().prefix_cache_stats() == PrefixCacheStats{});
  EXPECT_TRUE(e.pool().cached_free_pages().empty());
}

TEST(PagedPrefixCache, RejectsBadArgumentsAndChangesNothing) {
  for (int64_t window : {0, 5})
    for (int64_t chunk : {0, 4}) {
      if (window == 0 && chunk == 0) continue;
      PagedKVCacheSpec s = spec_for(kGqa, 1, 10, 4);
      s.sliding_window = window;
      s.chunk_size = window > 0 ? 0 : chunk;
      const auto r = PagedKVCache::create(s);
      ASSERT_FALSE(r.ok());
      EXPECT_NE(r.status().message().find("PagedKVCache::create: spec.prefix_caching is on with "
                                          "spec."),
                std::string::npos)
          << r.status().message();
    }
  Engine e(kGqa, spec_for(kGqa, 1, 6, 4));
  const int64_t a = e.request({1, 2, 3, 4, 5});
  const attnkit_test::PoolSnapshot before = attnkit_test::snapshot(e.pool());
  auto expect = [&](const attnkit::Status& st, const std::string& text) {
    EXPECT_NE(st.message().find(text), std::string::npos) << st.message();
    EXPECT_TRUE(attnkit_test::snapshot(e.pool()) == before);
  };
  expect(e.pool().add_sequence(Tokens{1, -2}).status(),
         "PagedKVCache::add_sequence: prompt_token_ids[1] = -2 must be >= 0");
  expect(e.pool().probe_prefix(Tokens{-7}).status(),
         "PagedKVCache::probe_prefix: prompt_token_ids[0] = -7 must be >= 0");
  const std::vector<int64_t> ids{a}, two{2};
  expect(e.pool().append(ids, two, Tokens{1}),
         "PagedKVCache::append: token_ids has 1 entries; it must have sum(num_new_tokens) = 2");
  expect(e.pool().append(ids, two, Tokens{1, -1}),
         "PagedKVCache::append: token_ids[1] = -1 must be >= 0");
  const attnkit::PrefixMatch m = e.pool().add_sequence(Tokens{1, 2, 3, 4, 5, 6, 7}).value();
  const attnkit_test::PoolSnapshot with_m = attnkit_test::snapshot(e.pool());
  const attnkit::Status st = e.pool().append(std::vector<int64_t>{m.seq_id},
                                             std::vector<int64_t>{5}, Tokens{1, 2, 3, 4, 9});
  EXPECT_NE(st.message().find("PagedKVCache::append: token_ids[0] = 1 differs from token 5 at "
                              "position 4 of sequence"),
            std::string::npos)
      << st.message();
  EXPECT_TRUE(attnkit_test::snapshot(e.pool()) == with_m);
  // Out of pages with cached-free ones counted: all or nothing still.
  EXPECT_EQ(e.pool().append(std::vector<int64_t>{m.seq_id}, std::vector<int64_t>{40}).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(attnkit_test::snapshot(e.pool()) == with_m);
}

}  // namespace
