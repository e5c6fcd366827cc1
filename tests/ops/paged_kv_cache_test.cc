// PagedKVCache against a dense model: random traces of add_sequence, append,
// attend (every layer), fork and remove over many steps, where every output
// row must equal the float64 oracle run on that sequence's own dense token
// history. Between operations every free page (never used, freed by
// remove, released by a window, or left by copy-on-write) is filled with
// NaN in every layer, so a sequence that read another's page, a freed page
// or a slot not yet written would turn NaN. Also: bookkeeping of forks and
// copy-on-write, window release, all-or-nothing append on a full pool,
// batch invariance, thread-count independence and every bad argument.
#include "attnkit/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/attention_bounds.h"
#include "common/attention_f64.h"
#include "common/kv_quant_f64.h"
#include "common/paged_pool_state.h"
#include "common/random.h"
#include "ops/kv_quant.h"

namespace {

using attnkit::AttentionOptions;
using attnkit::Backend;
using attnkit::DType;
using attnkit::PagedKVCache;
using attnkit::PagedKVCacheSpec;
using attnkit::StatusCode;
using attnkit::TensorView;

struct Shape {
  const char* name;
  int64_t num_heads, num_kv_heads, head_dim, head_dim_v;
  int64_t kv_lora_rank = 0, qk_rope_head_dim = 0;  // > 0: MLA's latent layout
};

const Shape kShapes[] = {
    {"MHA", 4, 4, 8, 8}, {"GQA", 6, 2, 16, 12}, {"MQA", 4, 1, 8, 8}, {"MLA", 8, 0, 0, 0, 12, 4}};

// A pool's spec for `shape`.
PagedKVCacheSpec spec_for(const Shape& sh, int64_t layers, int64_t pages, int64_t page_size,
                          DType dtype, int64_t window, int64_t chunk = 0) {
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
  s.sliding_window = window;
  s.chunk_size = chunk;
  return s;
}

// Every sequence's token history per layer, as the pool should hold it
// (rounded to bf16 for a bf16 pool), and the oracle over it.
class DenseModel {
 public:
  DenseModel(const PagedKVCache& pool, int64_t num_heads) : spec_(pool.spec()), heads_(num_heads) {}

  int64_t key_width() const { return spec_.num_kv_heads * spec_.head_dim; }
  int64_t value_width() const { return spec_.num_kv_heads * spec_.head_dim_v; }
  // Values kept per token in the model (the latent layout keeps the row's
  // first kv_lora_rank columns).
  int64_t value_width_stored() const { return spec_.latent() ? spec_.head_dim_v : value_width(); }

  void add(int64_t id) {
    seqs_[id].k.resize(size_t(spec_.num_layers));
    seqs_[id].v.resize(size_t(spec_.num_layers));
  }
  void fork(int64_t parent, int64_t child) { seqs_[child] = seqs_.at(parent); }
  void remove(int64_t id) { seqs_.erase(id); }
  void truncate(int64_t id, int64_t tokens) {
    Seq& s = seqs_.at(id);
    for (auto& k : s.k) k.resize(size_t(tokens * key_width()));
    for (auto& v : s.v) v.resize(size_t(tokens * value_width_stored()));
  }
  bool has(int64_t id) const { return seqs_.count(id) != 0; }
  // The options of the attend() calls that follow: a per-call chunk (the
  // pool's, if it has one, wins) and sinks ([num_heads]; empty = none).
  void set_call(int64_t chunk, const std::vector<float>& sinks) {
    call_chunk_ = chunk;
    sinks_.assign(sinks.begin(), sinks.end());
  }

  // Records n new tokens of sequence `id` in `layer` (k_new, v_new rows in
  // the attend() layout) and returns the oracle's output rows for their
  // queries q [n, heads, head_dim].
  std::vector<double> attend(int64_t id, int64_t layer, const float* q, const float* k_new,
                             const float* v_new, int64_t n, double softcap) {
    Seq& s = seqs_.at(id);
    std::vector<double>& k = s.k[size_t(layer)];
    std::vector<double>& v = s.v[size_t(layer)];
    // Rows of `heads` x `dim` values as the pool keeps them: rounded to
    // bf16, or quantized per head (per 64 channels of a latent row).
    auto keep = [&](const float* x, int64_t heads, int64_t dim) {
      std::vector<double> r;
      for (int64_t h = 0; h < heads; ++h) {
        const float* row = x + h * dim;
        if (spec_.dtype == DType::kI8 || spec_.dtype == DType::kFp8E4M3) {
          const std::vector<double> d = attnkit_test::kv_dequantized(
              row, dim, spec_.dtype, spec_.latent() ? attnkit::kLatentScaleBlock : 0);
          r.insert(r.end(), d.begin(), d.end());
        } else {
          for (int64_t c = 0; c < dim; ++c)
            r.push_back(spec_.dtype == DType::kBF16 ? attnkit_test::round_bf16(row[c]) : row[c]);
        }
      }
      return r;
    };
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<double> kr =
          keep(k_new + t * key_width(), spec_.num_kv_heads, spec_.head_dim);
      k.insert(k.end(), kr.begin(), kr.end());
      if (spec_.latent()) {  // the value is the first kv_lora_rank columns of the row
        v.insert(v.end(), kr.begin(), kr.begin() + spec_.head_dim_v);
      } else {
        const std::vector<double> vr =
            keep(v_new + t * value_width(), spec_.num_kv_heads, spec_.head_dim_v);
        v.insert(v.end(), vr.begin(), vr.end());
      }
    }
    return oracle(id, layer, q, n, softcap, true).out;
  }

  // The oracle for n queries q [n, heads, head_dim] that follow every
  // token of sequence `id` in `layer` and see all of them (attend_held).
  attnkit_test::OracleResult held(int64_t id, int64_t layer, const float* q, int64_t n,
                                  double softcap) const {
    return oracle(id, layer, q, n, softcap, false);
  }

