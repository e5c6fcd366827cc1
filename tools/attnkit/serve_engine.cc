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
  // activations stay O(1)); a vector [rows] (cols = 0) of ones (norm gains);
  // with depth > 0 a [rows, cols, depth] tensor ~ U(+-1/sqrt(fan_in)).
  Status add(const std::string& name, int64_t rows, int64_t cols, int64_t depth = 0,
             int64_t fan_in = 0) {
    const bool vector = cols == 0;
    const int64_t numel = rows * (vector ? 1 : cols) * (depth > 0 ? depth : 1);
    std::vector<float> v;
    try {
      v.resize(static_cast<size_t>(numel));
    } catch (const std::bad_alloc&) {
      return resource_exhausted("serve: cannot allocate the weight " + name);
    }
    if (vector)
      std::fill(v.begin(), v.end(), 1.0f);
    else
      fill(v, seed_++, 1.0 / std::sqrt(static_cast<double>(depth > 0 ? fan_in : cols)));
    const DType dtype = vector ? DType::kF32 : dtype_;
    auto t = vector      ? Tensor::zeros(dtype, {rows})
             : depth > 0 ? Tensor::zeros(dtype, {rows, cols, depth})
                         : Tensor::zeros(dtype, {rows, cols});
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

Status Model::add_latent(uint64_t seed) {
  RandomWeights w(spec_.weight_dtype, seed);
  ATTNKIT_ASSIGN_OR_RETURN(LatentAttention layer, LatentAttention::create(spec_.latent));
  const MlaConfig& c = spec_.latent;
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
  for (const std::string& n : layer.weight_names()) weight_bytes_ += view_bytes(layer.weight(n));
  index_.push_back(static_cast<int64_t>(latent_.size()));
  is_linear_.push_back(false);
  latent_.push_back(std::move(layer));
  return Status::Ok();
}

Status Model::add_mixer(const StackLayer& spec, uint64_t seed) {
  RandomWeights w(spec_.weight_dtype, seed);
  if (spec.kind == LayerKind::kLinearAttention) {
    const GatedDeltaNetConfig& c = spec.linear;
    ATTNKIT_ASSIGN_OR_RETURN(GatedDeltaNet layer, GatedDeltaNet::create(c));
    const int64_t d = c.hidden_size, kd = c.num_k_heads * c.key_head_dim,
                  vd = c.num_v_heads * c.value_head_dim;
    ATTNKIT_RETURN_IF_ERROR(w.add("in_proj_qkvz.weight", 2 * kd + 2 * vd, d));
    ATTNKIT_RETURN_IF_ERROR(w.add("in_proj_ba.weight", 2 * c.num_v_heads, d));
    // The depthwise conv's fan-in is its kernel.
    ATTNKIT_RETURN_IF_ERROR(w.add("conv1d.weight", 2 * kd + vd, 1, c.conv_kernel, c.conv_kernel));
    ATTNKIT_RETURN_IF_ERROR(w.add("A_log", c.num_v_heads, 0));
    ATTNKIT_RETURN_IF_ERROR(w.add("dt_bias", c.num_v_heads, 0));
    ATTNKIT_RETURN_IF_ERROR(w.add("norm.weight", c.value_head_dim, 0));
    ATTNKIT_RETURN_IF_ERROR(w.add("out_proj.weight", d, vd));
    ATTNKIT_RETURN_IF_ERROR(layer.load_weights(w.map()));
    for (const auto& [name, t] : w.map())
      weight_bytes_ += static_cast<size_t>(t.numel()) * dtype_size(t.dtype);
    index_.push_back(static_cast<int64_t>(linear_.size()));
    is_linear_.push_back(true);
    linear_.push_back(std::move(layer));
    return Status::Ok();
  }
  const AttentionConfig& c = spec.attention;
  ATTNKIT_ASSIGN_OR_RETURN(AttentionLayer layer, AttentionLayer::create(c));
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
  for (const std::string& n : layer.weight_names()) weight_bytes_ += view_bytes(layer.weight(n));
  index_.push_back(static_cast<int64_t>(attention_.size()));
  is_linear_.push_back(false);
  attention_.push_back(std::move(layer));
  return Status::Ok();
}

Status Model::add_feed_forward(uint64_t seed) {
  const MoeConfig& c = spec_.moe;
  ATTNKIT_ASSIGN_OR_RETURN(MoeLayer ffn, MoeLayer::create(c));
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  RandomWeights fw(spec_.weight_dtype, seed);
  if (c.naming == MoeWeightNaming::kGptOss) {
    // Fused experts, x @ W layouts (moe.h); biases as small random values.
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.router.weight", E, H));
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.router.bias", E, 0));
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.experts.gate_up_proj", E, H, 2 * I, H));
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.experts.gate_up_proj_bias", E, 2 * I));
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.experts.down_proj", E, I, H, I));
    ATTNKIT_RETURN_IF_ERROR(fw.add("mlp.experts.down_proj_bias", E, H));
  } else {
    const bool mixtral = c.naming == MoeWeightNaming::kMixtral;
    const std::string block = mixtral ? "block_sparse_moe." : "mlp.";
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
  }
  ATTNKIT_RETURN_IF_ERROR(ffn.load_weights(fw.map()));
  for (const std::string& n : ffn.weight_names()) weight_bytes_ += view_bytes(ffn.weight(n));
  ffn_.push_back(std::move(ffn));
  return Status::Ok();
}

namespace {

// The stack's layers, checked: `layers` entries, one pool shape among the
// attention layers, at least one of them.
Status check_stack(const ModelSpec& spec, int64_t hidden) {
  if (spec.stack.empty()) return Status::Ok();
  if (spec.mla) return invalid_argument("serve: a per-layer stack cannot go with mla");
  if (static_cast<int64_t>(spec.stack.size()) != spec.layers)
    return invalid_argument("serve: stack has " + std::to_string(spec.stack.size()) +
                            " layers but layers = " + std::to_string(spec.layers));
  const AttentionConfig* first = nullptr;
  for (size_t l = 0; l < spec.stack.size(); ++l) {
    const StackLayer& s = spec.stack[l];
    const std::string where = "serve: stack layer " + std::to_string(l);
    const int64_t h =
        s.kind == LayerKind::kLinearAttention ? s.linear.hidden_size : s.attention.hidden_size;
    if (s.kind != LayerKind::kAttention && s.kind != LayerKind::kLinearAttention)
      return invalid_argument(where + ": only attention and linear-attention layers are served");
    if (h != hidden)
      return invalid_argument(where + ": hidden_size " + std::to_string(h) +
                              " differs from layer 0's " + std::to_string(hidden));
    if (s.kind != LayerKind::kAttention) continue;
    if (first == nullptr) first = &s.attention;
    if (s.attention.num_kv_heads != first->num_kv_heads || s.attention.head_dim != first->head_dim)
      return invalid_argument(where + ": " + std::to_string(s.attention.num_kv_heads) +
                              " kv heads of " + std::to_string(s.attention.head_dim) +
                              ", but the first attention layer's are " +
                              std::to_string(first->num_kv_heads) + " of " +
                              std::to_string(first->head_dim) + " (one pool holds them all)");
  }
  if (first == nullptr)
    return invalid_argument(
        "serve: the stack has no attention layer (its pool's shape comes from one)");
  return Status::Ok();
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
  m.hidden_ = spec.mla             ? spec.latent.hidden_size
              : spec.stack.empty() ? spec.attention.hidden_size
                                   : (spec.stack[0].kind == LayerKind::kLinearAttention
                                          ? spec.stack[0].linear.hidden_size
                                          : spec.stack[0].attention.hidden_size);
  ATTNKIT_RETURN_IF_ERROR(check_stack(spec, m.hidden_));
  if (spec.ffn && spec.moe.hidden_size != m.hidden_)
    return invalid_argument("serve: the feed-forward's hidden_size " +
                            std::to_string(spec.moe.hidden_size) + " must equal the attention's " +
                            std::to_string(m.hidden_));
  uint64_t seed = spec.seed * 1000003;
  for (int64_t l = 0; l < spec.layers; ++l, seed += 2000) {
    if (spec.mla) {
      ATTNKIT_RETURN_IF_ERROR(m.add_latent(seed));
    } else if (spec.stack.empty()) {
      ATTNKIT_RETURN_IF_ERROR(m.add_mixer({LayerKind::kAttention, spec.attention, {}}, seed));
    } else {
      ATTNKIT_RETURN_IF_ERROR(m.add_mixer(spec.stack[static_cast<size_t>(l)], seed));
    }
    if (spec.ffn) ATTNKIT_RETURN_IF_ERROR(m.add_feed_forward(seed + 1000));
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

bool Model::pool_releases_pages() const {
  for (const AttentionLayer& a : attention_)
    if (a.config().sliding_window != attention_[0].config().sliding_window ||
        a.config().chunk_size != attention_[0].config().chunk_size)
      return false;
  return true;
}

Result<PagedKVCache> Model::new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype) const {
  if (spec_.mla) return latent_[0].new_paged_cache(num_pages, page_size, spec_.layers, kv_dtype);
  const AttentionConfig& c = attention_[0].config();
  PagedKVCacheSpec s;
  s.num_layers = static_cast<int64_t>(attention_.size());
  s.num_pages = num_pages;
  s.page_size = page_size;
  s.num_kv_heads = c.num_kv_heads;
  s.head_dim = c.head_dim;
  s.dtype = kv_dtype;
  // Layers of several kinds: no window or chunk in the pool; each layer
  // passes its own per call (AttentionLayer::forward_batch).
  if (pool_releases_pages()) {
    s.sliding_window = c.sliding_window;
    s.chunk_size = c.chunk_size;
  }
  return PagedKVCache::create(s);
}

Result<LinearStatePool> Model::new_state_pool(int64_t max_sequences) const {
  std::vector<GatedDeltaNetConfig> configs;
  for (const GatedDeltaNet& g : linear_) configs.push_back(g.config());
  return LinearStatePool::create(configs, max_sequences);
}

int64_t Model::state_bytes_per_sequence() const {
  int64_t values = 0;
  for (const GatedDeltaNet& g : linear_)
    values += g.config().state_values() + g.config().conv_state_values();
  return values * static_cast<int64_t>(sizeof(float));
}

std::span<const float> Model::prompt_token(int64_t request, int64_t position) const {
  const uint64_t key =
      mix(spec_.seed * 0x100000001B3ull + static_cast<uint64_t>(request) * 0x9E3779B97F4A7C15ull +
          static_cast<uint64_t>(position));
  const size_t row = static_cast<size_t>(key % static_cast<uint64_t>(kVocabulary));
  return std::span<const float>(vocabulary_)
      .subspan(row * static_cast<size_t>(hidden_), static_cast<size_t>(hidden_));
}

Status Model::run_mixer(int64_t l, const TensorView& in, std::span<const int32_t> cu_seqlens,
                        std::span<const int64_t> seq_ids, PagedKVCache& pool,
                        LinearStatePool& states, const TensorView& out, const RunOptions& run) {
  const size_t li = static_cast<size_t>(l);
  const int64_t i = index_[li];
  const size_t ii = static_cast<size_t>(i);
  if (is_linear_[li])
    return linear_[ii].forward_batch(in, cu_seqlens, seq_ids, states, i, out, run);
  if (spec_.mla) return latent_[ii].forward_batch(in, cu_seqlens, seq_ids, pool, i, out, run);
  return attention_[ii].forward_batch(in, cu_seqlens, seq_ids, pool, i, out, run);
}

Status Model::forward(std::span<const float> x, std::span<const int32_t> cu_seqlens,
                      std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                      std::span<float> out, const RunOptions& run) {
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
    ATTNKIT_RETURN_IF_ERROR(
        prefixed("layer " + std::to_string(l) + " mixer",
                 run_mixer(l, in2, cu_seqlens, seq_ids, pool, states, tmp2, run)));
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

// The KV pages and the linear layers' state slots share the budget: a
// running sequence costs its pages and state_bytes. The pool is made with
// the pages the budget holds besides one sequence's state; while n
// sequences run, at most pages_for(n) of them may be in use.
struct Budget {
  int64_t bytes_per_token = 0;  // all layers
  int64_t state_bytes = 0;      // per sequence, all linear layers
  int64_t memory = 0;
  int64_t page_bytes = 0;
  int64_t pages = 0;  // the pool's
  int64_t pages_for(int64_t running) const {
    return std::clamp<int64_t>((memory - running * state_bytes) / page_bytes, 0, pages);
  }
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
  b.state_bytes = model.state_bytes_per_sequence();
  b.memory = o.memory_bytes;
  if (o.cache == CacheMode::kPaged) {
    b.pages = std::max<int64_t>(0, (o.memory_bytes - b.state_bytes) / b.page_bytes);
    return b;
  }
  int64_t longest = 1;
  for (const Request& r : requests) longest = std::max(longest, slots_needed(r));
  b.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : longest;
  b.slots = o.memory_bytes / (b.max_seq_len * b.bytes_per_token + b.state_bytes);
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
                              memory + " holds " + std::to_string(b.pages) +
                              (b.state_bytes > 0 ? " besides one sequence's linear-attention "
                                                   "state of " +
                                                       std::to_string(b.state_bytes) + " bytes"
                                                 : std::string()));
    if (o.cache == CacheMode::kStatic && need > b.max_seq_len)
      return invalid_argument(what + " needs " + std::to_string(need) +
                              " token slots, more than the static max_seq_len " +
                              std::to_string(b.max_seq_len));
  }
  if (o.cache == CacheMode::kStatic && b.slots < 1)
    return invalid_argument("a static cache slot of " + std::to_string(b.max_seq_len) +
                            " tokens needs " +
                            std::to_string(b.max_seq_len * b.bytes_per_token + b.state_bytes) +
                            " bytes, more than the budget of " + memory);
  return Status::Ok();
}

namespace {

// One run of the scheduler (the file comment of serve_engine.h): the pool,
// the state slots and where every request stands.
class Server {
 public:
  Server(Model& model, std::span<const Request> requests, const Options& o, const Budget& b,
         PagedKVCache pool, LinearStatePool states)
      : model_(model),
        requests_(requests),
        o_(o),
        b_(b),
        pool_(std::move(pool)),
        states_(std::move(states)),
        seqs_(requests.size()) {}

  Result<Report> serve();

 private:
  // Per request: where it stands, and the outputs it feeds back.
  struct Seq {
    int64_t pool_id = -1;    // -1 = not in the pool
    int64_t computed = 0;    // tokens whose K/V the pool holds
    int64_t generated = 0;   // outputs so far
    std::vector<float> fed;  // [generated, hidden]: output g is token prompt + g's input
  };

  Seq& seq(int64_t r) { return seqs_[static_cast<size_t>(r)]; }
  int64_t known(int64_t r) { return requests_[r].prompt_tokens + seq(r).generated; }
  // Pages the sequences may use while `running` of them hold state.
  int64_t free_pages(int64_t running) const {
    return std::min(pool_.free_pages(), b_.pages_for(running) - pool_.pages_in_use());
  }
  Status reserve(int64_t r, int64_t want);
  Status enter(int64_t r);
  void leave(int64_t r);
  void preempt(int64_t r);
  Status schedule_running(int64_t& budget, bool& preempted);
  Status admit(int64_t& budget);
  Status forward();
  void collect(double dt);
  void finish_stats();

  Model& model_;
  std::span<const Request> requests_;
  const Options& o_;
  Budget b_;
  PagedKVCache pool_;
  LinearStatePool states_;
  std::vector<Seq> seqs_;
  Report rep_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;  // admission order
  std::vector<int64_t> scheduled_, counts_;
  std::vector<float> x_, out_;
  std::vector<int32_t> cu_;
  std::vector<int64_t> ids_;
  int64_t finished_ = 0;
  double clock_ = 0.0, weighted_running_ = 0.0, weighted_used_ = 0.0, weighted_reserved_ = 0.0;
};

// Reserves `want` more token slots of r (all or nothing): kResourceExhausted
// when the pool, or the budget left beside the running sequences' states,
// has too few pages.
Status Server::reserve(int64_t r, int64_t want) {
  const int64_t id = seq(r).pool_id;
  // kStatic: the pool holds exactly the slots' pages and the slots' states
  // were counted in b_.slots.
  if (b_.state_bytes > 0 && o_.cache == CacheMode::kPaged) {
    ATTNKIT_ASSIGN_OR_RETURN(const int64_t held, pool_.length(id));
    const int64_t extra = ceil_div(held + want, o_.page_size) - ceil_div(held, o_.page_size);
    if (extra > free_pages(static_cast<int64_t>(running_.size())))
      return resource_exhausted("serve: the budget beside the states holds no more pages");
  }
  return pool_.append(std::span<const int64_t>(&id, 1), std::span<const int64_t>(&want, 1));
}

// r joins the pool and, with linear layers, the state slots (same id).
Status Server::enter(int64_t r) {
  Seq& s = seq(r);
  s.pool_id = pool_.add_sequence();
  if (states_.num_layers() == 0) return Status::Ok();
  const Status st = states_.add_sequence(s.pool_id);
  if (!st.ok()) {
    (void)pool_.remove(s.pool_id);
    s.pool_id = -1;
  }
  return st;
}

// r's pages and state slot are freed.
void Server::leave(int64_t r) {
  Seq& s = seq(r);
  (void)pool_.remove(s.pool_id);  // the id is in the pool: cannot fail
  if (states_.num_layers() > 0) (void)states_.remove(s.pool_id);
  s.pool_id = -1;
}

void Server::preempt(int64_t r) {
  leave(r);
  seq(r).computed = 0;
  ++rep_.requests[static_cast<size_t>(r)].preemptions;
  ++rep_.preemptions;
  waiting_.push_front(r);
}

// Running sequences, oldest first, get their next tokens; when the pool is
// out of pages the most recently admitted one is preempted.
Status Server::schedule_running(int64_t& budget, bool& preempted) {
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    const int64_t r = running_[i];
    const int64_t want = std::min(known(r) - seq(r).computed, budget);
    Status st = reserve(r, want);
    while (!st.ok() && st.code() == StatusCode::kResourceExhausted && running_.back() != r) {
      preempt(running_.back());
      running_.pop_back();
      preempted = true;
      st = reserve(r, want);
    }
    if (!st.ok()) {
      if (st.code() != StatusCode::kResourceExhausted) return prefixed("serve: append", st);
      // It is the most recent running sequence itself: it waits.
      preempt(r);
      running_.pop_back();
      preempted = true;
      break;
    }
    scheduled_.push_back(r);
    counts_.push_back(want);
    budget -= want;
    ++i;
  }
  return Status::Ok();
}

// Waiting requests are admitted in order while the token budget, max_seqs
// and the pool (with the prompt pages promised to the running sequences,
// and the watermark) allow.
Status Server::admit(int64_t& budget) {
  const int64_t watermark =
      static_cast<int64_t>(std::ceil(kWatermark * static_cast<double>(b_.pages)));
  int64_t promised = 0;
  for (int64_t r : running_) {
    ATTNKIT_ASSIGN_OR_RETURN(const int64_t held, pool_.length(seq(r).pool_id));
    promised += ceil_div(known(r), o_.page_size) - ceil_div(held, o_.page_size);
  }
  while (budget > 0 && !waiting_.empty() && static_cast<int64_t>(running_.size()) < o_.max_seqs) {
    const int64_t r = waiting_.front();
    const int64_t want = std::min(known(r), budget);
    const int64_t need = ceil_div(known(r), o_.page_size);
    const int64_t n = static_cast<int64_t>(running_.size());
    if (o_.cache == CacheMode::kStatic) {
      if (n >= b_.slots) break;
    } else if (free_pages(n + 1) - promised - need < (running_.empty() ? 0 : watermark)) {
      break;
    }
    if (!enter(r).ok()) break;
    running_.push_back(r);
    if (!reserve(r, want).ok()) {
      running_.pop_back();
      leave(r);
      break;
    }
    waiting_.pop_front();
    scheduled_.push_back(r);
    counts_.push_back(want);
    budget -= want;
    promised += need - ceil_div(want, o_.page_size);
  }
  return Status::Ok();
}

// One forward pass over every scheduled token.
Status Server::forward() {
  const int64_t d = model_.hidden_size();
  int64_t total = 0;
  for (int64_t c : counts_) total += c;
  x_.resize(static_cast<size_t>(total * d));
  out_.resize(x_.size());
  cu_.assign(1, 0);
  ids_.clear();
  float* row = x_.data();
  for (size_t k = 0; k < scheduled_.size(); ++k) {
    const int64_t r = scheduled_[k];
    const Seq& s = seq(r);
    for (int64_t p = s.computed; p < s.computed + counts_[k]; ++p, row += d) {
      const int64_t g = p - requests_[r].prompt_tokens;
      if (g < 0) {
        const std::span<const float> tok = model_.prompt_token(r, p);
        std::copy(tok.begin(), tok.end(), row);
      } else {
        std::copy_n(s.fed.begin() + g * d, d, row);
      }
    }
    cu_.push_back(cu_.back() + static_cast<int32_t>(counts_[k]));
    ids_.push_back(s.pool_id);
  }
  rep_.tokens_computed += total;
  return model_.forward(x_, cu_, ids_, pool_, states_, out_, o_.run);
}

// Outputs, then statistics, then finished requests leave.
void Server::collect(double dt) {
  const int64_t d = model_.hidden_size();
  std::vector<int64_t> done;
  for (size_t k = 0; k < scheduled_.size(); ++k) {
    const int64_t r = scheduled_[k];
    Seq& s = seq(r);
    RequestReport& rr = rep_.requests[static_cast<size_t>(r)];
    s.computed += counts_[k];
    if (s.computed < known(r)) continue;  // a prompt chunk short of the end
    const float* y = out_.data() + (cu_[k + 1] - 1) * d;
    if (rr.first_token_s < 0) rr.first_token_s = clock_;
    ++s.generated;
    rr.output_tokens = s.generated;
    if (o_.keep_outputs) rr.outputs.insert(rr.outputs.end(), y, y + d);
    if (s.generated < requests_[r].output_tokens)
      s.fed.insert(s.fed.end(), y, y + d);
    else
      done.push_back(r);
  }
  int64_t used_tokens = 0;
  for (int64_t r : running_) used_tokens += seq(r).computed;
  const int64_t n = static_cast<int64_t>(running_.size());
  const double states = static_cast<double>(n * b_.state_bytes);
  const double used = static_cast<double>(used_tokens * b_.bytes_per_token) + states;
  const double reserved =
      states + (o_.cache == CacheMode::kStatic
                    ? static_cast<double>(n * b_.max_seq_len * b_.bytes_per_token)
                    : static_cast<double>(pool_.pages_in_use() * b_.page_bytes));
  const int64_t in_step = static_cast<int64_t>(scheduled_.size());
  rep_.peak_running = std::max(rep_.peak_running, in_step);
  rep_.peak_used_bytes = std::max(rep_.peak_used_bytes, used);
  rep_.peak_reserved_bytes = std::max(rep_.peak_reserved_bytes, reserved);
  weighted_running_ += static_cast<double>(in_step) * dt;
  weighted_used_ += used * dt;
  weighted_reserved_ += reserved * dt;
  for (int64_t r : done) {
    rep_.requests[static_cast<size_t>(r)].finish_s = clock_;
    leave(r);
    std::vector<float>().swap(seq(r).fed);
    running_.erase(std::find(running_.begin(), running_.end(), r));
  }
  const int64_t total = static_cast<int64_t>(requests_.size());
  if (o_.on_progress && !done.empty())
    o_.on_progress(finished_ + static_cast<int64_t>(done.size()), total);
  finished_ += static_cast<int64_t>(done.size());
}

Result<Report> Server::serve() {
  const int64_t n = static_cast<int64_t>(requests_.size());
  rep_.requests.resize(static_cast<size_t>(n));
  rep_.kv_bytes_per_token = b_.bytes_per_token;
  rep_.state_bytes_per_sequence = b_.state_bytes;
  rep_.pool_releases_pages = model_.pool_releases_pages();
  rep_.pool_pages = b_.pages;
  rep_.max_running = o_.cache == CacheMode::kStatic ? b_.slots : 0;
  rep_.max_seq_len = b_.max_seq_len;
  for (int64_t i = 0; i < n; ++i)
    rep_.requests[static_cast<size_t>(i)].arrival_s = requests_[i].arrival_s;
  std::vector<int64_t> order(static_cast<size_t>(n));  // by arrival, stable
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
    return requests_[a].arrival_s < requests_[c].arrival_s;
  });
  if (n > 0) rep_.start_s = requests_[order[0]].arrival_s;
  clock_ = rep_.start_s;
  size_t next_arrival = 0;
  while (finished_ < n) {
    while (next_arrival < order.size() && requests_[order[next_arrival]].arrival_s <= clock_)
      waiting_.push_back(order[next_arrival++]);
    if (running_.empty() && waiting_.empty()) {
      clock_ = requests_[order[next_arrival]].arrival_s;  // idle: jump to the next arrival
      continue;
    }
    const double t0 = now_s();
    int64_t budget = o_.max_tokens_per_step;
    bool preempted = false;
    scheduled_.clear();
    counts_.clear();
    ATTNKIT_RETURN_IF_ERROR(schedule_running(budget, preempted));
    if (!preempted) ATTNKIT_RETURN_IF_ERROR(admit(budget));
    if (scheduled_.empty()) return internal_error("serve: a step scheduled nothing");
    ATTNKIT_RETURN_IF_ERROR(forward());
    const double dt = now_s() - t0;
    clock_ += dt;
    rep_.busy_s += dt;
    ++rep_.steps;
    collect(dt);
  }
  rep_.end_s = clock_;
  if (rep_.busy_s > 0) {
    rep_.mean_running = weighted_running_ / rep_.busy_s;
    rep_.mean_used_bytes = weighted_used_ / rep_.busy_s;
    rep_.mean_reserved_bytes = weighted_reserved_ / rep_.busy_s;
  }
  return std::move(rep_);
}

}  // namespace

Result<Report> run(Model& model, std::span<const Request> requests, const Options& o) {
  ATTNKIT_RETURN_IF_ERROR(check_feasible(model, requests, o));
  ATTNKIT_ASSIGN_OR_RETURN(const Budget b, budget_for(model, requests, o));
  ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache pool, model.new_pool(b.pages, o.page_size, o.kv_dtype));
  ATTNKIT_ASSIGN_OR_RETURN(LinearStatePool states, model.new_state_pool());
  Server server(model, requests, o, b, std::move(pool), std::move(states));
  return server.serve();
}

}  // namespace attnkit::serve
