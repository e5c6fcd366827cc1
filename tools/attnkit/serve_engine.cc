#include "serve_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <new>
#include <numeric>
#include <string>
#include <utility>

namespace attnkit::serve {
namespace {

// Rows of the vocabulary table prompt tokens are drawn from.
constexpr int64_t kVocabulary = 512;
// Free pages kept back from admissions while others run (vLLM's 1 %).
constexpr double kWatermark = 0.01;
constexpr double kNormEps = 1e-6;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform values in [-a, a] from a seeded stream.
void fill(std::span<float> v, uint64_t seed, double a) {
  uint64_t s = mix(seed + 0x9E3779B97F4A7C15ull);
  for (float& x : v) {
    s += 0x9E3779B97F4A7C15ull;
    x = static_cast<float>((static_cast<double>(mix(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0) * a);
  }
}

// Seeded random weights for the names `names` with shapes from `shape`,
// as f32 or bf16 tensors, in a WeightMap over storage kept here.
class RandomWeights {
 public:
  RandomWeights(DType dtype, uint64_t seed) : dtype_(dtype), seed_(seed) {}

  // A matrix [rows, cols] ~ U(+-1/sqrt(cols)) (nn.Linear's range, so
  // activations stay O(1)); a vector [rows] (cols = 0) of ones (norm gains).
  Status add(const std::string& name, int64_t rows, int64_t cols) {
    const bool vector = cols == 0;
    std::vector<float> v;
    try {
      v.resize(static_cast<size_t>(rows * (vector ? 1 : cols)));
    } catch (const std::bad_alloc&) {
      return resource_exhausted("serve: cannot allocate the weight " + name);
    }
    if (vector)
      std::fill(v.begin(), v.end(), 1.0f);
    else
      fill(v, seed_++, 1.0 / std::sqrt(static_cast<double>(cols)));
    const DType dtype = vector ? DType::kF32 : dtype_;
    auto t = vector ? Tensor::zeros(dtype, {rows}) : Tensor::zeros(dtype, {rows, cols});
    if (!t.ok()) return t.status();
    if (dtype == DType::kBF16)
      for (size_t i = 0; i < v.size(); ++i) t->ptr<bf16>()[i] = float_to_bf16(v[i]);
    else
      std::copy(v.begin(), v.end(), t->ptr<float>());
    map_[name] = t->view();
    owned_.push_back(std::move(t).value());
    return Status::Ok();
  }
  const WeightMap& map() const { return map_; }

 private:
  DType dtype_;
  uint64_t seed_;
  std::vector<Tensor> owned_;
  WeightMap map_;
};

size_t view_bytes(const Result<TensorView>& v) {
  return v.ok() ? static_cast<size_t>(v->numel()) * dtype_size(v->dtype) : 0;
}

// y = x / rms(x) per row of `hidden` (unit gain), rows independent.
void rms_norm(const float* x, float* y, int64_t rows, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* yr = y + r * hidden;
    double ss = 0.0;
    for (int64_t i = 0; i < hidden; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(hidden) + kNormEps);
    for (int64_t i = 0; i < hidden; ++i) yr[i] = static_cast<float>(xr[i] * inv);
  }
}

Status prefixed(const std::string& what, const Status& st) {
  return st.ok() ? st : Status(st.code(), what + ": " + st.message());
}

}  // namespace

Result<Model> Model::create(const ModelSpec& spec) {
  if (spec.layers < 1)
    return invalid_argument("serve: layers = " + std::to_string(spec.layers) + " must be >= 1");
  if (spec.weight_dtype != DType::kF32 && spec.weight_dtype != DType::kBF16)
    return invalid_argument(std::string("serve: weight dtype ") + dtype_name(spec.weight_dtype) +
                            " must be f32 or bf16");
  Model m;
  m.spec_ = spec;
  m.hidden_ = spec.mla ? spec.latent.hidden_size : spec.attention.hidden_size;
  if (spec.ffn && spec.moe.hidden_size != m.hidden_)
    return invalid_argument("serve: the feed-forward's hidden_size " +
                            std::to_string(spec.moe.hidden_size) + " must equal the attention's " +
                            std::to_string(m.hidden_));
  uint64_t seed = spec.seed * 1000003;
  for (int64_t l = 0; l < spec.layers; ++l) {
    RandomWeights w(spec.weight_dtype, seed);
    seed += 1000;
    if (spec.mla) {
      ATTNKIT_ASSIGN_OR_RETURN(LatentAttention layer, LatentAttention::create(spec.latent));
      const MlaConfig& c = spec.latent;
      const int64_t H = c.num_attention_heads, d = c.hidden_size;
      if (c.q_lora_rank > 0) {
        ATTNKIT_RETURN_IF_ERROR(w.add("q_a_proj.weight", c.q_lora_rank, d));
        ATTNKIT_RETURN_IF_ERROR(w.add("q_a_layernorm.weight", c.q_lora_rank, 0));
        ATTNKIT_RETURN_IF_ERROR(w.add("q_b_proj.weight", H * c.qk_head_dim(), c.q_lora_rank));
      } else {
        ATTNKIT_RETURN_IF_ERROR(w.add("q_proj.weight", H * c.qk_head_dim(), d));
      }
      ATTNKIT_RETURN_IF_ERROR(
          w.add("kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d));
      ATTNKIT_RETURN_IF_ERROR(w.add("kv_a_layernorm.weight", c.kv_lora_rank, 0));
      ATTNKIT_RETURN_IF_ERROR(
          w.add("kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank));
      ATTNKIT_RETURN_IF_ERROR(w.add("o_proj.weight", d, H * c.v_head_dim));
      ATTNKIT_RETURN_IF_ERROR(layer.load_weights(w.map()));
      for (const std::string& n : layer.weight_names())
        m.weight_bytes_ += view_bytes(layer.weight(n));
      m.latent_.push_back(std::move(layer));
    } else {
      const AttentionConfig& c = spec.attention;
      // The pool's page accounting here assumes every written token stays
      // visible or leaves through a window; a chunk releases pages by
      // chunk, which the feasibility and static-cache comparisons do not
      // model.
      if (c.chunk_size > 0)
        return invalid_argument("serve: chunk_size = " + std::to_string(c.chunk_size) +
                                " (chunked attention) is not supported by the serving engine");
      ATTNKIT_ASSIGN_OR_RETURN(AttentionLayer layer, AttentionLayer::create(spec.attention));
      const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
      // Under output_gate q_proj also emits the gate rows.
      const int64_t q_rows = c.output_gate ? 2 * q : q;
      ATTNKIT_RETURN_IF_ERROR(w.add("q_proj.weight", q_rows, c.hidden_size));
      ATTNKIT_RETURN_IF_ERROR(w.add("k_proj.weight", kv, c.hidden_size));
      ATTNKIT_RETURN_IF_ERROR(w.add("v_proj.weight", kv, c.hidden_size));
      ATTNKIT_RETURN_IF_ERROR(w.add("o_proj.weight", c.hidden_size, q));
      if (c.qkv_bias) {
        ATTNKIT_RETURN_IF_ERROR(w.add("q_proj.bias", q_rows, 0));
        ATTNKIT_RETURN_IF_ERROR(w.add("k_proj.bias", kv, 0));
        ATTNKIT_RETURN_IF_ERROR(w.add("v_proj.bias", kv, 0));
      }
      if (c.o_bias) ATTNKIT_RETURN_IF_ERROR(w.add("o_proj.bias", c.hidden_size, 0));
      // kL2 has no weight; kRmsOnePlus's ones make gains of 2, harmless.
      if (c.qk_norm == attnkit::QkNorm::kRms || c.qk_norm == attnkit::QkNorm::kRmsOnePlus) {
        ATTNKIT_RETURN_IF_ERROR(w.add("q_norm.weight", c.head_dim, 0));
        ATTNKIT_RETURN_IF_ERROR(w.add("k_norm.weight", c.head_dim, 0));
      }
      if (c.sinks) ATTNKIT_RETURN_IF_ERROR(w.add("sinks", c.num_heads, 0));
      ATTNKIT_RETURN_IF_ERROR(layer.load_weights(w.map()));
      for (const std::string& n : layer.weight_names())
        m.weight_bytes_ += view_bytes(layer.weight(n));
      m.attention_.push_back(std::move(layer));
    }
    if (spec.ffn) {
      const MoeConfig& c = spec.moe;
      if (c.naming == MoeWeightNaming::kGptOss)
        return invalid_argument(
            "serve: gpt-oss's fused expert weights (MoeWeightNaming::kGptOss) are not "
            "supported by the serving engine");
      ATTNKIT_ASSIGN_OR_RETURN(MoeLayer ffn, MoeLayer::create(spec.moe));
      const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
      const bool mixtral = c.naming == MoeWeightNaming::kMixtral;
      const std::string block = mixtral ? "block_sparse_moe." : "mlp.";
      RandomWeights fw(spec.weight_dtype, seed);
      seed += 1000;
      ATTNKIT_RETURN_IF_ERROR(fw.add(block + "gate.weight", E, H));
      if (c.topk_method == MoeTopkMethod::kNoauxTc)
        ATTNKIT_RETURN_IF_ERROR(fw.add(block + "gate.e_score_correction_bias", E, 0));
      for (int64_t e = 0; e < E; ++e) {
        const std::string p = block + "experts." + std::to_string(e) + ".";
        ATTNKIT_RETURN_IF_ERROR(fw.add(p + (mixtral ? "w1" : "gate_proj") + ".weight", I, H));
        ATTNKIT_RETURN_IF_ERROR(fw.add(p + (mixtral ? "w3" : "up_proj") + ".weight", I, H));
        ATTNKIT_RETURN_IF_ERROR(fw.add(p + (mixtral ? "w2" : "down_proj") + ".weight", H, I));
      }
      if (c.n_shared_experts > 0) {
        const int64_t S = I * c.n_shared_experts;
        ATTNKIT_RETURN_IF_ERROR(fw.add(block + "shared_experts.gate_proj.weight", S, H));
        ATTNKIT_RETURN_IF_ERROR(fw.add(block + "shared_experts.up_proj.weight", S, H));
        ATTNKIT_RETURN_IF_ERROR(fw.add(block + "shared_experts.down_proj.weight", H, S));
      }
      ATTNKIT_RETURN_IF_ERROR(ffn.load_weights(fw.map()));
      for (const std::string& n : ffn.weight_names()) m.weight_bytes_ += view_bytes(ffn.weight(n));
      m.ffn_.push_back(std::move(ffn));
    }
  }
  try {
    m.vocabulary_.resize(static_cast<size_t>(kVocabulary * m.hidden_));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("serve: cannot allocate the vocabulary table");
  }
  // Unit RMS per row, as a normalised hidden state.
  fill(m.vocabulary_, spec.seed * 7919 + 1, std::sqrt(3.0));
  return m;
}

Result<PagedKVCache> Model::new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype) const {
  if (spec_.mla) return latent_[0].new_paged_cache(num_pages, page_size, spec_.layers, kv_dtype);
  return attention_[0].new_paged_cache(num_pages, page_size, spec_.layers, kv_dtype);
}

std::span<const float> Model::prompt_token(int64_t request, int64_t position) const {
  const uint64_t key =
      mix(spec_.seed * 0x100000001B3ull + static_cast<uint64_t>(request) * 0x9E3779B97F4A7C15ull +
          static_cast<uint64_t>(position));
  const size_t row = static_cast<size_t>(key % static_cast<uint64_t>(kVocabulary));
  return std::span<const float>(vocabulary_)
      .subspan(row * static_cast<size_t>(hidden_), static_cast<size_t>(hidden_));
}

Status Model::forward(std::span<const float> x, std::span<const int32_t> cu_seqlens,
                      std::span<const int64_t> seq_ids, PagedKVCache& pool, std::span<float> out,
                      const RunOptions& run) {
  const int64_t d = hidden_, total = static_cast<int64_t>(x.size()) / d;
  const size_t n = x.size();
  try {
    if (h_.size() < n) {
      h_.resize(n);
      in_.resize(n);
      tmp_.resize(n);
    }
  } catch (const std::bad_alloc&) {
    return resource_exhausted("serve: cannot allocate step scratch for " + std::to_string(total) +
                              " tokens");
  }
  std::copy(x.begin(), x.end(), h_.begin());
  const TensorView in2 = make_view(in_.data(), DType::kF32, {total, d});
  const TensorView tmp2 = make_view(tmp_.data(), DType::kF32, {total, d});
  for (int64_t l = 0; l < spec_.layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    rms_norm(h_.data(), in_.data(), total, d);
    const Status st =
        spec_.mla ? latent_[li].forward_batch(in2, cu_seqlens, seq_ids, pool, l, tmp2, run)
                  : attention_[li].forward_batch(in2, cu_seqlens, seq_ids, pool, l, tmp2, run);
    ATTNKIT_RETURN_IF_ERROR(prefixed("layer " + std::to_string(l) + " attention", st));
    for (size_t i = 0; i < n; ++i) h_[i] += tmp_[i];
    if (spec_.ffn) {
      rms_norm(h_.data(), in_.data(), total, d);
      ATTNKIT_RETURN_IF_ERROR(prefixed(
          "layer " + std::to_string(l) + " feed-forward",
          ffn_[li].forward(make_view(in_.data(), DType::kF32, {1, total, d}),
                           make_view(tmp_.data(), DType::kF32, {1, total, d}), nullptr, run)));
      for (size_t i = 0; i < n; ++i) h_[i] += tmp_[i];
    }
  }
  rms_norm(h_.data(), out.data(), total, d);
  return Status::Ok();
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Token slots a request needs at most: its prompt and every output but
// the last, whose input is never computed.
int64_t slots_needed(const Request& r) { return r.prompt_tokens + r.output_tokens - 1; }

struct Budget {
  int64_t bytes_per_token = 0;  // all layers
  int64_t page_bytes = 0;
  int64_t pages = 0;        // the pool's
  int64_t max_seq_len = 0;  // kStatic
  int64_t slots = 0;        // kStatic
};

Result<Budget> budget_for(const Model& model, std::span<const Request> requests, const Options& o) {
  if (o.page_size < 1)
    return invalid_argument("page_size = " + std::to_string(o.page_size) + " must be >= 1");
  if (o.max_tokens_per_step < 1)
    return invalid_argument("max_tokens_per_step = " + std::to_string(o.max_tokens_per_step) +
                            " must be >= 1");
  if (o.max_seqs < 1)
    return invalid_argument("max_seqs = " + std::to_string(o.max_seqs) + " must be >= 1");
  // One page of a one-page pool gives the per-page bytes of every layer.
  ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache probe, model.new_pool(1, o.page_size, o.kv_dtype));
  Budget b;
  b.page_bytes = static_cast<int64_t>(probe.page_nbytes());
  b.bytes_per_token = b.page_bytes / o.page_size;
  if (o.cache == CacheMode::kPaged) {
    b.pages = o.memory_bytes / b.page_bytes;
    return b;
  }
  int64_t longest = 1;
  for (const Request& r : requests) longest = std::max(longest, slots_needed(r));
  b.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : longest;
  b.slots = o.memory_bytes / (b.max_seq_len * b.bytes_per_token);
  b.pages = b.slots * ceil_div(b.max_seq_len, o.page_size);
  return b;
}

}  // namespace

std::vector<Request> synthetic_trace(int64_t n, double rate, int64_t prompt_min, int64_t prompt_max,
                                     int64_t output_min, int64_t output_max, uint64_t seed) {
  uint64_t state = mix(seed * 0xD1B54A32D192ED03ull + 17);
  const auto uniform01 = [&state] {  // in (0, 1]
    state += 0x9E3779B97F4A7C15ull;
    return (static_cast<double>(mix(state) >> 11) + 1.0) * 0x1.0p-53;
  };
  const auto between = [&](int64_t lo, int64_t hi) {
    const double span = static_cast<double>(hi - lo + 1);
    return lo + std::min(hi - lo, static_cast<int64_t>(uniform01() * span));
  };
  std::vector<Request> out;
  double t = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    Request r;
    if (std::isfinite(rate)) t += -std::log(uniform01()) / rate;  // exponential gaps
    r.arrival_s = t;
    r.prompt_tokens = between(prompt_min, prompt_max);
    r.output_tokens = between(output_min, output_max);
    out.push_back(r);
  }
  return out;
}

Status check_feasible(const Model& model, std::span<const Request> requests, const Options& o) {
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    if (!(r.arrival_s >= 0.0) || !std::isfinite(r.arrival_s) || r.prompt_tokens < 1 ||
        r.output_tokens < 1)
      return invalid_argument(
          "request " + std::to_string(i) + ": arrival_s " + std::to_string(r.arrival_s) +
          ", prompt_tokens " + std::to_string(r.prompt_tokens) + ", output_tokens " +
          std::to_string(r.output_tokens) + ": arrival must be finite and >= 0, token counts >= 1");
  }
  ATTNKIT_ASSIGN_OR_RETURN(const Budget b, budget_for(model, requests, o));
  const std::string memory = std::to_string(o.memory_bytes) + " bytes";
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const int64_t need = slots_needed(r);
    const std::string what = "request " + std::to_string(i) + " (" +
                             std::to_string(r.prompt_tokens) + " prompt + " +
                             std::to_string(r.output_tokens) + " output tokens)";
    if (o.cache == CacheMode::kPaged && ceil_div(need, o.page_size) > b.pages)
      return invalid_argument(what + " needs " + std::to_string(ceil_div(need, o.page_size)) +
                              " pages of " + std::to_string(o.page_size) + " tokens (" +
                              std::to_string(b.page_bytes) + " bytes each), but the budget of " +
                              memory + " holds " + std::to_string(b.pages));
    if (o.cache == CacheMode::kStatic && need > b.max_seq_len)
      return invalid_argument(what + " needs " + std::to_string(need) +
                              " token slots, more than the static max_seq_len " +
                              std::to_string(b.max_seq_len));
  }
  if (o.cache == CacheMode::kStatic && b.slots < 1)
    return invalid_argument("a static cache slot of " + std::to_string(b.max_seq_len) +
                            " tokens needs " + std::to_string(b.max_seq_len * b.bytes_per_token) +
                            " bytes, more than the budget of " + memory);
  return Status::Ok();
}

Result<Report> run(Model& model, std::span<const Request> requests, const Options& o) {
  ATTNKIT_RETURN_IF_ERROR(check_feasible(model, requests, o));
  ATTNKIT_ASSIGN_OR_RETURN(const Budget b, budget_for(model, requests, o));
  ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache pool, model.new_pool(b.pages, o.page_size, o.kv_dtype));
  const int64_t d = model.hidden_size();
  const int64_t n = static_cast<int64_t>(requests.size());
  const int64_t watermark =
      static_cast<int64_t>(std::ceil(kWatermark * static_cast<double>(b.pages)));