 private:
  attnkit_test::OracleResult oracle(int64_t id, int64_t layer, const float* q, int64_t n,
                                    double softcap, bool causal) const {
    const Seq& s = seqs_.at(id);
    const std::vector<double>& k = s.k[size_t(layer)];
    attnkit_test::OracleOptions o;
    o.seqlen_q = n;
    o.seqlen_k = static_cast<int64_t>(k.size()) / key_width();
    o.num_heads = heads_;
    o.num_kv_heads = spec_.num_kv_heads;
    o.head_dim = spec_.head_dim;
    o.head_dim_v = spec_.head_dim_v;
    o.causal = causal;
    o.window_left = causal && spec_.sliding_window > 0 ? spec_.sliding_window - 1 : -1;
    if (causal) {
      o.chunk_size = spec_.chunk_size > 0 ? spec_.chunk_size : call_chunk_;
      o.sinks = sinks_;
    }
    o.softcap = softcap;
    std::vector<double> qd(q, q + n * heads_ * spec_.head_dim);
    return attnkit_test::attention_f64(o, qd, k, s.v[size_t(layer)]);
  }

  struct Seq {
    std::vector<std::vector<double>> k, v;  // per layer [tokens, kv heads, dim]
  };
  PagedKVCacheSpec spec_;
  int64_t heads_;
  std::map<int64_t, Seq> seqs_;
  int64_t call_chunk_ = 0;
  std::vector<double> sinks_;
};

using attnkit_test::poison_free_pages;
using attnkit_test::snapshot;
using Snapshot = attnkit_test::PoolSnapshot;

struct TraceOptions {
  Shape shape = kShapes[1];
  int64_t page_size = 16, num_pages = 40, layers = 2, window = 0;
  int64_t chunk = 0;       // the pool's chunk_size
  int64_t call_chunk = 0;  // options.chunk_size of every attend()
  bool sinks = false;      // options.sinks on every attend()
  DType dtype = DType::kF32;
  float softcap = 0.0f;
  Backend backend = Backend::kAuto;
  int threads = 2;
  int steps = 30;
  uint64_t seed = 1;
};

// Runs a random trace and checks every output. Returns every output value
// in order (for the thread-count comparison).
// attend_held() for every sequence of the pool, 0-3 queries each, against
// the oracle over the tokens the model holds; it must change nothing.
void check_attend_held(PagedKVCache& pool, const DenseModel& model, int64_t H, int64_t layer,
                       const TraceOptions& t, std::mt19937_64& rng, attnkit_test::Rng& values) {
  const PagedKVCacheSpec& spec = pool.spec();
  const int64_t D = spec.head_dim, Dv = spec.head_dim_v;
  const std::vector<int64_t> ids = pool.sequence_ids();
  std::vector<int32_t> cu{0};
  for (size_t s = 0; s < ids.size(); ++s)
    cu.push_back(cu.back() + static_cast<int32_t>(std::uniform_int_distribution<>(0, 3)(rng)));
  const int64_t total = cu.back();
  std::vector<float> q = attnkit_test::uniform_vector(size_t(total * H * D + 1), values);
  std::vector<float> out(size_t(total * H * Dv + 1), -5.0f), lse(size_t(H * total + 1), -5.0f);
  AttentionOptions o;
  o.softcap = t.softcap;
  o.backend = t.backend;
  o.num_threads = t.threads;
  const Snapshot before = snapshot(pool);
  const attnkit::Status st =
      pool.attend_held(layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}), cu, ids,
                       attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o,
                       attnkit::make_view(lse.data(), DType::kF32, {H, total}));
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(snapshot(pool) == before);
  EXPECT_EQ(out.back(), -5.0f);
  EXPECT_EQ(lse.back(), -5.0f);
  for (size_t s = 0; s < ids.size(); ++s) {
    const int64_t n = cu[s + 1] - cu[s], row0 = cu[s];
    if (n == 0) continue;
    const attnkit_test::OracleResult want =
        model.held(ids[s], layer, q.data() + row0 * H * D, n, t.softcap);
    const std::vector<float> got(out.begin() + row0 * H * Dv, out.begin() + (row0 + n) * H * Dv);
    const int64_t keys = pool.written(ids[s], layer).value();
    const attnkit_test::Tolerance tol =
        attnkit_test::attention_tolerance(D, keys, t.dtype, t.backend);
    EXPECT_TRUE(attnkit_test::all_close("attend_held out", got, want.out, tol))
        << "sequence " << ids[s] << " layer " << layer << " keys " << keys;
    std::vector<float> got_lse;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n; ++i) got_lse.push_back(lse[size_t(h * total + row0 + i)]);
    if (keys == 0) {
      for (float x : got_lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
    } else {
      EXPECT_TRUE(attnkit_test::all_close("attend_held lse", got_lse, want.lse, tol))
          << "sequence " << ids[s] << " layer " << layer;
    }
  }
}

