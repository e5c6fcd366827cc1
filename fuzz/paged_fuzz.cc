// libFuzzer target: PagedKVCache driven by fuzzer-chosen operation
// sequences against a dense model of every sequence's history.
//
// The input picks a pool (MHA/GQA/MQA or MLA's latent layout, page size
// 1-9, 1-40 pages, 1-3 layers, f32, bf16, int8 or fp8_e4m3, window 0-9 or
// chunks of 1-9 (the pool's, or per call in a plain pool), sinks or none)
// and then a sequence
// of operations: add_sequence, append (valid, or with an unknown id, a
// repeated id, a negative count, or more tokens than the pool holds),
// attend of every layer for the reserved tokens (valid, or with a wrong
// query count, a wrong layer, or a repeated id), fork, remove and
// truncate; with prefix caching (plain pools, at random, keys narrowed to
// 0-3 bits at times so that they collide), add_sequence(prompt) over a
// 3-token vocabulary (so prompts share prefixes and hit) and appends that
// give the new tokens' ids (or not, or wrongly). There K and V are a fixed
// function of (token id, position, layer), so a page taken from the cache
// must hold what the sequence's own history says. After each operation:
//   - a failed call must leave every sequence's length, written counts and
//     page table and the free-page count as they were;
//   - every page no sequence holds is filled with NaN in every layer (8-bit
//     pools: NaN scales and fp8's NaN code), so a read of a freed,
//     released or foreign page shows as NaN;
//   - each attend's output rows must equal, within the bound of
//     tests/common/attention_bounds.h, the reference sdpa over that
//     sequence's dense history (bottom-right causal, the pool's window,
//     the chunk, the sinks);
//   - attend_held (queries over every held token, pools without windows
//     or chunks only)
//     likewise, without the mask, and it must change nothing.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/paged_kv_cache.h"
#include "common/attention_bounds.h"
#include "common/kv_quant_f64.h"
#include "common/paged_pool_state.h"

namespace {

using attnkit::DType;
using attnkit::PagedKVCache;
using attnkit::PagedKVCacheSpec;
using attnkit::TensorView;

[[noreturn]] void fail(const char* what, long long a = 0, long long b = 0) {
  std::fprintf(stderr, "paged_fuzz: %s (%lld, %lld)\n", what, a, b);
  std::abort();
}

using attnkit_test::poison_free_pages;
using attnkit_test::snapshot;
using Snapshot = attnkit_test::PoolSnapshot;

class Run {
 public:
  Run(FuzzedDataProvider& in) : in_(in) {
    PagedKVCacheSpec s;
    const int layout = in_.ConsumeIntegralInRange(0, 3);  // MHA, GQA, MQA, MLA
    heads_ = layout == 0 ? 2 : 4;
    if (layout == 3) {
      s.kv_lora_rank = in_.ConsumeIntegralInRange(1, 9);
      s.qk_rope_head_dim = in_.ConsumeIntegralInRange(0, 4);
    } else {
      s.num_kv_heads = layout == 0 ? 2 : layout == 1 ? 2 : 1;
      s.head_dim = in_.ConsumeIntegralInRange(1, 12);
      s.head_dim_v = in_.ConsumeIntegralInRange(0, 12);
    }
    s.num_layers = in_.ConsumeIntegralInRange(1, 3);
    s.num_pages = in_.ConsumeIntegralInRange(1, 40);
    s.page_size = in_.ConsumeIntegralInRange(1, 9);
    static constexpr DType kTypes[] = {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3};
    s.dtype = kTypes[in_.ConsumeIntegralInRange<size_t>(0, 3)];
    s.sliding_window = in_.ConsumeBool() ? in_.ConsumeIntegralInRange(1, 9) : 0;
    // Chunks: the pool's (releasing pages), or given per call to a plain
    // pool; sinks on every call, or none.
    if (s.sliding_window == 0 && in_.ConsumeBool()) s.chunk_size = in_.ConsumeIntegralInRange(1, 9);
    if (s.chunk_size == 0 && in_.ConsumeBool()) call_chunk_ = in_.ConsumeIntegralInRange(1, 9);
    if (in_.ConsumeBool()) {
      static constexpr float kSinks[] = {-20.0f, -1.0f, 0.0f, 1.5f, 30.0f, 1e30f};
      for (int64_t h = 0; h < heads_; ++h)
        sinks_.push_back(kSinks[in_.ConsumeIntegralInRange<size_t>(0, std::size(kSinks) - 1)]);
    }
    s.prefix_caching = s.sliding_window == 0 && s.chunk_size == 0 && in_.ConsumeBool();
    auto pool = PagedKVCache::create(s);
    if (!pool.ok()) fail("create failed on a valid spec");
    pool_.emplace(std::move(pool).value());
    if (s.prefix_caching && in_.ConsumeBool())
      attnkit::PagedKVCacheTesting::set_key_mask(*pool_, in_.ConsumeIntegralInRange(0, 7));
    rng_state_ = in_.ConsumeIntegral<uint64_t>() | 1;
  }

