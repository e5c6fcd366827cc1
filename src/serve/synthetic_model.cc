// serve::SyntheticModel: the benchmark fixture of the engine (serve.h): the
// library's layers with seeded random weights over the paged pool, a small
// seeded vocabulary in and out.
#include <algorithm>
#include <cmath>
#include <new>
#include <string>
#include <utility>

#include "attnkit/serve.h"
#include "core/threads.h"
#include "kernels/linear.h"
#include "layers/stack_pool.h"

namespace attnkit::serve {
namespace {

constexpr double kNormEps = 1e-6;

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
  // activations stay O(1)); a vector [rows] (cols = 0) of `constant` (ones
  // for norm gains, zeros for a norm's bias); with depth > 0 a [rows, cols,
  // depth] tensor ~ U(+-1/sqrt(fan_in)).
  Status add(const std::string& name, int64_t rows, int64_t cols, int64_t depth = 0,
             int64_t fan_in = 0, float constant = 1.0f) {
    const bool vector = cols == 0;
    const int64_t numel = rows * (vector ? 1 : cols) * (depth > 0 ? depth : 1);
    std::vector<float> v;
    try {
      v.resize(static_cast<size_t>(numel));
    } catch (const std::bad_alloc&) {
      return resource_exhausted("serve: cannot allocate the weight " + name);
    }
    if (vector)
      std::fill(v.begin(), v.end(), constant);
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

Status prefixed(const std::string& what, const Status& st) {
  return st.ok() ? st : Status(st.code(), what + ": " + st.message());
}

}  // namespace

Status SyntheticModel::add_latent(uint64_t seed) {
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
  if (c.sparse()) {
    // DeepSeek-V3.2's lightning indexer (latent_attention.h): LayerNorm
    // gain ones and bias zeros, as a freshly initialised LayerNorm.
    const int64_t Hi = c.index_n_heads, Di = c.index_head_dim;
    ATTNKIT_RETURN_IF_ERROR(w.add("indexer.wq_b.weight", Hi * Di, c.q_lora_rank));
    ATTNKIT_RETURN_IF_ERROR(w.add("indexer.wk.weight", Di, d));
    ATTNKIT_RETURN_IF_ERROR(w.add("indexer.k_norm.weight", Di, 0));
    ATTNKIT_RETURN_IF_ERROR(w.add("indexer.k_norm.bias", Di, 0, 0, 0, 0.0f));
    ATTNKIT_RETURN_IF_ERROR(w.add("indexer.weights_proj.weight", Hi, d));
  }
  ATTNKIT_RETURN_IF_ERROR(layer.load_weights(w.map()));
  for (const std::string& n : layer.weight_names()) weight_bytes_ += view_bytes(layer.weight(n));
  index_.push_back(static_cast<int64_t>(latent_.size()));
  is_linear_.push_back(false);
  latent_.push_back(std::move(layer));
  return Status::Ok();
}

Status SyntheticModel::add_mixer(const StackLayer& spec, uint64_t seed) {
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

Status SyntheticModel::add_feed_forward(uint64_t seed) {
  ATTNKIT_ASSIGN_OR_RETURN(MoeLayer ffn, MoeLayer::create(spec_.moe));
  RandomWeights fw(spec_.weight_dtype, seed);
  // Every weight the layer reads, by its own list: matrices in nn.Linear's
  // range for their fan-in (the cols of [rows, cols] and of x @ W's
  // [rows, cols, depth]), vectors (biases) of ones.
  const std::vector<MoeLayer::WeightSpec> specs = ffn.weight_specs();
  const std::vector<std::string> names = ffn.weight_names();
  for (size_t i = 0; i < specs.size(); ++i)
    ATTNKIT_RETURN_IF_ERROR(
        fw.add(names[i], specs[i].rows, specs[i].cols, specs[i].depth, specs[i].cols));
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

Result<SyntheticModel> SyntheticModel::create(const ModelSpec& spec) {
  if (spec.layers < 1)
    return invalid_argument("serve: layers = " + std::to_string(spec.layers) + " must be >= 1");
  if (spec.vocab_size < 1 || spec.vocab_size > (int64_t{1} << 24))
    return invalid_argument("serve: vocab_size = " + std::to_string(spec.vocab_size) +
                            " must be in [1, 2^24]");
  if (spec.weight_dtype != DType::kF32 && spec.weight_dtype != DType::kBF16)
    return invalid_argument(std::string("serve: weight dtype ") + dtype_name(spec.weight_dtype) +
                            " must be f32 or bf16");
  SyntheticModel m;
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
    m.embedding_.resize(static_cast<size_t>(spec.vocab_size * m.hidden_));
    m.head_.resize(m.embedding_.size());
    m.ones_.assign(static_cast<size_t>(m.hidden_), 1.0f);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("serve: cannot allocate the vocabulary tables");
  }
  // Unit RMS per embedding row, as a normalised hidden state; the head in
  // nn.Linear's range.
  fill(m.embedding_, spec.seed * 7919 + 1, std::sqrt(3.0));
  fill(m.head_, spec.seed * 7919 + 2, 1.0 / std::sqrt(static_cast<double>(m.hidden_)));
  return m;
}

bool SyntheticModel::pool_releases_pages() const { return layers::stack_shares_window(attention_); }

Result<PagedKVCache> SyntheticModel::new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype,
                                              bool prefix_caching) const {
  return layers::new_stack_pool(attention_, latent_, num_pages, page_size, kv_dtype,
                                prefix_caching);
}

Result<LinearStatePool> SyntheticModel::new_state_pool(int64_t max_sequences) const {
  std::vector<GatedDeltaNetConfig> configs;
  for (const GatedDeltaNet& g : linear_) configs.push_back(g.config());
  return LinearStatePool::create(configs, max_sequences);
}

int64_t SyntheticModel::state_bytes_per_sequence() const {
  int64_t values = 0;
  for (const GatedDeltaNet& g : linear_)
    values += g.config().state_values() + g.config().conv_state_values();
  return values * static_cast<int64_t>(sizeof(float));
}

Status SyntheticModel::run_mixer(int64_t l, const TensorView& in,
                                 std::span<const int32_t> cu_seqlens,
                                 std::span<const int64_t> seq_ids, PagedKVCache& pool,
                                 LinearStatePool& states, const TensorView& out,
                                 const RunOptions& run) {
  const size_t li = static_cast<size_t>(l);
  const int64_t i = index_[li];
  const size_t ii = static_cast<size_t>(i);
  if (is_linear_[li])
    return linear_[ii].forward_batch(in, cu_seqlens, seq_ids, states, i, out, run);
  if (spec_.mla) return latent_[ii].forward_batch(in, cu_seqlens, seq_ids, pool, i, out, run);
  return attention_[ii].forward_batch(in, cu_seqlens, seq_ids, pool, i, out, run);
}

Status SyntheticModel::forward_step(std::span<const int32_t> token_ids,
                                    std::span<const int32_t> cu_seqlens,
                                    std::span<const int64_t> seq_ids, PagedKVCache& pool,
                                    LinearStatePool& states, std::span<float> logits,
                                    const RunOptions& run) {
  const int64_t d = hidden_, total = static_cast<int64_t>(token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(seq_ids.size()), V = spec_.vocab_size;
  if (static_cast<int64_t>(cu_seqlens.size()) != num_seqs + 1 || cu_seqlens[0] != 0 ||
      cu_seqlens.back() != total)
    return invalid_argument("SyntheticModel::forward_step: cu_seqlens has " +
                            std::to_string(cu_seqlens.size()) + " entries for " +
                            std::to_string(num_seqs) + " sequences and " + std::to_string(total) +
                            " tokens; it must be [0, ..., total] with num_seqs + 1 entries");
  if (static_cast<int64_t>(logits.size()) != num_seqs * V)
    return invalid_argument("SyntheticModel::forward_step: logits has " +
                            std::to_string(logits.size()) +
                            " values, not num_seqs * vocab = " + std::to_string(num_seqs * V));
  for (int64_t i = 0; i < total; ++i)
    if (token_ids[static_cast<size_t>(i)] < 0 || token_ids[static_cast<size_t>(i)] >= V)
      return invalid_argument("SyntheticModel::forward_step: token_ids[" + std::to_string(i) +
                              "] = " + std::to_string(token_ids[static_cast<size_t>(i)]) +
                              " is outside the vocabulary [0, " + std::to_string(V) + ")");
  const size_t n = static_cast<size_t>(total * d);
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
  for (int64_t i = 0; i < total; ++i)
    std::copy_n(embedding_.begin() + static_cast<int64_t>(token_ids[static_cast<size_t>(i)]) * d, d,
                h_.begin() + i * d);
  const TensorView in2 = make_view(in_.data(), DType::kF32, {total, d});
  const TensorView tmp2 = make_view(tmp_.data(), DType::kF32, {total, d});
  for (int64_t l = 0; l < spec_.layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    kernels::rms_norm(h_.data(), d, ones_.data(), in_.data(), d, total, d, kNormEps);
    ATTNKIT_RETURN_IF_ERROR(
        prefixed("layer " + std::to_string(l) + " mixer",
                 run_mixer(l, in2, cu_seqlens, seq_ids, pool, states, tmp2, run)));
    for (size_t i = 0; i < n; ++i) h_[i] += tmp_[i];
    if (spec_.ffn) {
      kernels::rms_norm(h_.data(), d, ones_.data(), in_.data(), d, total, d, kNormEps);
      ATTNKIT_RETURN_IF_ERROR(prefixed(
          "layer " + std::to_string(l) + " feed-forward",
          ffn_[li].forward(make_view(in_.data(), DType::kF32, {1, total, d}),
                           make_view(tmp_.data(), DType::kF32, {1, total, d}), nullptr, run)));
      for (size_t i = 0; i < n; ++i) h_[i] += tmp_[i];
    }
  }
  // The head over each sequence's last token only, f32 weights: a row's
  // logits depend on that row alone where linear_rows_independent().
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t row = cu_seqlens[static_cast<size_t>(s) + 1] - 1;
    kernels::rms_norm(h_.data() + row * d, d, ones_.data(), in_.data() + s * d, d, 1, d, kNormEps);
  }
  kernels::linear(in_.data(), d, head_.data(), nullptr, logits.data(), V, num_seqs, V, d,
                  {.num_threads = resolve_num_threads(run.num_threads), .backend = run.backend});
  return Status::Ok();
}

}  // namespace attnkit::serve