std::vector<float> run_trace(const TraceOptions& t) {
  std::mt19937_64 rng(t.seed);
  attnkit_test::Rng values(t.seed + 1);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const Shape& sh = t.shape;
  auto created = PagedKVCache::create(
      spec_for(sh, t.layers, t.num_pages, t.page_size, t.dtype, t.window, t.chunk));
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  if (!created.ok()) return {};
  PagedKVCache pool = std::move(created).value();
  const PagedKVCacheSpec& spec = pool.spec();
  DenseModel model(pool, sh.num_heads);
  const int64_t D = spec.head_dim, Dv = spec.head_dim_v, Hkv = spec.num_kv_heads, H = sh.num_heads;
  std::vector<float> sinks;
  for (int64_t h = 0; t.sinks && h < H; ++h) sinks.push_back(0.75f * float(h) - 1.0f);
  model.set_call(t.call_chunk, sinks);
  std::vector<float> all_outputs;
  const std::string where = std::string(sh.name) + " page_size " + std::to_string(t.page_size) +
                            " window " + std::to_string(t.window) + " chunk " +
                            std::to_string(t.chunk) + "/" + std::to_string(t.call_chunk) +
                            (t.sinks ? " sinks " : " ") + attnkit::dtype_name(t.dtype) + " seed " +
                            std::to_string(t.seed);
  for (int step = 0; step < t.steps; ++step) {
    SCOPED_TRACE(where + " step " + std::to_string(step));
    // Lifecycle operations.
    if (pool.num_sequences() < 4 && pick(0, 2) > 0) {
      model.add(pool.add_sequence());
    }
    std::vector<int64_t> ids = pool.sequence_ids();
    if (!ids.empty() && pick(0, 5) == 0) {
      const int64_t parent = ids[size_t(pick(0, int64_t(ids.size()) - 1))];
      auto child = pool.fork(parent);
      EXPECT_TRUE(child.ok()) << child.status().to_string();
      if (child.ok()) model.fork(parent, *child);
    }
    ids = pool.sequence_ids();
    if (!ids.empty() && pick(0, 6) == 0) {  // roll back a few tokens
      const int64_t id = ids[size_t(pick(0, int64_t(ids.size()) - 1))];
      const std::vector<int32_t> table = pool.page_table(id).value();
      const int64_t released = std::count(table.begin(), table.end(), -1);
      const int64_t len = pool.length(id).value();
      const int64_t released_to = released * t.page_size;
      const int64_t lowest = released == 0 ? 0
                             : t.chunk > 0 ? (released_to + t.chunk - 1) / t.chunk * t.chunk
                                           : released_to + t.window - 1;
      const int64_t to = std::min(len, std::max(lowest, len - pick(0, 5)));
      EXPECT_TRUE(pool.truncate(id, to).ok());
      model.truncate(id, to);
      EXPECT_EQ(pool.length(id).value(), to);
    }
    if (ids.size() > 2 && pick(0, 6) == 0) {
      const int64_t victim = ids[size_t(pick(0, int64_t(ids.size()) - 1))];
      EXPECT_TRUE(pool.remove(victim).ok());
      model.remove(victim);
    }
    poison_free_pages(pool);
    ids = pool.sequence_ids();
    if (ids.empty()) continue;

    // This step's tokens: a prompt chunk, a few decodes, some sequences idle.
    std::vector<int64_t> step_ids, counts;
    for (int64_t id : ids) {
      const int64_t kind = pick(0, 5);
      const int64_t n = kind == 0   ? 0
                        : kind == 1 ? pick(2, 3 * t.page_size + 5)
                        : kind == 2 ? pick(2, 4)
                                    : 1;
      step_ids.push_back(id);
      counts.push_back(n);
    }
    const Snapshot before = snapshot(pool);
    const attnkit::Status appended = pool.append(step_ids, counts);
    if (!appended.ok()) {
      // All or nothing: a full pool changes no sequence and no page.
      EXPECT_EQ(appended.code(), StatusCode::kResourceExhausted) << appended.to_string();
      EXPECT_NE(appended.message().find("out of pages"), std::string::npos);
      EXPECT_TRUE(snapshot(pool) == before);
      const int64_t victim = ids[size_t(pick(0, int64_t(ids.size()) - 1))];
      EXPECT_TRUE(pool.remove(victim).ok());
      model.remove(victim);
      continue;
    }
    poison_free_pages(pool);
    std::vector<int32_t> cu{0};
    for (int64_t n : counts) cu.push_back(cu.back() + static_cast<int32_t>(n));
    const int64_t total = cu.back();
    for (int64_t layer = 0; layer < t.layers; ++layer) {
      std::vector<float> q = attnkit_test::uniform_vector(size_t(total * H * D + 1), values);
      std::vector<float> k = attnkit_test::uniform_vector(size_t(total * Hkv * D + 1), values);
      std::vector<float> v = attnkit_test::uniform_vector(size_t(total * Hkv * Dv + 1), values);
      std::vector<float> out(size_t(total * H * Dv + 1), -5.0f);
      AttentionOptions o;
      o.softcap = t.softcap;
      o.backend = t.backend;
      o.num_threads = t.threads;
      o.chunk_size = t.call_chunk;
      if (t.sinks) o.sinks = attnkit::make_view(sinks.data(), DType::kF32, {H});
      const attnkit::Status st =
          pool.attend(layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
                      attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
                      spec.latent() ? TensorView{}
                                    : attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}),
                      cu, step_ids, attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o);
      EXPECT_TRUE(st.ok()) << st.to_string();
      if (!st.ok()) return {};
      for (size_t s = 0; s < step_ids.size(); ++s) {
        const int64_t n = counts[s], row0 = cu[s];
        if (n == 0) continue;
        const std::vector<double> want =
            model.attend(step_ids[s], layer, q.data() + row0 * H * D, k.data() + row0 * Hkv * D,
                         v.data() + row0 * Hkv * Dv, n, t.softcap);
        const std::vector<float> got(out.begin() + row0 * H * Dv,
                                     out.begin() + (row0 + n) * H * Dv);
        const int64_t keys = pool.length(step_ids[s]).value();
        EXPECT_TRUE(attnkit_test::all_close(
            "out", got, want, attnkit_test::attention_tolerance(D, keys, t.dtype, t.backend)))
            << "sequence " << step_ids[s] << " layer " << layer;
      }
      all_outputs.insert(all_outputs.end(), out.begin(), out.end() - 1);
      poison_free_pages(pool);
      if (t.window == 0 && t.chunk == 0) check_attend_held(pool, model, H, layer, t, rng, values);
    }
    for (int64_t id : pool.sequence_ids())
      for (int64_t l = 0; l < t.layers; ++l)
        EXPECT_EQ(pool.written(id, l).value(), pool.length(id).value());
  }
  return all_outputs;
}