  void step() {
    operate();
    const std::string bad = attnkit_test::pool_state_error(*pool_);
    if (!bad.empty()) {
      std::fprintf(stderr, "%s\n", bad.c_str());
      fail("the pool's page accounting is broken");
    }
  }

 private:
  void operate() {
    PagedKVCache& pool = *pool_;
    poison_free_pages(pool);
    const Snapshot before = snapshot(pool);
    const std::vector<int64_t> ids = pool.sequence_ids();
    auto any_id = [&]() -> int64_t {
      if (ids.empty() || in_.ConsumeIntegralInRange(0, 15) == 0)
        return in_.ConsumeIntegralInRange<int64_t>(-1, 50);  // may not exist
      return ids[in_.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)];
    };
    switch (in_.ConsumeIntegralInRange(0, 7)) {
      case 0: {
        if (pool.num_sequences() >= 6) return;
        if (!pool.spec().prefix_caching || in_.ConsumeBool()) {
          const int64_t id = pool.add_sequence();
          model_[id].resize(layers());
          tokens_[id].clear();
          return;
        }
        add_prompt();
        return;
      }
      case 1:
      case 2: {  // append, then attend every layer (or a broken attend)
        std::vector<int64_t> seq, counts;
        const size_t n = in_.ConsumeIntegralInRange<size_t>(0, 4);
        for (size_t i = 0; i < n; ++i) {
          seq.push_back(any_id());
          counts.push_back(in_.ConsumeIntegralInRange<int64_t>(-1, 12));
        }
        // The new tokens' ids: a sequence's known ones (its prompt), else
        // new ones; given to append() (wrongly at times), or not.
        std::vector<int32_t> ids_given;
        int32_t* last = nullptr;  // the model's entry of the last id given
        for (size_t i = 0; i < n; ++i) {
          Tokens* t = model_.count(seq[i]) ? &tokens_[seq[i]] : nullptr;
          const int64_t len = t ? pool.length(seq[i]).value() : 0;
          for (int64_t j = 0; j < counts[i]; ++j) {
            if (t && size_t(len + j) >= t->size()) t->push_back(in_.ConsumeIntegralInRange(0, 2));
            ids_given.push_back(t ? (*t)[size_t(len + j)] : 0);
          }
          if (t && counts[i] > 0) last = &(*t)[size_t(len + counts[i] - 1)];
        }
        const int how = pool.spec().prefix_caching ? in_.ConsumeIntegralInRange(0, 5) : 0;
        bool wrong = false;
        if (how == 4 && !ids_given.empty()) {  // one id off by one: wrong where it is a prompt's
          ids_given.back() += 1;
          wrong = true;
        } else if (how == 5) {  // one id too many
          ids_given.push_back(0);
        }
        const attnkit::Status appended =
            how == 0 ? pool.append(seq, counts) : pool.append(seq, counts, ids_given);
        if (!appended.ok()) {
          if (!(snapshot(pool) == before)) fail("a failed append changed the pool");
          return;
        }
        if (how == 5) fail("append accepted one token id too many");
        for (size_t i = 0; i < n; ++i)
          if (counts[i] < 0 || !model_.count(seq[i])) fail("append accepted a bad argument");
        if (wrong) {  // accepted: the last token was not a prompt's; it is the one given
          if (last == nullptr) fail("a wrong token id was accepted");
          *last += 1;
        }
        for (int64_t l = 0; l < pool.spec().num_layers; ++l) attend(l, seq, counts);
        return;
      }
      case 3: {
        const int64_t id = any_id();
        auto child = pool.fork(id);
        if (!child.ok()) {
          if (!(snapshot(pool) == before)) fail("a failed fork changed the pool");
          return;
        }
        model_[*child] = model_.at(id);
        tokens_[*child] = tokens_.at(id);
        tokens_[*child].resize(size_t(pool.length(id).value()));
        return;
      }
      case 5:
        attend_held(ids);
        return;
      case 4: {
        const int64_t id = any_id();
        if (pool.remove(id).ok()) {
          model_.erase(id);
          tokens_.erase(id);
        } else if (!(snapshot(pool) == before))
          fail("a failed remove changed the pool");
        return;
      }
      default: {
        const int64_t id = any_id();
        const int64_t to = in_.ConsumeIntegralInRange<int64_t>(-1, 60);
        if (pool.truncate(id, to).ok()) {
          for (History& h : model_.at(id)) h.resize(to, row_k(), row_v());
          if (tokens_[id].size() > size_t(to)) tokens_[id].resize(size_t(to));
        } else if (!(snapshot(pool) == before)) {
          fail("a failed truncate changed the pool");
        }
        return;
      }
    }
  }

