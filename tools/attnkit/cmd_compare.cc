// attnkit compare: the seeds' comparison table, measured. Builds MHA, MQA,
// GQA and MLA layers of one size, runs a prefill and decode steps on this
// machine, and prints sizes, FLOPs, latencies, achieved rates (also as
// fractions of the peak and bandwidth measured in the same process) and how
// far each variant's output is from MHA's when its weights are derived from
// MHA's.
//
// Design choices (docs/TOOL.md explains them for users):
// - Layers are causal decoders with RoPE (theta 10000, half-split), as every
//   model the variants are used in; --no-rope gives the seeds' modules,
//   which have none. MLA always has its decoupled RoPE.
// - MHA weights are seeded random; GQA/MQA K/V projections (and biases)
//   are the mean of MHA's K/V heads in each group, the GQA paper's
//   checkpoint conversion, and Q/O are MHA's, so "diff vs MHA" measures
//   what the conversion loses. MLA has its own random weights (no exact
//   conversion exists: its latent RMSNorm and decoupled RoPE are not
//   linear in MHA's weights), so its diff is n/a.
// - mla-dsa is the mla layer with DeepSeek-V3.2's lightning indexer (64
//   heads of 128, top --index-topk keys, 2048 by default): its decode and
//   prefill attend only to each query's chosen keys. The indexer's query
//   reads MLA's compressed query, so with mla-dsa in the list both MLA rows
//   get a q_lora_rank (3 x kv_lora_rank, DeepSeek-V3's ratio) and differ
//   only by the indexer. Its caches are filled by the layer itself (the
//   indexer keys cannot be derived from latent rows).
// - Decode caches are filled cheaply (random K/V appended through a
//   block-sparse pattern, see fill_kv_cache), since only their size, not
//   their values, sets the decode time. Each variant is decoded on enough copies of (layer, cache)
//   that one step's bytes are not still in the last-level cache from the
//   step before.
// - The serving section runs the variants' layers under the serving engine
//   of `attnkit serve-bench` (attnkit/serve.h) on one small trace and one
//   KV budget: the concurrency and throughput the seeds' claim is about.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "attnkit/analysis.h"
#include "attnkit/attention_layer.h"
#include "attnkit/config.h"
#include "attnkit/latent_attention.h"
#include "attnkit/report.h"
#include "attnkit/serve.h"
#include "cli.h"
#include "commands.h"
#include "measure.h"

namespace attnkit::cli {
namespace {

// Decode rotates (layer, cache) copies until they total this: four times
// this machine's 32 MiB L3, as bench's --rotate default.
constexpr int64_t kRotateBytes = int64_t{128} << 20;
constexpr int kMaxInstances = 4;

// The column of each variant's output distance from MHA's: a drift caused by
// pooling MHA's weights, not an error (see the footnote under the table).
constexpr const char* kDriftHeader = "pooling drift";

struct Options {
  int64_t d_model = 2048, heads = 32, prompt = 256, context = 4096, batch = 1;
  int64_t head_dim = 0;  // 0 = d_model / heads; --model sets the model's
  std::string model, config;
  int64_t steps = 8, repeats = 3, threads = 0, seed = 1;
  int64_t mla_rank = 0, mla_rope_dim = 0;
  int64_t index_topk = 2048;  // mla-dsa
  std::string kv = "f32", backend = "auto";
  std::vector<std::string> variants = {"mha", "gqa-8", "gqa-4", "mqa", "mla"};
  bool has_variant(const std::string& v) const {
    return std::find(variants.begin(), variants.end(), v) != variants.end();
  }
  bool bias = false, no_rope = false, json = false, no_serve = false;
  double peak = 0, bw = 0;
};

Tensor zeros(std::initializer_list<int64_t> shape, DType dtype = DType::kF32) {
  return value_or_throw(Tensor::zeros(dtype, shape), "allocating a buffer");
}

// What a variant's rows report.
struct Measured {
  std::string variant;
  ModelShape shape;
  bool derived = false;  // weights derived from MHA's
  Timing prefill, decode;
  int instances = 1;
  double diff = -1;  // relative L2 vs MHA; < 0 = n/a
};

// MHA's weights in nn.Linear layout, and the GQA/MQA ones derived from them.
class Weights {
 public:
  void add(const std::string& name, Tensor t) {
    views_[name] = t.view();
    owned_.push_back(std::move(t));
  }
  const WeightMap& map() const { return views_; }
  const TensorView& operator[](const std::string& name) const { return views_.at(name); }