TEST(PagedKVCache, RandomTracesMatchDenseHistories) {
  uint64_t seed = 1;
  for (const Shape& sh : kShapes)
    for (int64_t page_size : {1, 3, 16, 64})
      for (int64_t window : {0, 7}) {
        TraceOptions t;
        t.shape = sh;
        t.page_size = page_size;
        // Enough pages for a few sequences, few enough to run out at times.
        t.num_pages = std::max<int64_t>(6, 160 / page_size);
        t.window = window;
        const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF32, DType::kI8,
                                DType::kFp8E4M3};
        t.dtype = dtypes[seed % 5];
        t.softcap = seed % 4 == 1 ? 2.0f : 0.0f;
        t.backend = seed % 5 == 2 ? Backend::kReference : Backend::kAuto;
        t.threads = static_cast<int>(seed % 3) + 1;
        t.seed = ++seed;
        run_trace(t);
      }
}

TEST(PagedKVCache, OutputsAreTheSameBitsForAnyThreadCount) {
  for (const Shape& sh : {kShapes[1], kShapes[3]}) {
    TraceOptions t;
    t.shape = sh;
    t.page_size = 16;
    t.num_pages = 400;
    t.steps = 12;
    t.seed = 99;
    t.threads = 1;
    const std::vector<float> one = run_trace(t);
    for (int threads : {2, 3, 7}) {
      t.threads = threads;
      const std::vector<float> many = run_trace(t);
      ASSERT_EQ(one.size(), many.size());
      EXPECT_EQ(0, std::memcmp(one.data(), many.data(), one.size() * sizeof(float)))
          << sh.name << " threads " << threads;
    }
  }
}

// A sequence's outputs do not depend on what else shares its step: the
// same tokens through a pool of its own give the same bits. The last steps
// decode it among 80 sequences, where a plan made for the whole call
// would stop splitting its 700 keys (kMinTasksWithoutSplit tasks and more).
TEST(PagedKVCache, BatchingDoesNotChangeASequencesBits) {
  const Shape& sh = kShapes[1];
  const int64_t H = sh.num_heads, Hkv = sh.num_kv_heads, D = sh.head_dim, Dv = sh.head_dim_v;
  auto shared = PagedKVCache::create(spec_for(sh, 1, 400, 16, DType::kF32, 0)).value();
  auto alone = PagedKVCache::create(spec_for(sh, 1, 200, 16, DType::kF32, 0)).value();
  std::vector<int64_t> ids;
  for (int s = 0; s < 80; ++s) ids.push_back(shared.add_sequence());
  const int64_t solo = alone.add_sequence();
  attnkit_test::Rng rng(5);
  // Tokens of the first three sequences per step (the others join the last
  // two steps): the first prefills 700 tokens in chunks, then decodes while
  // the others prefill and decode around it.
  const int64_t steps[][3] = {{300, 1, 0}, {400, 0, 9}, {1, 50, 1}, {1, 1, 700},
                              {3, 1, 1},   {1, 4, 1},   {1, 1, 1},  {1, 1, 1}};
  for (size_t step = 0; step < std::size(steps); ++step) {
    std::vector<int64_t> n(steps[step], steps[step] + 3);
    n.resize(ids.size(), step + 2 >= std::size(steps) ? 1 : 0);
    ASSERT_TRUE(shared.append(ids, n).ok());
    ASSERT_TRUE(alone.append(std::vector<int64_t>{solo}, std::vector<int64_t>{n[0]}).ok());
    std::vector<int32_t> cu{0};
    for (int64_t x : n) cu.push_back(cu.back() + int32_t(x));
    const int32_t total = cu.back();
    std::vector<float> q = attnkit_test::uniform_vector(size_t(total * H * D), rng);
    std::vector<float> k = attnkit_test::uniform_vector(size_t(total * Hkv * D), rng);
    std::vector<float> v = attnkit_test::uniform_vector(size_t(total * Hkv * Dv), rng);
    std::vector<float> out(size_t(total * H * Dv)), out_alone(size_t(n[0] * H * Dv));
    ASSERT_TRUE(shared
                    .attend(0, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
                            attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
                            attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}), cu, ids,
                            attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}))
                    .ok());
    const std::vector<int32_t> cu_alone{0, int32_t(n[0])};
    ASSERT_TRUE(alone
                    .attend(0, attnkit::make_view(q.data(), DType::kF32, {n[0], H, D}),
                            attnkit::make_view(k.data(), DType::kF32, {n[0], Hkv, D}),
                            attnkit::make_view(v.data(), DType::kF32, {n[0], Hkv, Dv}), cu_alone,
                            std::vector<int64_t>{solo},
                            attnkit::make_view(out_alone.data(), DType::kF32, {n[0], H, Dv}))
                    .ok());
    EXPECT_EQ(0, std::memcmp(out.data(), out_alone.data(), out_alone.size() * sizeof(float)))
        << "step " << step;
  }
}