  // One layer's history of a sequence: K and V rows as the pool holds them.
  struct History {
    std::vector<float> k, v;
    void resize(int64_t tokens, int64_t kw, int64_t vw) {
      k.resize(size_t(tokens * kw));
      v.resize(size_t(tokens * vw));
    }
  };

  using Tokens = std::vector<int32_t>;

  // add_sequence(prompt): a prompt of 0-20 ids from {0, 1, 2}; the pages
  // it takes hold, by the fixed K/V function, what the model derives.
  void add_prompt() {
    PagedKVCache& pool = *pool_;
    Tokens prompt(in_.ConsumeIntegralInRange<size_t>(0, 20));
    for (int32_t& t : prompt) t = in_.ConsumeIntegralInRange(0, 2);
    const attnkit::PrefixProbe probe = pool.probe_prefix(prompt).value();
    const attnkit::PrefixCacheStats before = pool.prefix_cache_stats();
    const int64_t free_before = pool.free_pages();
    auto r = pool.add_sequence(prompt);
    if (!r.ok()) fail("add_sequence(prompt) failed");
    if (r->cached_tokens != probe.cached_tokens ||
        pool.free_pages() != free_before - probe.cached_free_pages)
      fail("probe_prefix differs from add_sequence", probe.cached_tokens, r->cached_tokens);
    const int64_t c = r->cached_tokens, ps = pool.spec().page_size, n = int64_t(prompt.size());
    if (c % ps != 0 || c > std::max<int64_t>(0, n - 1)) fail("a bad cached_tokens", c, n);
    if (pool.length(r->seq_id).value() != c) fail("the length is not cached_tokens");
    const attnkit::PrefixCacheStats after = pool.prefix_cache_stats();
    if (after.queries != before.queries + 1 || after.hit_tokens != before.hit_tokens + c ||
        after.hits != before.hits + (c > 0))
      fail("the stats miscount a query");
    std::vector<History>& h = model_[r->seq_id];
    h.assign(layers(), {});
    for (int64_t l = 0; l < int64_t(layers()); ++l)
      for (int64_t p = 0; p < c; ++p) append_token(prompt[size_t(p)], p, l, &h[size_t(l)]);
    tokens_[r->seq_id] = prompt;
  }