 private:
  std::vector<Tensor> owned_;
  WeightMap views_;
};

// q/k/v_proj [heads * head_dim, d_model], o_proj [d_model, heads * head_dim].
Weights random_mha_weights(const Options& o, int64_t head_dim) {
  const int64_t d = o.d_model, inner = o.heads * head_dim;
  Weights w;
  uint64_t seed = static_cast<uint64_t>(o.seed) * 16;
  for (const char* n : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    const bool out = n[0] == 'o';
    const int64_t rows = out ? d : inner, cols = out ? inner : d;
    Tensor t = zeros({rows, cols});
    fill_uniform(t.view(), seed++, 1.0 / std::sqrt(static_cast<double>(cols)));
    w.add(std::string(n) + ".weight", std::move(t));
    if (o.bias) {
      Tensor b = zeros({rows});
      fill_uniform(b.view(), seed++, 0.1);
      w.add(std::string(n) + ".bias", std::move(b));
    }
  }
  return w;
}

// Mean of the rows of each group of `heads / groups` consecutive heads:
// src [heads * head_dim, (in)] -> [groups * head_dim, (in)] (rank 1 or 2).
Tensor mean_pool_heads(const TensorView& src, int64_t heads, int64_t groups) {
  const int64_t head_dim = src.shape[0] / heads, per = heads / groups;
  const int64_t in = src.rank == 2 ? src.shape[1] : 1;
  Tensor dst = src.rank == 2 ? zeros({groups * head_dim, in}) : zeros({groups * head_dim});
  const float* s = src.ptr<const float>();
  float* out = dst.ptr<float>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < head_dim; ++r) {
      float* row = out + (g * head_dim + r) * in;
      for (int64_t h = g * per; h < (g + 1) * per; ++h) {
        const float* srow = s + (h * head_dim + r) * in;
        for (int64_t c = 0; c < in; ++c) row[c] += srow[c];
      }
      for (int64_t c = 0; c < in; ++c) row[c] /= static_cast<float>(per);
    }
  return dst;
}

Weights derived_weights(const Weights& mha, const Options& o, int64_t kv_heads) {
  Weights w;
  for (const auto& [name, view] : mha.map()) {
    const bool kv = name.rfind("k_proj.", 0) == 0 || name.rfind("v_proj.", 0) == 0;
    if (kv) {
      w.add(name, mean_pool_heads(view, o.heads, kv_heads));
    } else {
      Tensor t = view.rank == 2 ? zeros({view.shape[0], view.shape[1]}) : zeros({view.shape[0]});
      std::copy_n(view.ptr<const float>(), view.numel(), t.ptr<float>());
      w.add(name, std::move(t));
    }
  }
  return w;
}

// MLA's weights by their Hugging Face names: q_proj, or q_a_proj +
// q_a_layernorm + q_b_proj with a q_lora_rank; the indexer's with DSA.
Weights random_mla_weights(const MlaConfig& c, uint64_t seed) {
  const int64_t d = c.hidden_size, H = c.num_attention_heads, dq = c.q_lora_rank;
  const int64_t hi = c.index_n_heads, di = c.index_head_dim;
  const auto stdev = [](int64_t fan_in) { return 1.0 / std::sqrt(static_cast<double>(fan_in)); };
  Weights w;
  const auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    Tensor t = zeros({rows, cols});
    fill_uniform(t.view(), seed++, stdev(cols));
    w.add(name, std::move(t));
  };
  const auto constant = [&](const std::string& name, int64_t n, float value) {
    Tensor t = zeros({n});
    std::fill_n(t.ptr<float>(), n, value);
    w.add(name, std::move(t));
  };
  if (dq > 0) {
    matrix("q_a_proj.weight", dq, d);
    constant("q_a_layernorm.weight", dq, 1.0f);
    matrix("q_b_proj.weight", H * c.qk_head_dim(), dq);
  } else {
    matrix("q_proj.weight", H * c.qk_head_dim(), d);
  }
  matrix("kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d);
  matrix("kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
  matrix("o_proj.weight", d, H * c.v_head_dim);
  constant("kv_a_layernorm.weight", c.kv_lora_rank, 1.0f);
  if (c.sparse()) {
    matrix("indexer.wq_b.weight", hi * di, dq);
    matrix("indexer.wk.weight", di, d);
    constant("indexer.k_norm.weight", di, 1.0f);
    constant("indexer.k_norm.bias", di, 0.0f);
    matrix("indexer.weights_proj.weight", hi, d);
  }
  return w;
}

// Appends `context` tokens of random K/V to the cache at little cost: the
// queries that KVCache::attend needs are given num_kv_heads heads (group
// size 1, so MQA's fill does 1/num_heads of the work) and a block-sparse
// pattern that shows each query its own 1024-token block and one
// 128-token block from each earlier one (kernels skip blocks no query
// sees); their outputs are thrown away.
void fill_kv_cache(KVCache* cache, int64_t context, const RunOptions& run, uint64_t seed) {
  const KVCacheSpec& s = cache->spec();
  const int64_t B = s.batch_size, Hkv = s.num_kv_heads, D = s.head_dim;
  const int64_t chunk = std::min<int64_t>(context, 1024);
  Tensor q = zeros({B, chunk, Hkv, D}), k = zeros({B, chunk, Hkv, D}),
         v = zeros({B, chunk, Hkv, D}), out = zeros({B, chunk, Hkv, D});
  fill_uniform(q.view(), seed, 1.0);
  AttentionOptions opt;
  opt.sparse = {SparsePattern::Kind::kFixed, /*block_size=*/128, /*stride=*/8, /*summary=*/1};
  opt.backend = run.backend;
  opt.num_threads = run.num_threads;
  for (int64_t t = 0; t < context; t += chunk) {
    const int64_t n = std::min(chunk, context - t);
    fill_uniform(k.view(), seed + 1 + static_cast<uint64_t>(t), 1.0);
    fill_uniform(v.view(), seed + 2 + static_cast<uint64_t>(t), 1.0);
    auto view = [&](const Tensor& x) { return make_view(x.data(), DType::kF32, {B, n, Hkv, D}); };
    ok_or_throw(cache->attend(view(q), view(k), view(v), view(out), opt), "filling the KV cache");
  }
}

// A DSA layer's cache, filled by the layer's own forward over random
// hidden states (its indexer keys cannot be appended as rows): the
// sparse prefill of `context` tokens, 1024 at a time.
void fill_sparse_latent_cache(LatentAttention& layer, LatentCache* cache, int64_t context,
                              int64_t hidden, const RunOptions& run, uint64_t seed) {
  const int64_t B = cache->batch_size();
  const int64_t chunk = std::min<int64_t>(context, 1024);
  Tensor x = zeros({B, chunk, hidden}), y = zeros({B, chunk, hidden});
  for (int64_t t = 0; t < context; t += chunk) {
    const int64_t n = std::min(chunk, context - t);
    fill_uniform(x.view(), seed + static_cast<uint64_t>(t), 1.0);
    auto view = [&](const Tensor& a) { return make_view(a.data(), DType::kF32, {B, n, hidden}); };
    ok_or_throw(layer.forward(view(x), view(y), {}, cache, run), "filling the DSA cache");
  }
}

void fill_latent_cache(LatentCache* cache, int64_t context, uint64_t seed) {
  const int64_t B = cache->batch_size(), W = cache->values_per_token();
  const int64_t chunk = std::min<int64_t>(context, 1024);
  Tensor rows = zeros({B, chunk, W});
  for (int64_t t = 0; t < context; t += chunk) {
    const int64_t n = std::min(chunk, context - t);
    fill_uniform(rows.view(), seed + static_cast<uint64_t>(t), 1.0);
    ok_or_throw(cache->append(make_view(rows.data(), DType::kF32, {B, n, W})),
                "filling the latent cache");
  }
}

// Copies of (layer, cache) so that consecutive decode steps read different
// memory; enough for kRotateBytes, at most kMaxInstances.
int instances_for(double bytes_per_instance) {
  const double n = std::ceil(static_cast<double>(kRotateBytes) / std::max(bytes_per_instance, 1.0));
  return static_cast<int>(std::clamp(n, 1.0, static_cast<double>(kMaxInstances)));
}

// Times prefill (returning its output in *y) and decode for one layer type.
// make() builds a layer with the variant's weights; new_cache() and fill()
// prepare a cache for it.
template <typename Layer, typename Cache, typename Forward>
void measure(const Options& o, const ModelShape& shape, DType kv,
             const std::function<Layer()>& make,
             const std::function<Cache(Layer&, int64_t)>& new_cache,
             const std::function<void(Layer&, Cache*, uint64_t)>& fill, const Forward& forward,
             const TensorView& x, const TensorView& y, Measured* m) {
  std::vector<Layer> layers;
  layers.push_back(make());
  m->prefill =
      time_median([&](int64_t) { ok_or_throw(forward(layers[0], x, y, nullptr), "prefill"); }, 0.0,
                  static_cast<int>(o.repeats), static_cast<int>(o.repeats));

  const int64_t max_len = o.context + o.steps + 2;
  const double per_instance = static_cast<double>(attention_params_per_layer(shape)) * 4.0 +
                              kv_cache_bytes(shape, kv, max_len, o.batch);
  m->instances = instances_for(per_instance);
  while (static_cast<int>(layers.size()) < m->instances) layers.push_back(make());
  std::vector<Cache> caches;
  for (int i = 0; i < m->instances; ++i) {
    caches.push_back(new_cache(layers[static_cast<size_t>(i)], max_len));
    fill(layers[static_cast<size_t>(i)], &caches.back(),
         static_cast<uint64_t>(o.seed) * 1000 + static_cast<uint64_t>(i));
  }
  Tensor x1 = zeros({o.batch, 1, o.d_model}), y1 = zeros({o.batch, 1, o.d_model});
  fill_uniform(x1.view(), static_cast<uint64_t>(o.seed) + 7, 1.0);
  m->decode = time_median(
      [&](int64_t i) {
        const size_t r = static_cast<size_t>(i % m->instances);
        ok_or_throw(forward(layers[r], x1.view(), y1.view(), &caches[r]), "decode");
      },
      0.0, static_cast<int>(o.steps), static_cast<int>(o.steps), /*max_calls_per_sample=*/1);
}

double relative_l2(const TensorView& a, const TensorView& ref) {
  double num = 0, den = 0;
  const float* pa = a.ptr<const float>();
  const float* pr = ref.ptr<const float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(pa[i]) - pr[i];
    num += d * d;
    den += static_cast<double>(pr[i]) * pr[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

Backend parse_backend(const std::string& s) {
  if (s == "auto") return Backend::kAuto;
  if (s == "fast") return Backend::kFast;
  if (s == "reference") return Backend::kReference;
  throw UsageError{"--backend must be auto, fast or reference, got '" + s + "'"};
}

// The serving section: 16 requests arriving at once (prompts of 16-64
// tokens, outputs of 8-32, seeded), one layer per variant with bf16
// weights, served with a KV budget of MHA's cache for 4 of these requests
// (paged, pages of 16 tokens): the sequences each variant's cache lets run
// at once, and the output tokens per second that gives here.
struct Serving {
  int64_t budget = 0, requests = 0, token_slots = 0;
  struct Row {
    std::string variant;
    int64_t kv_bytes_per_token = 0, peak = 0, preemptions = 0;
    double mean = 0, tokens_per_s = 0;
  };
  std::vector<Row> rows;
};

// mha_token: MHA's KV bytes per token of one layer in `kv` (scales included).
Serving serve_variants(const Options& o,
                       const std::vector<std::pair<std::string, serve::ModelSpec>>& specs, DType kv,
                       int64_t mha_token, const RunOptions& run, Progress* progress) {
  constexpr int64_t kRequests = 16, kMhaSequences = 4, kPage = 16;
  Serving out;
  serve::TraceOptions to;
  to.requests = kRequests;
  to.prompt_min = 16;
  to.prompt_max = 64;
  to.output_min = 8;
  to.output_max = 32;
  to.seed = static_cast<uint64_t>(o.seed);
  const std::vector<serve::Request> trace = serve::synthetic_trace(to);
  for (const serve::Request& r : trace)
    out.token_slots += static_cast<int64_t>(r.prompt_token_ids.size()) + r.output_tokens - 1;
  out.requests = kRequests;
  const int64_t pages = (out.token_slots * kMhaSequences / kRequests + kPage - 1) / kPage;
  out.budget = pages * kPage * mha_token;
  EngineOptions so;
  so.kv_memory = out.budget;
  so.page_size = kPage;
  so.kv_dtype = kv;
  so.run = run;
  for (const auto& [name, spec] : specs) {
    progress->step("serving " + name);
    serve::SyntheticModel model =
        value_or_throw(serve::SyntheticModel::create(spec), name + " serving model");
    const serve::Report r = value_or_throw(serve::run(model, trace, so), name + " serving");
    int64_t outputs = 0;
    for (const serve::RequestReport& q : r.requests) outputs += q.metrics.output_tokens;
    out.rows.push_back({name, r.kv_bytes_per_token, r.stats.peak_running, r.stats.preemptions,
                        r.mean_running,
                        static_cast<double>(outputs) / std::max(r.end_s - r.start_s, 1e-9)});
  }
  return out;
}

// The one sentence under the serving table: what the cache size did to
// concurrency and throughput, between the largest and smallest cache.
std::string serving_sentence(const Serving& s) {
  if (s.rows.size() < 2) return "";
  const auto by_kv = [](const Serving::Row& a, const Serving::Row& b) {
    return a.kv_bytes_per_token < b.kv_bytes_per_token;
  };
  const Serving::Row& small = *std::min_element(s.rows.begin(), s.rows.end(), by_kv);
  const Serving::Row& big = *std::max_element(s.rows.begin(), s.rows.end(), by_kv);
  if (small.kv_bytes_per_token == big.kv_bytes_per_token) return "";
  char line[600];
  std::snprintf(
      line, sizeof line,
      "With the KV cache capped at %s (MHA's for 4 of these %lld requests), %s (%s per "
      "token) ran %s sequences per step on average and %s (%s) %s, so %s produced %s %s's "
      "output tokens per second: a smaller cache per token lets more sequences share a "
      "step, and a step reads the weights once for all of them.",
      format_bytes(static_cast<double>(s.budget)).c_str(), (long long)s.requests,
      small.variant.c_str(), format_bytes(static_cast<double>(small.kv_bytes_per_token)).c_str(),
      format_sig3(small.mean, "").c_str(), big.variant.c_str(),
      format_bytes(static_cast<double>(big.kv_bytes_per_token)).c_str(),
      format_sig3(big.mean, "").c_str(), small.variant.c_str(),
      format_ratio(small.tokens_per_s / big.tokens_per_s).c_str(), big.variant.c_str());
  return line;
}

std::string percent_cell(double rate, double of) { return of > 0 ? roof_percent(rate / of) : "-"; }

// --model / --config: the layer compare builds takes the model's attention
// sizes (its hidden size, heads and head_dim); the model itself is kept
// for the whole-model section.
ModelShape adopt_model(Options* o, const Flags& f) {
  ModelShape m = load_model(o->model, o->config);
  if (f.given("--d-model") || f.given("--heads"))
    throw UsageError{"--model and --config set the sizes; drop --d-model and --heads"};
  if (m.mla)
    throw UsageError{"compare --model: " + m.name +
                     " is MLA, whose q·k and v widths differ; compare builds MHA, GQA and MQA "
                     "layers of one head_dim (attnkit analyze gives its figures)"};
  if (attention_params_per_layer(m) == 0 || m.num_heads < 1)
    throw UsageError{"compare --model: " + m.name + " has no attention layer"};
  o->d_model = m.hidden_size;
  o->heads = m.num_heads;
  o->head_dim = m.head_dim;
  return m;
}

// The whole model under each variant: per-layer sums (analysis.h).
// The variants to run, parsed before anything runs so a bad name costs
// nothing: each with its one-layer shape, its layer config (not MLA) and,
// with --model, the whole model as that variant.
struct Plan {
  std::string name;
  ModelShape shape;
  AttentionConfig config;  // not MLA
  ModelShape model;        // the whole model as this variant (--model)
};

// What the command line asks for, resolved: the sizes, the base layer
// shape and the variants' plans.
struct Setup {
  bool whole_model = false;
  ModelShape model;  // --model / --config
  ModelShape base;   // one MHA layer of the compared size
  int64_t head_dim = 0;
  DType kv = DType::kF32;
  RunOptions run;
  std::vector<Plan> plans;
};

Plan plan_variant(const std::string& v, const Options& o, const Setup& s) {
  Plan p;
  p.name = v;
  p.shape = s.base;
  p.model = s.model;
  if (v == "mla" || v == "mla-dsa") {
    // With mla-dsa in the list both MLA rows have a compressed query (the
    // indexer reads it), so that they differ by the indexer alone.
    const int64_t q_rank = o.has_variant("mla-dsa") ? 3 * o.mla_rank : 0;
    auto m = with_mla(s.base, o.mla_rank, o.mla_rope_dim, q_rank);
    if (!m.ok()) throw UsageError{v + ": " + m.status().message()};
    if (o.mla_rope_dim < 2) throw UsageError{"--mla-rope-dim must be >= 2"};
    p.shape = *m;
    if (s.whole_model)
      p.model = value_or_throw(with_mla(s.model, o.mla_rank, o.mla_rope_dim, q_rank), v);
    if (v == "mla-dsa")  // DeepSeek-V3.2's indexer
      for (ModelShape* shape : {&p.shape, &p.model}) {
        shape->index_n_heads = 64;
        shape->index_head_dim = 128;
        shape->index_topk = o.index_topk;
      }
    return p;
  }
  auto c = attention_config_from_variant(v, o.d_model, o.heads, o.bias);
  if (!c.ok()) throw UsageError{"--variants: " + c.status().message()};
  p.config = *c;
  p.config.causal = true;
  p.config.use_rope = !o.no_rope;
  p.config.head_dim = s.head_dim;
  p.config.rope.head_dim = s.head_dim;
  p.shape = *with_kv_heads(s.base, p.config.num_kv_heads);
  if (s.whole_model) p.model = value_or_throw(with_kv_heads(s.model, p.config.num_kv_heads), v);
  return p;
}

// Checks the sizes and fills in what the flags left to defaults.
Setup resolve(Options* po, const Flags& f) {
  Options& o = *po;
  Setup s;
  s.whole_model = !o.model.empty() || !o.config.empty();
  if (s.whole_model) s.model = adopt_model(&o, f);
  // The default list drops the GQA sizes a smaller --heads cannot have.
  if (o.variants == Options{}.variants)
    std::erase_if(o.variants, [&](const std::string& v) {
      return v.rfind("gqa-", 0) == 0 &&
             (o.heads <= std::stoll(v.substr(4)) || o.heads % std::stoll(v.substr(4)));
    });
  s.kv = kv_dtype_of(o.kv);
  s.run = RunOptions{parse_backend(o.backend), static_cast<int>(o.threads)};
  if (!s.whole_model && o.d_model % o.heads != 0)
    throw UsageError{"--d-model " + std::to_string(o.d_model) + " must be divisible by --heads " +
                     std::to_string(o.heads)};
  s.head_dim = o.head_dim > 0 ? o.head_dim : o.d_model / o.heads;
  if (!o.no_rope && s.head_dim % 2 != 0)
    throw UsageError{"head_dim = d_model / heads = " + std::to_string(s.head_dim) +
                     " must be even for RoPE (or give --no-rope)"};
  if (o.mla_rank == 0) o.mla_rank = default_mla_rank(s.head_dim);
  if (o.mla_rope_dim == 0) o.mla_rope_dim = default_mla_rope_dim(s.head_dim);
  ModelShape& b = s.base;
  b.name = "d_model " + std::to_string(o.d_model);
  b.num_layers = 1;
  b.hidden_size = o.d_model;
  b.num_heads = b.num_kv_heads = o.heads;
  b.head_dim = b.head_dim_v = s.head_dim;
  b.q_bias = b.k_bias = b.v_bias = b.o_bias = o.bias;
  b.source = "attnkit compare";
  for (const std::string& v : o.variants) s.plans.push_back(plan_variant(v, o, s));
  return s;
}

// Builds one variant's layer(s), times them and returns the row; its
// prefill output lands in *y.
Measured measure_variant(const Options& o, const Setup& s, const Plan& p, const Weights& mha,
                         const TensorView& x, const TensorView& y) {
  Measured m;
  m.variant = p.name;
  m.shape = p.shape;
  const DType kv = s.kv;
  const RunOptions& run = s.run;
  if (p.shape.mla) {
    const MlaConfig c = mla_layer_config(p.shape);
    const Weights w = random_mla_weights(c, static_cast<uint64_t>(o.seed) * 16 + 8);
    measure<LatentAttention, LatentCache>(
        o, p.shape, kv,
        [&] {
          LatentAttention l = value_or_throw(LatentAttention::create(c), "mla");
          ok_or_throw(l.load_weights(w.map()), "mla weights");
          return l;
        },
        [&](LatentAttention& l, int64_t len) {
          return value_or_throw(l.new_cache(o.batch, len, kv), "mla cache");
        },
        [&](LatentAttention& l, LatentCache* cache, uint64_t seed) {
          if (c.sparse())
            fill_sparse_latent_cache(l, cache, o.context, o.d_model, run, seed);
          else
            fill_latent_cache(cache, o.context, seed);
        },
        [&](LatentAttention& l, const TensorView& in, const TensorView& out, LatentCache* cache) {
          return l.forward(in, out, {}, cache, run);
        },
        x, y, &m);
    return m;
  }
  const bool is_mha = p.config.num_kv_heads == o.heads;
  const Weights derived = is_mha ? Weights{} : derived_weights(mha, o, p.config.num_kv_heads);
  const Weights& w = is_mha ? mha : derived;
  m.derived = true;
  measure<AttentionLayer, KVCache>(
      o, p.shape, kv,
      [&] {
        AttentionLayer l = value_or_throw(AttentionLayer::create(p.config), p.name);
        ok_or_throw(l.load_weights(w.map()), p.name + " weights");
        return l;
      },
      [&](AttentionLayer& l, int64_t len) {
        return value_or_throw(l.new_cache(o.batch, len, kv), p.name + " cache");
      },
      [&](AttentionLayer&, KVCache* cache, uint64_t seed) {
        fill_kv_cache(cache, o.context, run, seed);
      },
      [&](AttentionLayer& l, const TensorView& in, const TensorView& out, KVCache* cache) {
        return l.forward(in, out, {}, cache, run);
      },
      x, y, &m);
  return m;
}

// The serving section's variants under the serving engine.
Serving serve_plans(const Options& o, const Setup& s, Progress* progress) {
  std::vector<std::pair<std::string, serve::ModelSpec>> specs;
  for (const Plan& p : s.plans) {
    serve::ModelSpec spec;
    spec.mla = p.shape.mla;
    if (spec.mla)
      spec.latent = mla_layer_config(p.shape);
    else
      spec.attention = p.config;
    spec.seed = static_cast<uint64_t>(o.seed);
    specs.emplace_back(p.name, spec);
  }
  return serve_variants(o, specs, s.kv, kv_bytes_per_token(s.base, s.kv), s.run, progress);
}

// Everything compare measured, and the machine's figures to judge it by.
struct Results {
  std::vector<Measured> rows;
  std::vector<VariantTiming> timings;  // the rows as the library reads them
  Serving serving;
  MachineCheck check;
  double seconds = 0;  // the whole run
};

Results run_all(const Options& o, const Setup& s) {
  const double t_start = now_seconds();
  const MachineProfile before = machine_profile(o.peak, o.bw);
  const Weights mha = random_mha_weights(o, s.head_dim);
  Tensor x = zeros({o.batch, o.prompt, o.d_model});
  fill_uniform(x.view(), static_cast<uint64_t>(o.seed) + 3, 1.0);
  std::vector<Tensor> outputs;
  Results r;
  Progress progress("compare", static_cast<int64_t>(s.plans.size()) * (o.no_serve ? 1 : 2));
  for (const Plan& p : s.plans) {
    progress.step(p.name);
    outputs.push_back(zeros({o.batch, o.prompt, o.d_model}));
    r.rows.push_back(measure_variant(o, s, p, mha, x.view(), outputs.back().view()));
  }
  if (!o.no_serve) r.serving = serve_plans(o, s, &progress);
  progress.finish();

  // Diff vs the MHA row, when there is one.
  const Tensor* ref = nullptr;
  for (size_t i = 0; i < r.rows.size(); ++i)
    if (!r.rows[i].shape.mla && r.rows[i].shape.num_kv_heads == o.heads) ref = &outputs[i];
  for (size_t i = 0; i < r.rows.size(); ++i)
    if (ref && r.rows[i].derived) r.rows[i].diff = relative_l2(outputs[i].view(), ref->view());
  for (const Measured& m : r.rows)
    r.timings.push_back({m.variant, m.shape, m.prefill.median, m.decode.median});

  // The yardstick again, after the runs; fractions use the better figures.
  r.check = remeasure_machine(before, o.peak, o.bw, 0, /*quick=*/true);
  r.seconds = now_seconds() - t_start;
  return r;
}

// What the table means for a reader choosing a variant, in a few sentences
// from the library's conclusions (report.h): which variant decodes a token
// fastest, which caches least, and what MLA trades.
struct Conclusions {
  std::vector<std::string> lines;
  nlohmann::json summary = nlohmann::json::object();
};

Conclusions conclusion_text(const std::vector<VariantTiming>& rows, DType kv, int64_t context) {
  Conclusions c;
  const CompareConclusions cc = conclude_comparison(rows, kv);
  if (cc.fastest_decode < 0) return c;
  const VariantTiming* mha = cc.mha >= 0 ? &rows[static_cast<size_t>(cc.mha)] : nullptr;
  const auto per_token = [kv](const VariantTiming& m) {
    return static_cast<double>(kv_bytes_per_token(m.shape, kv));
  };
  const auto decode_flops = [context](const VariantTiming& m) {
    return decode_flops_per_layer(m.shape, context);
  };
  char line[320];
  const VariantTiming& fastest = rows[static_cast<size_t>(cc.fastest_decode)];
  std::snprintf(
      line, sizeof line,
      "Fastest decode: %s, %s per token over %lld cached tokens (%s per 1K cached "
      "tokens)",
      fastest.variant.c_str(), format_seconds(fastest.decode_seconds).c_str(), (long long)context,
      format_seconds(fastest.decode_seconds * 1024.0 / static_cast<double>(context)).c_str());
  std::string text = line;
  if (mha && mha != &fastest)
    text += ", " + format_ratio(mha->decode_seconds / fastest.decode_seconds) + " faster than mha";
  c.lines.push_back(text + ".");
  c.summary["fastest_decode"] = fastest.variant;

  const VariantTiming& smallest = rows[static_cast<size_t>(cc.smallest_cache)];
  text = "Smallest cache: " + smallest.variant + ", " + format_bytes(per_token(smallest)) +
         " per token per layer";
  if (mha && mha != &smallest)
    text += "; mha caches " + format_ratio(per_token(*mha) / per_token(smallest)) + " as much (" +
            format_bytes(per_token(*mha)) + ")";
  c.lines.push_back(text + ".");
  c.summary["smallest_kv_cache"] = smallest.variant;

  for (int i : cc.mla) {
    const VariantTiming& m = rows[static_cast<size_t>(i)];
    if (m.shape.index_topk > 0) continue;  // DSA: its own line below
    const double bytes = per_token(m) / per_token(*mha),
                 flops = decode_flops(m) / decode_flops(*mha);
    std::snprintf(line, sizeof line,
                  "MLA trades arithmetic for bytes: its cache is %s of mha's per token, while a "
                  "decode step does %s mha's FLOPs (%s vs %s); here it decodes in %s (mha %s).",
                  format_ratio(bytes).c_str(), format_ratio(flops).c_str(),
                  format_flops(decode_flops(m)).c_str(), format_flops(decode_flops(*mha)).c_str(),
                  format_seconds(m.decode_seconds).c_str(),
                  format_seconds(mha->decode_seconds).c_str());
    c.lines.push_back(line);
    c.summary["mla_kv_bytes_vs_mha"] = bytes;
    c.summary["mla_decode_flops_vs_mha"] = flops;
  }
  // DSA against the dense MLA row of the same sizes, when both ran.
  const auto dense_mla = std::find_if(rows.begin(), rows.end(), [](const VariantTiming& r) {
    return r.shape.mla && r.shape.index_topk == 0;
  });
  for (const VariantTiming& m : rows) {
    if (!m.shape.mla || m.shape.index_topk == 0 || dense_mla == rows.end()) continue;
    const DsaLayerFigures f = dsa_layer_figures(m.shape, context, 1, kv, DType::kF32);
    std::snprintf(line, sizeof line,
                  "DSA attends to %lld of %lld cached tokens: a decode step reads %s of dense "
                  "MLA's bytes and does %s of its FLOPs; here it decodes in %s (mla %s).",
                  (long long)std::min(m.shape.index_topk, context), (long long)context,
                  format_ratio(f.dsa_decode_bytes / f.dense_decode_bytes).c_str(),
                  format_ratio(f.dsa_decode_flops / f.dense_decode_flops).c_str(),
                  format_seconds(m.decode_seconds).c_str(),
                  format_seconds(dense_mla->decode_seconds).c_str());
    c.lines.push_back(line);
    c.summary["dsa_decode_seconds_vs_mla"] = m.decode_seconds / dense_mla->decode_seconds;
  }
  return c;
}

// The figures to judge the run by, as FLOP/s and bytes/s.
struct Roofs {
  double peak = 0, bw = 0;
};
Roofs roofs_of(const MachineCheck& check) {
  return {check.best.fp32_peak_gflops * 1e9, check.best.dram_read_gbps * 1e9};
}

nlohmann::json variant_json(const Measured& m, const VariantRates& r, const Roofs& roofs) {
  const ModelShape& s = m.shape;
  const LayerFigures& f = r.figures;
  nlohmann::json j = {
      {"variant", m.variant},
      {"num_kv_heads", s.mla ? 0 : s.num_kv_heads},
      {"params", f.params},
      {"kv_bytes_per_token", f.kv_bytes_per_token},
      {"kv_cache_bytes", f.kv_cache_bytes},
      {"prefill_flops", f.prefill_flops},
      {"prefill_seconds", m.prefill.median},
      {"prefill_gflops", r.prefill_flops_per_s / 1e9},
      {"prefill_peak_fraction", r.prefill_flops_per_s / roofs.peak},
      {"decode_flops", f.decode_flops},
      {"decode_bytes", f.decode_bytes},
      {"decode_seconds", m.decode.median},
      {"decode_gflops", r.decode_flops_per_s / 1e9},
      {"decode_gbps", r.decode_bytes_per_s / 1e9},
      {"decode_bandwidth_fraction", r.decode_bytes_per_s / roofs.bw},
      {"decode_instances", m.instances},
      {"weights_derived_from_mha", m.derived},
      {"diff_vs_mha", m.diff >= 0 ? nlohmann::json(m.diff) : nlohmann::json(nullptr)},
      {"above_roof", r.above_roof}};
  if (s.mla)
    j["mla"] = {{"kv_lora_rank", s.kv_lora_rank},
                {"q_lora_rank", s.q_lora_rank},
                {"qk_rope_head_dim", s.qk_rope_head_dim},
                {"qk_nope_head_dim", s.qk_nope_head_dim},
                {"v_head_dim", s.v_head_dim}};
  if (s.index_topk > 0)
    j["dsa"] = {{"index_n_heads", s.index_n_heads},
                {"index_head_dim", s.index_head_dim},
                {"index_topk", s.index_topk}};
  return j;
}

std::vector<std::string> variant_cells(const Measured& m, const VariantRates& r,
                                       const Roofs& roofs) {
  const ModelShape& s = m.shape;
  const LayerFigures& f = r.figures;
  // "n/a" padded to the header's width reads as right-aligned with the numbers.
  std::string diff = std::string(std::strlen(kDriftHeader) - 3, ' ') + "n/a";
  if (m.diff >= 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f", m.diff);
    diff = buf;
  }
  return {m.variant,
          s.mla ? "latent" : std::to_string(s.num_kv_heads),
          format_count(f.params),
          format_bytes(f.kv_bytes_per_token),
          format_bytes(f.kv_cache_bytes),
          format_flops(f.prefill_flops),
          format_seconds(m.prefill.median),
          format_rate(r.prefill_flops_per_s),
          percent_cell(r.prefill_flops_per_s, roofs.peak),
          format_flops(f.decode_flops),
          format_seconds(m.decode.median),
          format_bandwidth(r.decode_bytes_per_s),
          percent_cell(r.decode_bytes_per_s, roofs.bw),
          diff};
}

// The report, rendered from the results: the variants' table and JSON
// rows, the warnings and the conclusions.
struct Report {
  Table table{{}};
  nlohmann::json rows = nlohmann::json::array();
  std::vector<std::string> warnings;
  Conclusions conclusions;
};

Report build_report(const Options& o, const Setup& s, const Results& res) {
  const Roofs roofs = roofs_of(res.check);
  Report rep;
  rep.table = Table({"variant", "KV heads", "params", "KV/token",
                     "KV @ " + std::to_string(o.context), "prefill FLOPs", "prefill", "GFLOP/s",
                     "% peak", "decode FLOPs", "decode/token", "GB/s", "% BW", kDriftHeader});
  rep.warnings = machine_warnings(res.check);
  int above = 0;
  for (size_t i = 0; i < res.rows.size(); ++i) {
    const VariantRates r =
        variant_rates(res.timings[i], s.kv, o.prompt, o.context, o.batch, roofs.peak, roofs.bw);
    rep.table.add(variant_cells(res.rows[i], r, roofs));
    rep.rows.push_back(variant_json(res.rows[i], r, roofs));
    above += r.above_roof;
  }
  if (above > 0) rep.warnings.push_back(above_roof_warning(above, "variant(s)"));
  rep.conclusions = conclusion_text(res.timings, s.kv, o.context);
  return rep;
}

// The whole model under each variant: per-layer sums (report.h).
nlohmann::json model_json(const Options& o, const Setup& s) {
  nlohmann::json rows = nlohmann::json::array();
  for (const Plan& p : s.plans) {
    const ModelFigures f = model_figures(p.model, s.kv, o.prompt, o.context, o.batch);
    rows.push_back({{"variant", p.name},
                    {"params", f.params},
                    {"kv_bytes_per_token", f.kv_bytes_per_token},
                    {"kv_cache_bytes", f.kv_cache_bytes},
                    {"linear_state_bytes", f.linear_state_bytes},
                    {"prefill_flops", f.prefill_flops},
                    {"decode_flops", f.decode_flops},
                    {"decode_bytes", f.decode_bytes}});
  }
  const ModelShape& m = s.model;
  return {{"name", m.name}, {"source", m.source}, {"layer_mix", layer_mix(m)}, {"variants", rows}};
}

Table model_table(const Options& o, const Setup& s) {
  Table t({"variant", "params", "KV/token", "KV @ " + std::to_string(o.context), "state",
           "prefill FLOPs", "decode FLOPs", "decode bytes"});
  for (const Plan& p : s.plans) {
    const ModelFigures f = model_figures(p.model, s.kv, o.prompt, o.context, o.batch);
    t.add({p.name, format_count(static_cast<double>(f.params)),
           format_bytes(static_cast<double>(f.kv_bytes_per_token)), format_bytes(f.kv_cache_bytes),
           f.linear_state_bytes > 0 ? format_bytes(f.linear_state_bytes) : "-",
           format_flops(f.prefill_flops), format_flops(f.decode_flops),
           format_bytes(f.decode_bytes)});
  }
  return t;
}

nlohmann::json serving_json(const Serving& serving) {
  nlohmann::json srows = nlohmann::json::array();
  for (const Serving::Row& r : serving.rows)
    srows.push_back({{"variant", r.variant},
                     {"kv_bytes_per_token", r.kv_bytes_per_token},
                     {"mean_running", r.mean},
                     {"peak_running", r.peak},
                     {"output_tokens_per_s", r.tokens_per_s},
                     {"preemptions", r.preemptions}});
  return {{"budget_bytes", serving.budget},
          {"requests", serving.requests},
          {"token_slots", serving.token_slots},
          {"layers", 1},
          {"weights", "bf16"},
          {"gemm", gemm_backend_name(DType::kBF16)},
          {"rows", srows},
          {"sentence", serving_sentence(serving)}};
}

void print_json(const Options& o, const Setup& s, const Results& res, const Report& rep) {
  nlohmann::json j = {{"config",
                       {{"d_model", o.d_model},
                        {"num_heads", o.heads},
                        {"head_dim", s.head_dim},
                        {"prompt", o.prompt},
                        {"context", o.context},
                        {"batch", o.batch},
                        {"kv_dtype", o.kv},
                        {"rope", !o.no_rope},
                        {"bias", o.bias},
                        {"backend", o.backend},
                        {"threads", o.threads},
                        {"steps", o.steps},
                        {"repeats", o.repeats},
                        {"seed", o.seed}}},
                      {"machine", machine_json(res.check)},
                      {"warnings", rep.warnings},
                      {"conclusions", rep.conclusions.lines},
                      {"summary", rep.conclusions.summary},
                      {"variants", rep.rows},
                      {"seconds", res.seconds}};
  if (s.whole_model) j["model"] = model_json(o, s);
  if (!o.no_serve) j["serving"] = serving_json(res.serving);
  std::printf("%s\n", j.dump(2).c_str());
}

// `text` wrapped at 100 columns, one printed line each.
void print_wrapped(const std::string& text) {
  std::string line;
  std::istringstream words(text);
  for (std::string w; words >> w;) {
    if (!line.empty() && line.size() + 1 + w.size() > 100) {
      std::printf("%s\n", line.c_str());
      line.clear();
    }
    line += (line.empty() ? "" : " ") + w;
  }
  if (!line.empty()) std::printf("%s\n", line.c_str());
}

void print_serving(const Serving& serving) {
  std::printf(
      "\nServing (continuous batching over a paged KV pool of %s; %lld requests at once, "
      "prompts\n16-64 and outputs 8-32 tokens; one layer, bf16 weights; attnkit serve-bench "
      "for more):\n\n",
      format_bytes(static_cast<double>(serving.budget)).c_str(), (long long)serving.requests);
  Table st({"variant", "KV/token", "seqs/step", "peak", "out tok/s", "preempt"});
  for (const Serving::Row& r : serving.rows)
    st.add({r.variant, format_bytes(static_cast<double>(r.kv_bytes_per_token)),
            format_sig3(r.mean, ""), std::to_string(r.peak), format_sig3(r.tokens_per_s, ""),
            std::to_string(r.preemptions)});
  std::fputs(st.str().c_str(), stdout);
  const std::string sentence = serving_sentence(serving);
  if (!sentence.empty()) std::printf("\n");
  print_wrapped(sentence);
}

void print_text(const Options& o, const Setup& s, const Results& res, const Report& rep) {
  const MachineProfile& mp = res.check.best;
  std::printf(
      "attention layers: d_model %lld, %lld query heads of %lld, %s; batch %lld, %s KV cache\n",
      (long long)o.d_model, (long long)o.heads, (long long)s.head_dim,
      o.no_rope ? "causal, no RoPE" : "causal, RoPE", (long long)o.batch, o.kv.c_str());
  std::printf(
      "prefill: %lld tokens, one forward (median of %lld); decode: 1 token over %lld cached "
      "(median of %lld steps)\n\n",
      (long long)o.prompt, (long long)o.repeats, (long long)o.context, (long long)o.steps);
  std::fputs(rep.table.str().c_str(), stdout);
  std::printf("\nmachine (%s): %s%d threads, fp32 peak %.0f GFLOP/s, read bandwidth %.1f GB/s\n",
              mp.simd == "given" ? "given" : "measured before and after, the better of the two",
              mp.simd == "given" ? "" : (mp.simd + ", ").c_str(), mp.threads, mp.fp32_peak_gflops,
              mp.dram_read_gbps);
  std::printf(
      "GB/s = weights (f32) + KV read per decode step / its time. Took %.1f s.\n"
      "pooling drift = how far the prefill output moves from MHA's (relative L2) when the\n"
      "variant's K/V weights are MHA's mean-pooled per group, the GQA paper's conversion. The\n"
      "weights here are random and share no structure, so pooling loses most of the signal and\n"
      "0.9 to 1.0 is expected: it is the starting point a conversion is uptrained from, not an\n"
      "error of attnkit. MLA has its own weights (n/a).\n",
      res.seconds);
  if (s.whole_model) {
    std::printf(
        "\nThe whole model, %s (%s), as each variant: summed layer by layer at %lld tokens "
        "x %lld (prefill of %lld):\n",
        s.model.name.c_str(), layer_mix(s.model).c_str(), (long long)o.context, (long long)o.batch,
        (long long)o.prompt);
    std::fputs(model_table(o, s).str().c_str(), stdout);
  }
  std::printf("\nWhat this means here:\n");
  for (const std::string& l : rep.conclusions.lines) std::printf("- %s\n", l.c_str());
  for (const std::string& w : rep.warnings) std::printf("%s\n", w.c_str());
  if (!o.no_serve) print_serving(res.serving);
}

// The flags, described; false when --help was given.
bool parse_options(int argc, char** argv, Options* po, std::unique_ptr<Flags>* flags) {
  Options& o = *po;
  *flags = std::make_unique<Flags>(
      "compare",
      "Builds MHA, GQA, MQA and MLA attention layers of one size (default: the seeds'\n"
      "comparison, d_model 2048 with 32 query heads), runs a causal prefill and decode steps\n"
      "over a filled KV cache on this machine, and prints one table: parameters, KV-cache\n"
      "bytes, FLOPs, measured latencies, achieved GFLOP/s and GB/s (also as a fraction of the\n"
      "fp32 peak and read bandwidth measured in the same process), and each variant's output\n"
      "difference from MHA with GQA/MQA weights mean-pooled from MHA's (the GQA paper's\n"
      "checkpoint conversion). Figures are medians of several runs.",
      std::vector<std::string>{
          "attnkit compare",
          "attnkit compare --context 16384 --kv-dtype bf16 --variants mha,gqa-8,mla",
          "attnkit compare --d-model 4096 --heads 32 --batch 4 --json",
          "attnkit compare --d-model 64 --heads 4 --prompt 16 --context 64   # seconds",
          "attnkit compare --model gpt-oss-20b --variants gqa-8,mqa --context 8192",
          "attnkit compare --variants mla,mla-dsa --context 16384 --index-topk 2048"});
  Flags& f = **flags;
  f.add_string("--model", &o.model,
               "a preset: layers of its attention sizes, plus the whole model's per-layer sums");
  f.add_string("--config", &o.config, "a Hugging Face config.json, as --model");
  f.add_int("--d-model", &o.d_model, "hidden size (default 2048)", 1);
  f.add_int("--heads", &o.heads, "query heads (default 32); head_dim = d_model / heads", 1);
  f.add_string_list("--variants", &o.variants,
                    "mha, mqa, gqa-N, mla, mla-dsa (default mha,gqa-8,gqa-4,mqa,mla)");
  f.add_int("--prompt", &o.prompt, "prefill tokens (default 256)", 1);
  f.add_int("--context", &o.context, "cached tokens a decode step attends to (default 4096)", 1);
  f.add_int("--batch", &o.batch, "sequences (default 1)", 1);
  f.add_string("--kv-dtype", &o.kv, "f32, bf16, int8 or fp8_e4m3 cache storage (default f32)");
  f.add_int("--mla-rank", &o.mla_rank, "MLA kv_lora_rank (default 4 x head_dim, DeepSeek's ratio)",
            0);
  f.add_int("--mla-rope-dim", &o.mla_rope_dim, "MLA qk_rope_head_dim (default head_dim / 2, even)",
            0);
  f.add_int("--index-topk", &o.index_topk,
            "mla-dsa: keys each query attends to (default 2048, DeepSeek-V3.2's)", 1);
  f.add_bool("--bias", &o.bias, "q/k/v/o biases, as nn.Linear's default in the seeds' modules");
  f.add_bool("--no-rope", &o.no_rope, "no RoPE in MHA/GQA/MQA (the seeds' modules)");
  f.add_int("--steps", &o.steps, "timed decode steps (default 8)", 1);
  f.add_int("--repeats", &o.repeats, "timed prefills (default 3)", 1);
  f.add_int("--threads", &o.threads, "threads (default 0 = all cores)", 0);
  f.add_string("--backend", &o.backend, "auto, fast or reference attention kernels (default auto)");
  f.add_int("--seed", &o.seed, "weights and inputs seed (default 1)", 0);
  f.add_double("--peak-gflops", &o.peak, "use this fp32 peak instead of measuring");
  f.add_double("--bandwidth-gbps", &o.bw, "use this read bandwidth instead of measuring");
  f.add_bool("--no-serve", &o.no_serve, "skip the serving section (continuous batching)");
  f.add_bool("--json", &o.json, "print JSON instead of a table");
  return f.parse(argc, argv, 2);
}

}  // namespace

int run_compare(int argc, char** argv) {
  Options o;
  std::unique_ptr<Flags> flags;
  if (!parse_options(argc, argv, &o, &flags)) return 0;
  const Setup s = resolve(&o, *flags);
  try {
    const Results res = run_all(o, s);
    const Report rep = build_report(o, s, res);
    if (o.json)
      print_json(o, s, res, rep);
    else
      print_text(o, s, res, rep);
    return 0;
  } catch (const RunError& e) {
    std::fprintf(stderr, "attnkit compare: %s\n", e.message.c_str());
    return 1;
  }
}

}  // namespace attnkit::cli