TEST(PagedKVCache, ForkSharesPagesAndCopiesThePartlyFilledLastPageOnWrite) {
  const Shape& sh = kShapes[2];
  auto pool = PagedKVCache::create(spec_for(sh, 2, 10, 4, DType::kF32, 0)).value();
  const int64_t a = pool.add_sequence();
  const int64_t H = sh.num_heads, D = sh.head_dim;
  auto step = [&](std::vector<int64_t> ids, std::vector<int64_t> counts) {
    ASSERT_TRUE(pool.append(ids, counts).ok());
    int32_t total = 0;
    std::vector<int32_t> cu{0};
    for (int64_t c : counts) cu.push_back(total += int32_t(c));
    std::vector<float> q(size_t(total * H * D + 1), 0.5f), kv(size_t(total * D + 1), 0.25f),
        out(size_t(total * H * D + 1));
    for (int64_t l = 0; l < 2; ++l)
      ASSERT_TRUE(pool.attend(l, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
                              attnkit::make_view(kv.data(), DType::kF32, {total, 1, D}),
                              attnkit::make_view(kv.data(), DType::kF32, {total, 1, D}), cu, ids,
                              attnkit::make_view(out.data(), DType::kF32, {total, H, D}))
                      .ok());
  };
  step({a}, {6});  // pages: one full (4 tokens), one with 2 of 4
  EXPECT_EQ(pool.pages_in_use(), 2);
  const int64_t b = pool.fork(a).value();
  EXPECT_EQ(pool.page_table(b).value(), pool.page_table(a).value());
  EXPECT_EQ(pool.length(b).value(), 6);
  EXPECT_EQ(pool.pages_in_use(), 2);  // shared, nothing copied
  const std::vector<int32_t> shared = pool.page_table(a).value();
  step({b}, {1});  // b writes into the shared last page: copied first
  const std::vector<int32_t> tb = pool.page_table(b).value();
  EXPECT_EQ(tb[0], shared[0]);  // the full page stays shared
  EXPECT_NE(tb[1], shared[1]);
  EXPECT_EQ(pool.page_table(a).value(), shared);
  EXPECT_EQ(pool.pages_in_use(), 3);
  step({a}, {1});  // a's last page is its own again: no copy
  EXPECT_EQ(pool.page_table(a).value(), shared);
  EXPECT_EQ(pool.pages_in_use(), 3);
  step({a, b}, {2, 2});  // both spill into new pages
  EXPECT_EQ(pool.pages_in_use(), 5);
  EXPECT_TRUE(pool.remove(a).ok());  // b still holds the shared first page
  EXPECT_EQ(pool.pages_in_use(), 3);
  EXPECT_TRUE(pool.remove(b).ok());
  EXPECT_EQ(pool.pages_in_use(), 0);
  EXPECT_EQ(pool.free_pages(), 10);
}

// Reserves `counts` new tokens for `ids` and writes their K/V (layer 0 of a
// one-layer pool of kShapes[2]) without attending.
attnkit::Status append_and_store(PagedKVCache& pool, std::vector<int64_t> ids,
                                 std::vector<int64_t> counts) {
  ATTNKIT_RETURN_IF_ERROR(pool.append(ids, counts));
  std::vector<int32_t> cu{0};
  for (int64_t c : counts) cu.push_back(cu.back() + int32_t(c));
  const int64_t D = kShapes[2].head_dim;
  std::vector<float> kv(size_t(cu.back() * D + 1), 0.25f);
  const TensorView v = attnkit::make_view(kv.data(), DType::kF32, {cu.back(), 1, D});
  return pool.store(0, v, v, cu, ids);
}

// A parent and its fork appended in one call share a partly filled last
// page: the first to write copies it and the other then owns the original,
// so one free page is enough.
TEST(PagedKVCache, ForkAndParentAppendedTogetherCopyTheSharedPageOnce) {
  auto pool = PagedKVCache::create(spec_for(kShapes[2], 1, 3, 4, DType::kF32, 0)).value();
  const int64_t a = pool.add_sequence();
  ASSERT_TRUE(append_and_store(pool, {a}, {6}).ok());  // one full page, one with 2 of 4
  const int64_t b = pool.fork(a).value();
  ASSERT_EQ(pool.free_pages(), 1);
  const std::vector<int32_t> shared = pool.page_table(a).value();
  const attnkit::Status st = append_and_store(pool, {a, b}, {1, 1});
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(pool.free_pages(), 0);
  const std::vector<int32_t> ta = pool.page_table(a).value(), tb = pool.page_table(b).value();
  EXPECT_EQ(ta[0], shared[0]);
  EXPECT_EQ(tb[0], shared[0]);
  EXPECT_NE(ta[1], tb[1]);  // one copied, the other kept the original
  EXPECT_TRUE(ta[1] == shared[1] || tb[1] == shared[1]);
  EXPECT_EQ(pool.length(a).value(), 7);
  EXPECT_EQ(pool.length(b).value(), 7);
}

// A holder outside the call keeps the shared page, so every writer in the
// call copies it; the count is exact both ways.
TEST(PagedKVCache, ASharedPageHeldOutsideTheCallIsCopiedByEveryWriter) {
  auto pool = PagedKVCache::create(spec_for(kShapes[2], 1, 4, 4, DType::kF32, 0)).value();
  const int64_t a = pool.add_sequence();
  ASSERT_TRUE(append_and_store(pool, {a}, {6}).ok());
  const int64_t b = pool.fork(a).value();
  const int64_t c = pool.fork(a).value();
  ASSERT_EQ(pool.free_pages(), 2);
  const int32_t original = pool.page_table(c).value()[1];
  const attnkit::Status st = append_and_store(pool, {a, b}, {1, 1});  // two copies, two free pages
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(pool.free_pages(), 0);
  EXPECT_NE(pool.page_table(a).value()[1], original);
  EXPECT_NE(pool.page_table(b).value()[1], original);
  EXPECT_EQ(pool.page_table(c).value()[1], original);
  // c owns the original alone now: its next token needs no page.
  EXPECT_TRUE(append_and_store(pool, {c}, {1}).ok());
  // a's last page has room for one token; two need a page, and none is free.
  EXPECT_EQ(pool.append(std::vector<int64_t>{a}, std::vector<int64_t>{2}).code(),
            StatusCode::kResourceExhausted);
}