  // K, V of token `token` at `position` in `layer` (prefix-caching pools):
  // row values uniform in [-1, 1), a hash of all four and the index.
  static float kv_value(int32_t token, int64_t position, int64_t layer, int which, int64_t x) {
    uint64_t h = uint64_t(uint32_t(token)) * 0x9e3779b97f4a7c15ull ^
                 uint64_t(position) * 0xc2b2ae3d27d4eb4full ^ uint64_t(layer) << 56 ^
                 uint64_t(which) << 60 ^ uint64_t(x) * 0x165667b19e3779f9ull;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return static_cast<float>(static_cast<double>(h >> 40) * 0x1p-23 - 1.0);
  }
  // Writes the K [num_kv_heads, head_dim] and V rows of a token into k, v.
  void kv_rows(int32_t token, int64_t position, int64_t layer, float* k, float* v) const {
    for (int64_t x = 0; x < row_k(); ++x) k[x] = kv_value(token, position, layer, 0, x);
    for (int64_t x = 0; x < row_v() && !pool_->spec().latent(); ++x)
      v[x] = kv_value(token, position, layer, 1, x);
  }
  // Appends a token's K/V, as the pool stores them, to a layer's history.
  void append_token(int32_t token, int64_t position, int64_t layer, History* h) const {
    const PagedKVCacheSpec& s = pool_->spec();
    std::vector<float> k(size_t(row_k())), v(size_t(row_v()));
    kv_rows(token, position, layer, k.data(), v.data());
    for (int64_t g = 0; g < s.num_kv_heads; ++g) {
      append_stored(k.data() + g * s.head_dim, s.head_dim, &h->k);
      if (s.latent())
        h->v.insert(h->v.end(), h->k.end() - s.head_dim, h->k.end() - s.head_dim + s.head_dim_v);
      else
        append_stored(v.data() + g * s.head_dim_v, s.head_dim_v, &h->v);
    }
  }

  size_t layers() const { return size_t(pool_->spec().num_layers); }
  int64_t row_k() const { return pool_->spec().num_kv_heads * pool_->spec().head_dim; }
  int64_t row_v() const { return pool_->spec().num_kv_heads * pool_->spec().head_dim_v; }

  float next_value() {  // uniform in [-1, 1)
    rng_state_ ^= rng_state_ << 13;
    rng_state_ ^= rng_state_ >> 7;
    rng_state_ ^= rng_state_ << 17;
    return static_cast<float>(static_cast<double>(rng_state_ >> 40) * 0x1p-23 - 1.0);
  }
  // n values as the pool stores them: rounded to bf16, or quantized in
  // blocks (one per head row; 64 channels of a latent row) and dequantized.
  void append_stored(const float* x, int64_t n, std::vector<float>* to) const {
    const DType dt = pool_->spec().dtype;
    if (dt == DType::kI8 || dt == DType::kFp8E4M3) {
      const int64_t block = pool_->spec().latent() ? 64 : n;
      const std::vector<double> d = attnkit_test::kv_dequantized(x, n, dt, block);
      to->insert(to->end(), d.begin(), d.end());
      return;
    }
    for (int64_t i = 0; i < n; ++i)
      to->push_back(dt == DType::kBF16 ? attnkit::bf16_to_float(attnkit::float_to_bf16(x[i]))
                                       : x[i]);
  }