  // Per request: where it stands, and the outputs it feeds back.
  struct Seq {
    int64_t pool_id = -1;    // -1 = not in the pool
    int64_t computed = 0;    // tokens whose K/V the pool holds
    int64_t generated = 0;   // outputs so far
    std::vector<float> fed;  // [generated, hidden]: output g is token prompt + g's input
  };
  std::vector<Seq> seqs(static_cast<size_t>(n));
  Report rep;
  rep.requests.resize(static_cast<size_t>(n));
  rep.kv_bytes_per_token = b.bytes_per_token;
  rep.pool_pages = b.pages;
  rep.max_running = o.cache == CacheMode::kStatic ? b.slots : 0;
  rep.max_seq_len = b.max_seq_len;
  for (int64_t i = 0; i < n; ++i)
    rep.requests[static_cast<size_t>(i)].arrival_s = requests[i].arrival_s;

  std::vector<int64_t> order(static_cast<size_t>(n));  // by arrival, stable
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
    return requests[a].arrival_s < requests[c].arrival_s;
  });
  if (n > 0) rep.start_s = requests[order[0]].arrival_s;

  std::deque<int64_t> waiting;
  std::vector<int64_t> running;  // admission order
  size_t next_arrival = 0;
  int64_t finished = 0;
  double clock = rep.start_s, weighted_running = 0.0, weighted_used = 0.0, weighted_reserved = 0.0;
  std::vector<float> x, out;
  std::vector<int32_t> cu;
  std::vector<int64_t> ids, scheduled, counts;

  const auto known = [&](int64_t r) {
    return requests[r].prompt_tokens + seqs[static_cast<size_t>(r)].generated;
  };
  const auto preempt = [&](int64_t r) {
    Seq& s = seqs[static_cast<size_t>(r)];
    (void)pool.remove(s.pool_id);  // the id is in the pool: cannot fail
    s.pool_id = -1;
    s.computed = 0;
    ++rep.requests[static_cast<size_t>(r)].preemptions;
    ++rep.preemptions;
    waiting.push_front(r);
  };

  while (finished < n) {
    while (next_arrival < order.size() && requests[order[next_arrival]].arrival_s <= clock)
      waiting.push_back(order[next_arrival++]);
    if (running.empty() && waiting.empty()) {
      clock = requests[order[next_arrival]].arrival_s;  // idle: jump to the next arrival
      continue;
    }
    const double t0 = now_s();

    // ---- schedule: running sequences first, oldest first ---------------
    int64_t budget = o.max_tokens_per_step;
    bool preempted = false;
    scheduled.clear();
    counts.clear();
    for (size_t i = 0; i < running.size() && budget > 0;) {
      const int64_t r = running[i];
      Seq& s = seqs[static_cast<size_t>(r)];
      const int64_t want = std::min(known(r) - s.computed, budget);
      Status st =
          pool.append(std::span<const int64_t>(&s.pool_id, 1), std::span<const int64_t>(&want, 1));
      while (!st.ok() && st.code() == StatusCode::kResourceExhausted && running.back() != r) {
        preempt(running.back());
        running.pop_back();
        preempted = true;
        st = pool.append(std::span<const int64_t>(&s.pool_id, 1),
                         std::span<const int64_t>(&want, 1));
      }
      if (!st.ok()) {
        if (st.code() != StatusCode::kResourceExhausted) return prefixed("serve: append", st);
        // It is the most recent running sequence itself: it waits.
        preempt(r);
        running.pop_back();
        preempted = true;
        break;
      }
      scheduled.push_back(r);
      counts.push_back(want);
      budget -= want;
      ++i;
    }
    // ---- admit waiting requests while there is room --------------------
    // Pages the running sequences still need for the tokens they know
    // (prompt chunks not yet reserved), promised to them as vLLM reserves
    // a whole prompt at admission.
    int64_t promised = 0;
    for (int64_t r : running) {
      ATTNKIT_ASSIGN_OR_RETURN(const int64_t held,
                               pool.length(seqs[static_cast<size_t>(r)].pool_id));
      promised += ceil_div(known(r), o.page_size) - ceil_div(held, o.page_size);
    }
    while (!preempted && budget > 0 && !waiting.empty() &&
           static_cast<int64_t>(running.size()) < o.max_seqs) {
      const int64_t r = waiting.front();
      Seq& s = seqs[static_cast<size_t>(r)];
      const int64_t want = std::min(known(r), budget);
      const int64_t need = ceil_div(known(r), o.page_size);
      if (o.cache == CacheMode::kStatic) {
        if (static_cast<int64_t>(running.size()) >= b.slots) break;
      } else {
        const int64_t keep = running.empty() ? 0 : watermark;
        if (pool.free_pages() - promised - need < keep) break;
      }
      s.pool_id = pool.add_sequence();
      const Status st =
          pool.append(std::span<const int64_t>(&s.pool_id, 1), std::span<const int64_t>(&want, 1));
      if (!st.ok()) {
        (void)pool.remove(s.pool_id);
        s.pool_id = -1;
        break;
      }
      waiting.pop_front();
      running.push_back(r);
      scheduled.push_back(r);
      counts.push_back(want);
      budget -= want;
      promised += need - ceil_div(want, o.page_size);
    }
    if (scheduled.empty()) return internal_error("serve: a step scheduled nothing");

    // ---- one forward pass over every scheduled token --------------------
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    x.resize(static_cast<size_t>(total * d));
    out.resize(x.size());
    cu.assign(1, 0);
    ids.clear();
    float* row = x.data();
    for (size_t k = 0; k < scheduled.size(); ++k) {
      const int64_t r = scheduled[k];
      const Seq& s = seqs[static_cast<size_t>(r)];
      for (int64_t p = s.computed; p < s.computed + counts[k]; ++p, row += d) {
        const int64_t g = p - requests[r].prompt_tokens;
        if (g < 0) {
          const std::span<const float> tok = model.prompt_token(r, p);
          std::copy(tok.begin(), tok.end(), row);
        } else {
          std::copy_n(s.fed.begin() + g * d, d, row);
        }
      }
      cu.push_back(cu.back() + static_cast<int32_t>(counts[k]));
      ids.push_back(s.pool_id);
    }
    ATTNKIT_RETURN_IF_ERROR(model.forward(x, cu, ids, pool, out, o.run));
    rep.tokens_computed += total;
    const double dt = now_s() - t0;
    clock += dt;
    rep.busy_s += dt;
    ++rep.steps;

    // ---- outputs, then statistics, then finished requests leave ---------
    std::vector<int64_t> done;
    for (size_t k = 0; k < scheduled.size(); ++k) {
      const int64_t r = scheduled[k];
      Seq& s = seqs[static_cast<size_t>(r)];
      RequestReport& rr = rep.requests[static_cast<size_t>(r)];
      s.computed += counts[k];
      if (s.computed < known(r)) continue;  // a prompt chunk short of the end
      const float* y = out.data() + (cu[k + 1] - 1) * d;
      if (rr.first_token_s < 0) rr.first_token_s = clock;
      ++s.generated;
      rr.output_tokens = s.generated;
      if (o.keep_outputs) rr.outputs.insert(rr.outputs.end(), y, y + d);
      if (s.generated < requests[r].output_tokens)
        s.fed.insert(s.fed.end(), y, y + d);
      else
        done.push_back(r);
    }
    int64_t used_tokens = 0;
    for (int64_t r : running) used_tokens += seqs[static_cast<size_t>(r)].computed;
    const double used = static_cast<double>(used_tokens * b.bytes_per_token);
    const double reserved = o.cache == CacheMode::kStatic
                                ? static_cast<double>(static_cast<int64_t>(running.size()) *
                                                      b.max_seq_len * b.bytes_per_token)
                                : static_cast<double>(pool.pages_in_use() * b.page_bytes);
    const int64_t in_step = static_cast<int64_t>(scheduled.size());
    rep.peak_running = std::max(rep.peak_running, in_step);
    rep.peak_used_bytes = std::max(rep.peak_used_bytes, used);
    rep.peak_reserved_bytes = std::max(rep.peak_reserved_bytes, reserved);
    weighted_running += static_cast<double>(in_step) * dt;
    weighted_used += used * dt;
    weighted_reserved += reserved * dt;
    for (int64_t r : done) {
      Seq& s = seqs[static_cast<size_t>(r)];
      rep.requests[static_cast<size_t>(r)].finish_s = clock;
      (void)pool.remove(s.pool_id);  // the id is in the pool: cannot fail
      s.pool_id = -1;
      std::vector<float>().swap(s.fed);
      running.erase(std::find(running.begin(), running.end(), r));
    }
    if (o.on_progress && !done.empty())
      o.on_progress(finished + static_cast<int64_t>(done.size()), n);
    finished += static_cast<int64_t>(done.size());
  }
  rep.end_s = clock;
  if (rep.busy_s > 0) {
    rep.mean_running = weighted_running / rep.busy_s;
    rep.mean_used_bytes = weighted_used / rep.busy_s;
    rep.mean_reserved_bytes = weighted_reserved / rep.busy_s;
  }
  return rep;
}

}  // namespace attnkit::serve