// store() writes a prefix's K/V without attending: a sequence restored
// that way attends exactly like the one that computed them.
TEST(PagedKVCache, StoredPrefixAttendsLikeAComputedOne) {
  const Shape& sh = kShapes[1];
  const int64_t H = sh.num_heads, Hkv = sh.num_kv_heads, D = sh.head_dim, Dv = sh.head_dim_v;
  auto pool = PagedKVCache::create(spec_for(sh, 1, 20, 4, DType::kF32, 0)).value();
  const int64_t a = pool.add_sequence(), b = pool.add_sequence();
  attnkit_test::Rng rng(3);
  const int64_t n = 9;
  std::vector<float> q = attnkit_test::uniform_vector(size_t(n * H * D), rng);
  std::vector<float> k = attnkit_test::uniform_vector(size_t(n * Hkv * D), rng);
  std::vector<float> v = attnkit_test::uniform_vector(size_t(n * Hkv * Dv), rng);
  std::vector<float> out_a(size_t(n * H * Dv)), out_b(out_a.size());
  const std::vector<int32_t> cu{0, int32_t(n - 1)}, cu1{0, 1};
  // a: attends all 9 tokens in two steps. b: stores the first 8, attends the 9th.
  ASSERT_TRUE(pool.append(std::vector<int64_t>{a, b}, std::vector<int64_t>{n - 1, n - 1}).ok());
  auto view = [](std::vector<float>& x, int64_t t0, int64_t t, int64_t heads, int64_t dim) {
    return attnkit::make_view(x.data() + t0 * heads * dim, DType::kF32, {t, heads, dim});
  };
  ASSERT_TRUE(pool.attend(0, view(q, 0, n - 1, H, D), view(k, 0, n - 1, Hkv, D),
                          view(v, 0, n - 1, Hkv, Dv), cu, std::vector<int64_t>{a},
                          view(out_a, 0, n - 1, H, Dv))
                  .ok());
  ASSERT_TRUE(pool.store(0, view(k, 0, n - 1, Hkv, D), view(v, 0, n - 1, Hkv, Dv), cu,
                         std::vector<int64_t>{b})
                  .ok());
  EXPECT_EQ(pool.written(b, 0).value(), n - 1);
  ASSERT_TRUE(pool.append(std::vector<int64_t>{a, b}, std::vector<int64_t>{1, 1}).ok());
  for (int64_t id : {a, b})
    ASSERT_TRUE(pool.attend(0, view(q, n - 1, 1, H, D), view(k, n - 1, 1, Hkv, D),
                            view(v, n - 1, 1, Hkv, Dv), cu1, std::vector<int64_t>{id},
                            view(id == a ? out_a : out_b, n - 1, 1, H, Dv))
                    .ok());
  EXPECT_EQ(0, std::memcmp(out_a.data() + (n - 1) * H * Dv, out_b.data() + (n - 1) * H * Dv,
                           size_t(H * Dv) * sizeof(float)));
  // store() checks what attend() checks: the pending count.
  const attnkit::Status st =
      pool.store(0, view(k, 0, 1, Hkv, D), view(v, 0, 1, Hkv, Dv), cu1, std::vector<int64_t>{a});
  EXPECT_NE(st.message().find("PagedKVCache::store: cu_seqlens_q gives sequence 0 1 new tokens, "
                              "but it has 0 reserved"),
            std::string::npos)
      << st.message();
}

TEST(PagedKVCache, SlidingWindowReleasesPagesNoQueryCanSee) {
  const Shape& sh = kShapes[2];
  const int64_t W = 9, ps = 4;
  auto pool = PagedKVCache::create(spec_for(sh, 1, 6, ps, DType::kF32, W)).value();
  const int64_t a = pool.add_sequence();
  const int64_t H = sh.num_heads, D = sh.head_dim;
  std::vector<float> q(size_t(H * D), 0.5f), kv(size_t(D), 0.25f), out(size_t(H * D));
  // 200 decode steps in a pool of 6 pages of 4: only the window's pages
  // are ever held.
  for (int t = 0; t < 200; ++t) {
    ASSERT_TRUE(pool.append(std::vector<int64_t>{a}, std::vector<int64_t>{1}).ok()) << t;
    ASSERT_TRUE(pool.attend(0, attnkit::make_view(q.data(), DType::kF32, {1, H, D}),
                            attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                            attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                            std::vector<int32_t>{0, 1}, std::vector<int64_t>{a},
                            attnkit::make_view(out.data(), DType::kF32, {1, H, D}))
                    .ok());
    // The next query (position t + 1) sees tokens from t + 2 - W on.
    const int64_t first_seen = std::max<int64_t>(0, t + 2 - W);
    const std::vector<int32_t> table = pool.page_table(a).value();
    for (int64_t p = 0; p < int64_t(table.size()); ++p)
      EXPECT_EQ(table[size_t(p)] < 0, (p + 1) * ps <= first_seen) << "token " << t << " page " << p;
    EXPECT_LE(pool.pages_in_use(), (W + ps - 1) / ps + 1);
  }
}

// Chunked pools (pages of finished chunks released, truncation bounded by
// them) and per-call chunks in a pool without one, with and without sinks,
// against the float64 history of every sequence.
TEST(PagedKVCache, RandomTracesWithChunksAndSinks) {
  uint64_t seed = 900;
  for (const Shape& sh : kShapes)
    for (int64_t page_size : {1, 3, 16})
      for (auto [chunk, call_chunk] : {std::pair<int64_t, int64_t>{5, 0}, {16, 16}, {0, 7}})
        for (bool sinks : {false, true}) {
          TraceOptions t;
          t.shape = sh;
          t.page_size = page_size;
          t.num_pages = std::max<int64_t>(6, 160 / page_size);
          t.chunk = chunk;
          t.call_chunk = call_chunk;
          t.sinks = sinks;
          const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kI8};
          t.dtype = dtypes[seed % 3];
          t.backend = seed % 4 == 1 ? Backend::kReference : Backend::kAuto;
          t.steps = 15;
          t.seed = ++seed;
          run_trace(t);
        }
}