  void attend(int64_t layer, const std::vector<int64_t>& seq, const std::vector<int64_t>& counts) {
    PagedKVCache& pool = *pool_;
    const PagedKVCacheSpec& s = pool.spec();
    const int64_t D = s.head_dim, Dv = s.head_dim_v, Hkv = s.num_kv_heads, H = heads_;
    std::vector<int32_t> cu{0};
    for (int64_t c : counts) cu.push_back(cu.back() + int32_t(c));
    const int64_t total = cu.back();
    std::vector<float> q(size_t(total * H * D + 1)), k(size_t(total * Hkv * D + 1)),
        v(size_t(total * Hkv * Dv + 1)), out(size_t(total * H * Dv + 1), 7.0f);
    for (std::vector<float>* buf : {&q, &k, &v})
      for (float& e : *buf) e = next_value();
    if (s.prefix_caching)  // K/V of each token by the fixed function of (id, position, layer)
      for (size_t i = 0; i < seq.size(); ++i) {
        const int64_t first = pool.length(seq[i]).value() - counts[i];
        for (int64_t r = 0; r < counts[i]; ++r) {
          const int64_t row = cu[i] + r;
          kv_rows(tokens_.at(seq[i])[size_t(first + r)], first + r, layer, k.data() + row * Hkv * D,
                  v.data() + row * Hkv * Dv);
        }
      }
    attnkit::AttentionOptions o;
    o.num_threads = in_.ConsumeIntegralInRange(1, 3);
    o.chunk_size = call_chunk_;
    if (!sinks_.empty()) o.sinks = attnkit::make_view(sinks_.data(), DType::kF32, {H});
    const bool latent = s.latent();
    auto call = [&](int64_t which_layer, const std::vector<int32_t>& offsets,
                    const std::vector<int64_t>& which) {
      return pool.attend(
          which_layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
          attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
          latent ? TensorView{} : attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}),
          offsets, which, attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o);
    };
    // One broken call first, at times: it must change nothing. (Queries
    // moved to the last sequence, or a repeated id, break the call only
    // where they change something.)
    const int broken = in_.ConsumeIntegralInRange(0, 7);
    std::vector<int32_t> shifted = cu;
    for (size_t i = 1; i + 1 < shifted.size(); ++i) shifted[i] = 0;
    std::vector<int64_t> dup = seq;
    if (dup.size() >= 2) dup[1] = dup[0];
    if (broken == 0 || (broken == 1 && shifted != cu) || (broken == 2 && dup != seq)) {
      const Snapshot before = snapshot(pool);
      const attnkit::Status st = broken == 0   ? call(layer + s.num_layers, cu, seq)
                                 : broken == 1 ? call(layer, shifted, seq)
                                               : call(layer, cu, dup);
      if (st.ok()) fail("a broken attend succeeded", broken);
      if (!(snapshot(pool) == before)) fail("a failed attend changed the pool", broken);
      for (size_t i = 0; i + 1 < out.size(); ++i)
        if (out[i] != 7.0f) fail("a failed attend wrote out", broken);
    }
    poison_free_pages(pool);
    const attnkit::Status st = call(layer, cu, seq);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.to_string().c_str());
      fail("a valid attend failed");
    }
    for (size_t i = 0; i < seq.size(); ++i) {
      History& h = model_.at(seq[i])[size_t(layer)];
      for (int64_t t = cu[i]; t < cu[i + 1]; ++t)
        for (int64_t g = 0; g < Hkv; ++g) {
          append_stored(k.data() + (t * Hkv + g) * D, D, &h.k);
          if (latent)  // the values: the stored row's first kv_lora_rank columns
            h.v.insert(h.v.end(), h.k.end() - D, h.k.end() - D + Dv);
          else
            append_stored(v.data() + (t * Hkv + g) * Dv, Dv, &h.v);
        }
      check(i, cu, h, q, out);
    }
  }

  // attend_held over every sequence (0-3 queries each) of a random layer:
  // refused by a window pool, else each sequence's rows against the
  // reference over its whole history; the pool must not change.
  void attend_held(const std::vector<int64_t>& ids) {
    PagedKVCache& pool = *pool_;
    const PagedKVCacheSpec& s = pool.spec();
    const int64_t D = s.head_dim, Dv = s.head_dim_v, H = heads_;
    const int64_t layer = in_.ConsumeIntegralInRange<int64_t>(0, s.num_layers - 1);
    std::vector<int32_t> cu{0};
    for (size_t i = 0; i < ids.size(); ++i)
      cu.push_back(cu.back() + in_.ConsumeIntegralInRange(0, 3));
    const int64_t total = cu.back();
    std::vector<float> q(size_t(total * H * D + 1)), out(size_t(total * H * Dv + 1), 7.0f);
    for (float& e : q) e = next_value();
    attnkit::AttentionOptions o;
    o.num_threads = in_.ConsumeIntegralInRange(1, 3);
    const Snapshot before = snapshot(pool);
    const attnkit::Status st =
        pool.attend_held(layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}), cu, ids,
                         attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o);
    if (!(snapshot(pool) == before)) fail("attend_held changed the pool");
    if (s.sliding_window > 0 || s.chunk_size > 0) {
      if (st.ok()) fail("attend_held accepted a window or chunked pool");
      return;
    }
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.to_string().c_str());
      fail("a valid attend_held failed");
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      const History& h = model_.at(ids[i])[size_t(layer)];
      if (int64_t(h.k.size()) / (s.num_kv_heads * D) != pool.written(ids[i], layer).value())
        fail("the model and the pool disagree on the written tokens");
      check(i, cu, h, q, out, false);
    }
  }

  // Sequence i's rows of `out` against the reference sdpa over its history
  // (causal: the rows are its newest tokens; else they follow all of them).
  void check(size_t i, const std::vector<int32_t>& cu, const History& h, std::vector<float>& q,
             const std::vector<float>& out, bool causal = true) {
    const PagedKVCacheSpec& s = pool_->spec();
    const int64_t D = s.head_dim, Dv = s.head_dim_v, Hkv = s.num_kv_heads, H = heads_;
    const int64_t n = cu[i + 1] - cu[i], keys = int64_t(h.k.size()) / (Hkv * D);
    if (n == 0) return;
    if (keys == 0) {  // attend_held of a sequence with nothing written: rows of 0
      // (attend() always has keys: its queries are written first)
      for (int64_t x = 0; x < n * H * Dv; ++x)
        if (out[size_t(cu[i] * H * Dv + x)] != 0.0f) fail("a row without keys is not 0", x);
      return;
    }
    std::vector<float> k = h.k, v = h.v, want(size_t(n * H * Dv));
    attnkit::AttentionOptions o;
    o.causal = causal;
    o.backend = attnkit::Backend::kReference;
    if (causal && s.sliding_window > 0) o.window_size.left = s.sliding_window - 1;
    if (causal) {
      o.chunk_size = s.chunk_size > 0 ? s.chunk_size : call_chunk_;
      if (!sinks_.empty()) o.sinks = attnkit::make_view(sinks_.data(), DType::kF32, {H});
    }
    const attnkit::Status st =
        attnkit::sdpa(attnkit::make_view(q.data() + cu[i] * H * D, DType::kF32, {1, n, H, D}),
                      attnkit::make_view(k.data(), DType::kF32, {1, keys, Hkv, D}),
                      attnkit::make_view(v.data(), DType::kF32, {1, keys, Hkv, Dv}),
                      attnkit::make_view(want.data(), DType::kF32, {1, n, H, Dv}), o);
    if (!st.ok()) fail("the reference sdpa failed");
    const double bound =
        attnkit_test::attention_tolerance(D, keys, s.dtype, attnkit::Backend::kAuto).atol;
    for (int64_t x = 0; x < n * H * Dv; ++x) {
      const float got = out[size_t(cu[i] * H * Dv + x)];
      if (!(std::fabs(double(got) - want[size_t(x)]) <= bound))
        fail("attend differs from the dense history", x, static_cast<long long>(keys));
    }
  }

  FuzzedDataProvider& in_;
  std::optional<PagedKVCache> pool_;
  int64_t heads_ = 2;
  int64_t call_chunk_ = 0;    // options.chunk_size of every attend()
  std::vector<float> sinks_;  // [heads_] options.sinks of every attend(), or none
  uint64_t rng_state_ = 1;
  std::map<int64_t, std::vector<History>> model_;
  std::map<int64_t, Tokens> tokens_;  // per sequence: its token ids (a prompt's run past length)
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Run run(in);
  for (int op = 0; op < 40 && in.remaining_bytes() > 0; ++op) run.step();
  return 0;
}