// 200 decode steps with chunks of 6 in a pool of 4 pages of 4 tokens: a
// page is released once the next query's chunk starts after it.
TEST(PagedKVCache, ChunksReleasePagesOfFinishedChunks) {
  const Shape& sh = kShapes[2];
  const int64_t C = 6, ps = 4;
  auto pool = PagedKVCache::create(spec_for(sh, 1, 4, ps, DType::kF32, 0, C)).value();
  const int64_t a = pool.add_sequence();
  const int64_t H = sh.num_heads, D = sh.head_dim;
  std::vector<float> q(size_t(H * D), 0.5f), kv(size_t(D), 0.25f), out(size_t(H * D));
  for (int t = 0; t < 200; ++t) {
    ASSERT_TRUE(pool.append(std::vector<int64_t>{a}, std::vector<int64_t>{1}).ok()) << t;
    ASSERT_TRUE(pool.attend(0, attnkit::make_view(q.data(), DType::kF32, {1, H, D}),
                            attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                            attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                            std::vector<int32_t>{0, 1}, std::vector<int64_t>{a},
                            attnkit::make_view(out.data(), DType::kF32, {1, H, D}))
                    .ok());
    // The next query (position t + 1) sees its chunk from (t + 1) / C * C.
    const int64_t first_seen = (t + 1) / C * C;
    const std::vector<int32_t> table = pool.page_table(a).value();
    for (int64_t p = 0; p < int64_t(table.size()); ++p)
      EXPECT_EQ(table[size_t(p)] < 0, (p + 1) * ps <= first_seen) << "token " << t << " page " << p;
    // Truncating into a released chunk would need released tokens.
    if (first_seen >= ps && (t + 1) % C != 0) {
      const auto st = pool.truncate(a, first_seen - 1);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("its chunks have released"), std::string::npos) << st.message();
    }
  }
  // Bad chunk specs and per-call chunks and sinks.
  EXPECT_NE(PagedKVCache::create(spec_for(sh, 1, 4, ps, DType::kF32, 0, -2))
                .status()
                .message()
                .find("spec.chunk_size = -2 must be >= 0"),
            std::string::npos);
  EXPECT_NE(PagedKVCache::create(spec_for(sh, 1, 4, ps, DType::kF32, 3, 4))
                .status()
                .message()
                .find("are both set"),
            std::string::npos);
  ASSERT_TRUE(pool.append(std::vector<int64_t>{a}, std::vector<int64_t>{1}).ok());
  const Snapshot before = snapshot(pool);
  std::vector<float> bad_sinks(size_t(H), 0.0f);
  bad_sinks[1] = std::numeric_limits<float>::quiet_NaN();
  std::vector<AttentionOptions> bad(3);
  bad[0].chunk_size = 5;
  bad[1].sinks = attnkit::make_view(bad_sinks.data(), DType::kF32, {H});
  bad[2].sinks = attnkit::make_view(bad_sinks.data(), DType::kF32, {H - 1});
  const char* needles[] = {"options.chunk_size = 5 must be 0 or the pool's chunk_size = 6",
                           "options.sinks[1] = nan must be finite", "options.sinks.shape[0]"};
  for (size_t i = 0; i < bad.size(); ++i) {
    const auto st = pool.attend(0, attnkit::make_view(q.data(), DType::kF32, {1, H, D}),
                                attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                                attnkit::make_view(kv.data(), DType::kF32, {1, 1, D}),
                                std::vector<int32_t>{0, 1}, std::vector<int64_t>{a},
                                attnkit::make_view(out.data(), DType::kF32, {1, H, D}), bad[i]);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(needles[i]), std::string::npos) << st.message();
    EXPECT_TRUE(snapshot(pool) == before);
  }
}

// The bad calls of each method: kInvalidArgument or kNotFound naming the
// argument, and no change to the pool.
TEST(PagedKVCache, RejectsBadArgumentsAndChangesNothing) {
  const Shape& sh = kShapes[1];
  const int64_t H = sh.num_heads, Hkv = sh.num_kv_heads, D = sh.head_dim, Dv = sh.head_dim_v;
  auto pool = PagedKVCache::create(spec_for(sh, 2, 8, 4, DType::kF32, 0)).value();
  const int64_t a = pool.add_sequence(), b = pool.add_sequence();
  ASSERT_TRUE(pool.append(std::vector<int64_t>{a, b}, std::vector<int64_t>{3, 2}).ok());
  const Snapshot before = snapshot(pool);
  auto expect = [&](const attnkit::Status& st, StatusCode code, const std::string& needle) {
    EXPECT_EQ(st.code(), code) << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_TRUE(snapshot(pool) == before) << needle;
  };
  const std::vector<int64_t> ab{a, b};
  expect(pool.append(std::vector<int64_t>{a, 77}, std::vector<int64_t>{1, 1}),
         StatusCode::kNotFound, "PagedKVCache::append: sequence 77 does not exist");
  expect(pool.append(std::vector<int64_t>{a, a}, std::vector<int64_t>{1, 1}),
         StatusCode::kInvalidArgument, "seq_ids[1] = 0 repeats seq_ids[0]");
  expect(pool.append(ab, std::vector<int64_t>{1, -1}), StatusCode::kInvalidArgument,
         "num_new_tokens[1] = -1 must be >= 0");
  expect(pool.append(ab, std::vector<int64_t>{1}), StatusCode::kInvalidArgument,
         "seq_ids has 2 entries and num_new_tokens 1");
  expect(pool.append(ab, std::vector<int64_t>{20, 20}), StatusCode::kResourceExhausted,
         "40 new tokens need 10 free pages of 4 tokens, and 6 of 8 are free");
  expect(pool.fork(a).status(), StatusCode::kInvalidArgument,
         "sequence 0 has 3 reserved tokens that layer 0 has not written");
  expect(pool.remove(9), StatusCode::kNotFound, "PagedKVCache::remove: sequence 9 does not exist");
  expect(pool.truncate(a, 4), StatusCode::kInvalidArgument,
         "new_length = 4 must be in [0, length = 3] for sequence 0");

  std::vector<float> q(size_t(5 * H * D)), k(size_t(5 * Hkv * D)), v(size_t(5 * Hkv * Dv)),
      out(size_t(5 * H * Dv), -3.0f);
  auto attend = [&](int64_t layer, std::vector<int32_t> cu, std::vector<int64_t> ids,
                    AttentionOptions o = {}, int64_t total = 5) {
    return pool.attend(layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
                       attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
                       attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}), cu, ids,
                       attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o);
  };
  expect(attend(2, {0, 3, 5}, ab), StatusCode::kInvalidArgument,
         "layer = 2 must be in [0, num_layers = 2)");
  expect(attend(0, {0, 2, 5}, ab), StatusCode::kInvalidArgument,
         "cu_seqlens_q gives sequence 0 2 new tokens, but it has 3 reserved tokens that layer 0 "
         "has not written");
  expect(attend(0, {0, 3, 4}, ab), StatusCode::kInvalidArgument,
         "cu_seqlens_q[2] = 4 must equal k_new.shape[0] = 5");
  expect(attend(0, {0, 3, 5}, {a, 12}), StatusCode::kNotFound, "sequence 12 does not exist");
  expect(attend(0, {0, 3, 5}, {a, a}), StatusCode::kInvalidArgument,
         "seq_ids[1] = 0 repeats seq_ids[0]");
  AttentionOptions masked;
  std::vector<uint8_t> mask(1, 1);
  masked.mask = attnkit::make_view(mask.data(), DType::kBool, {1, 1, 1, 1});
  expect(attend(0, {0, 3, 5}, ab, masked), StatusCode::kInvalidArgument,
         "options.mask is not supported");
  auto held = [&](int64_t layer, std::vector<int32_t> cu, std::vector<int64_t> ids,
                  AttentionOptions o = {}, int64_t total = 5) {
    return pool.attend_held(layer, attnkit::make_view(q.data(), DType::kF32, {total, H, D}), cu,
                            ids, attnkit::make_view(out.data(), DType::kF32, {total, H, Dv}), o);
  };
  expect(held(2, {0, 3, 5}, ab), StatusCode::kInvalidArgument,
         "PagedKVCache::attend_held: layer = 2 must be in [0, num_layers = 2)");
  expect(held(0, {0, 3, 4}, ab), StatusCode::kInvalidArgument,
         "cu_seqlens_q[2] = 4 must equal q.shape[0] = 5");
  expect(held(0, {0, 3, 5}, {a, 12}), StatusCode::kNotFound, "sequence 12 does not exist");
  expect(held(0, {0, 3, 5}, {b, b}), StatusCode::kInvalidArgument,
         "seq_ids[1] = 1 repeats seq_ids[0]");
  AttentionOptions causal;
  causal.causal = true;
  expect(held(0, {0, 3, 5}, ab, causal), StatusCode::kInvalidArgument,
         "PagedKVCache::attend_held: options.causal must be false");
  AttentionOptions windowed;
  windowed.window_size = {4, 0};
  expect(held(0, {0, 3, 5}, ab, windowed), StatusCode::kInvalidArgument,
         "options.window_size must be (-1, -1)");
  expect(held(0, {0, 3, 5}, ab, masked), StatusCode::kInvalidArgument,
         "PagedKVCache::attend_held: options.mask is not supported");
  {
    auto window_pool = PagedKVCache::create(spec_for(sh, 1, 8, 4, DType::kF32, 6)).value();
    const int64_t w = window_pool.add_sequence();
    const attnkit::Status st = window_pool.attend_held(
        0, attnkit::make_view(q.data(), DType::kF32, {1, H, D}), std::vector<int32_t>{0, 1},
        std::vector<int64_t>{w}, attnkit::make_view(out.data(), DType::kF32, {1, H, Dv}));
    EXPECT_NE(st.message().find("the pool's sliding_window = 6 must be 0"), std::string::npos)
        << st.message();
  }
  for (float x : out) ASSERT_EQ(x, -3.0f);
  // Nothing written yet: held attention gives 0 (and lse -inf, checked in
  // the traces), and changes nothing.
  ASSERT_TRUE(held(0, {0, 3, 5}, ab).ok());
  for (float x : out) ASSERT_EQ(x, 0.0f);
  EXPECT_TRUE(snapshot(pool) == before);
  // The same call, unbroken, succeeds (so the checks above were the cause).
  ASSERT_TRUE(attend(0, {0, 3, 5}, ab).ok());

  const PagedKVCacheSpec bad[] = {
      spec_for(sh, 0, 8, 4, DType::kF32, 0), spec_for(sh, 1, 0, 4, DType::kF32, 0),
      spec_for(sh, 1, 8, 0, DType::kF32, 0), spec_for(sh, 1, 8, 4, DType::kF16, 0),
      spec_for(sh, 1, 8, 4, DType::kF32, -1)};
  const char* needles[] = {"spec.num_layers = 0 must be >= 1", "spec.num_pages = 0 must be >= 1",
                           "spec.page_size = 0 must be >= 1",
                           "spec.dtype = f16 must be f32, bf16, int8 or fp8_e4m3",
                           "spec.sliding_window = -1 must be >= 0"};
  for (size_t i = 0; i < std::size(bad); ++i) {
    auto r = PagedKVCache::create(bad[i]);
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(needles[i]), std::string::npos) << r.status().message();
  }
  PagedKVCacheSpec mixed = spec_for(kShapes[3], 1, 8, 4, DType::kF32, 0);
  mixed.num_kv_heads = 2;
  auto r = PagedKVCache::create(mixed);
  EXPECT_NE(r.status().message().find("must be 0 with the latent layout"), std::string::npos)
      << r.status().message();
}

}  // namespace
