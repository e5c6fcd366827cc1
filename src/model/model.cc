// Model: the decoder's forward pass over a paged pool (forward_step) and
// over a private pool sized for one call (forward).
#include "attnkit/model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "kernels/linear.h"
#include "layers/stack_pool.h"
#include "model/model_impl.h"

namespace attnkit {
namespace {

kernels::LinearOptions linear_options(const RunOptions& run) {
  kernels::LinearOptions o;
  o.num_threads = run.num_threads;
  o.backend = run.backend;
  return o;
}

// h [tokens, hidden] = embed[token] * embed_scale, the product rounded to
// the embedding's dtype (HF multiplies in that dtype).
void embed_rows(const Model::Impl& m, std::span<const int32_t> tokens, float* h) {
  const int64_t H = m.spec.hidden_size;
  const bool is_bf16 = m.embed.dtype() == DType::kBF16;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int64_t row = tokens[t] * H;
    float* out = h + static_cast<int64_t>(t) * H;
    for (int64_t i = 0; i < H; ++i) {
      const float e =
          is_bf16 ? bf16_to_float(m.embed.ptr<bf16>()[row + i]) : m.embed.ptr<float>()[row + i];
      const float v = e * m.embed_scale;
      out[i] = is_bf16 && m.embed_scale != 1.0f ? bf16_to_float(float_to_bf16(v)) : v;
    }
  }
}

// y [rows, hidden] = down(act(gate(x)) * up(x)) for x [rows, hidden], with
// a, b [rows, intermediate] scratch.
void dense_mlp(const DenseMlp& mlp, const float* x, float* y, int64_t rows, int64_t H, float* a,
               float* b, const RunOptions& run) {
  const int64_t I = mlp.intermediate;
  const kernels::LinearOptions o = linear_options(run);
  kernels::linear(x, H, kernels::weight_of(mlp.gate), nullptr, a, I, rows, I, H, o);
  kernels::linear(x, H, kernels::weight_of(mlp.up), nullptr, b, I, rows, I, H, o);
  const int64_t n = rows * I;
  if (mlp.gelu_tanh) {
    // gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    const double k = std::sqrt(2.0 / M_PI);
    for (int64_t i = 0; i < n; ++i) {
      const double v = a[i];
      a[i] = static_cast<float>(0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v))) * b[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double v = a[i];
      a[i] = static_cast<float>(v / (1.0 + std::exp(-v)) * b[i]);
    }
  }
  kernels::linear(a, I, kernels::weight_of(mlp.down), nullptr, y, H, rows, H, I, o);
}

Status grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) >= n) return Status::Ok();
  try {
    v.resize(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("Model: cannot allocate step scratch of " + std::to_string(n) +
                              " floats");
  }
  return Status::Ok();
}

Status grow_scratch(Model::Impl& m, int64_t total, int64_t rows) {
  const int64_t H = m.spec.hidden_size;
  int64_t inter = 0;
  for (const DenseMlp& d : m.mlp) inter = std::max(inter, d.intermediate);
  ATTNKIT_RETURN_IF_ERROR(grow(m.h, total * H));
  ATTNKIT_RETURN_IF_ERROR(grow(m.x, total * H));
  ATTNKIT_RETURN_IF_ERROR(grow(m.y, total * H));
  ATTNKIT_RETURN_IF_ERROR(grow(m.a, total * inter));
  ATTNKIT_RETURN_IF_ERROR(grow(m.b, total * inter));
  return grow(m.rows_h, rows * H);
}

Status prefixed(const char* fn, int64_t layer, const char* part, const Status& st) {
  return st.ok() ? st
                 : Status(st.code(), std::string(fn) + ": layer " + std::to_string(layer) + " " +
                                         part + ": " + st.message());
}

// One decoder layer over h [total, hidden] in place; a linear-attention
// layer continues each sequence from its slot in `states`.
Status run_block(Model::Impl& m, int64_t l, int64_t total, std::span<const int32_t> cu_seqlens,
                 std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                 const RunOptions& run, const char* fn) {
  const Block& b = m.blocks[static_cast<size_t>(l)];
  const int64_t H = m.spec.hidden_size, n = total * H;
  const double eps = m.spec.rms_norm_eps;
  float *h = m.h.data(), *x = m.x.data(), *y = m.y.data();
  const TensorView xv = make_view(x, DType::kF32, {total, H});
  const TensorView yv = make_view(y, DType::kF32, {total, H});
  kernels::rms_norm(h, H, b.input_norm.ptr<float>(), x, H, total, H, eps);
  const size_t mi = static_cast<size_t>(b.mixer);
  ATTNKIT_RETURN_IF_ERROR(prefixed(
      fn, l, "attention",
      b.kind == LayerKind::kLatentAttention
          ? m.latent[mi].forward_batch(xv, cu_seqlens, seq_ids, pool, b.mixer, yv, run)
      : b.kind == LayerKind::kLinearAttention
          ? m.linear[mi].forward_batch(xv, cu_seqlens, seq_ids, states, b.mixer, yv, run)
          : m.attention[mi].forward_batch(xv, cu_seqlens, seq_ids, pool, b.mixer, yv, run)));
  if (b.post_attn_norm.data() != nullptr)
    kernels::rms_norm(y, H, b.post_attn_norm.ptr<float>(), y, H, total, H, eps);
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
  kernels::rms_norm(h, H, b.pre_ffn_norm.ptr<float>(), x, H, total, H, eps);
  if (b.moe) {
    ATTNKIT_RETURN_IF_ERROR(prefixed(fn, l, "feed-forward",
                                     m.moe[static_cast<size_t>(b.ffn)].forward(
                                         make_view(x, DType::kF32, {1, total, H}),
                                         make_view(y, DType::kF32, {1, total, H}), nullptr, run)));
  } else {
    dense_mlp(m.mlp[static_cast<size_t>(b.ffn)], x, y, total, H, m.a.data(), m.b.data(), run);
  }
  if (b.post_ffn_norm.data() != nullptr)
    kernels::rms_norm(y, H, b.post_ffn_norm.ptr<float>(), y, H, total, H, eps);
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
  return Status::Ok();
}

// The whole decoder over the packed tokens; logits [rows.size(), vocab]
// of the rows `rows` (indices into the packed tokens), written only when
// every layer succeeded.
Status run_tokens(Model::Impl& m, std::span<const int32_t> tokens,
                  std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids,
                  PagedKVCache& pool, LinearStatePool& states, std::span<const int64_t> rows,
                  float* logits, const RunOptions& run, const char* fn) {
  const int64_t total = static_cast<int64_t>(tokens.size()), H = m.spec.hidden_size;
  const int64_t V = m.spec.vocab_size, nrows = static_cast<int64_t>(rows.size());
  ATTNKIT_RETURN_IF_ERROR(grow_scratch(m, total, nrows));
  embed_rows(m, tokens, m.h.data());
  for (int64_t l = 0; l < m.spec.num_layers; ++l)
    ATTNKIT_RETURN_IF_ERROR(run_block(m, l, total, cu_seqlens, seq_ids, pool, states, run, fn));
  for (int64_t r = 0; r < nrows; ++r)
    kernels::rms_norm(m.h.data() + rows[static_cast<size_t>(r)] * H, H, m.final_norm.ptr<float>(),
                      m.rows_h.data() + r * H, H, 1, H, m.spec.rms_norm_eps);
  kernels::linear(m.rows_h.data(), H, kernels::weight_of(m.head()), nullptr, logits, V, nrows, V, H,
                  linear_options(run));
  const double cap = m.spec.final_logit_softcapping;
  if (cap > 0.0)
    for (int64_t i = 0; i < nrows * V; ++i)
      logits[i] = static_cast<float>(cap * std::tanh(logits[i] / cap));
  return Status::Ok();
}

// Every id in [0, vocab).
Status check_tokens(const char* fn, std::span<const int32_t> tokens, int64_t vocab) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return invalid_argument(std::string(fn) + ": token_ids[" + std::to_string(i) +
                              "] = " + std::to_string(tokens[i]) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  return Status::Ok();
}

}  // namespace

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelSpec& Model::spec() const { return impl_->spec; }
int64_t Model::vocab_size() const { return impl_->spec.vocab_size; }
int64_t Model::num_layers() const { return impl_->spec.num_layers; }
int64_t Model::hidden_size() const { return impl_->spec.hidden_size; }
size_t Model::weight_bytes() const { return impl_->weight_bytes; }

bool Model::pool_releases_pages() const { return layers::stack_shares_window(impl_->attention); }

Result<PagedKVCache> Model::new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype,
                                     bool prefix_caching) const {
  return layers::new_stack_pool(impl_->attention, impl_->latent, num_pages, page_size, kv_dtype,
                                prefix_caching);
}

Result<LinearStatePool> Model::new_state_pool(int64_t max_sequences) const {
  // One pool layer per linear-attention layer, in layer order (Block::mixer).
  std::vector<GatedDeltaNetConfig> configs;
  for (const GatedDeltaNet& g : impl_->linear) configs.push_back(g.config());
  return LinearStatePool::create(configs, max_sequences);
}

int64_t Model::state_bytes_per_sequence() const {
  int64_t n = 0;
  for (const GatedDeltaNet& g : impl_->linear)
    n += (g.config().state_values() + g.config().conv_state_values()) *
         static_cast<int64_t>(sizeof(float));
  return n;
}

Status Model::forward_step(std::span<const int32_t> token_ids, std::span<const int32_t> cu_seqlens,
                           std::span<const int64_t> seq_ids, PagedKVCache& pool,
                           LinearStatePool& states, std::span<float> logits,
                           const RunOptions& run) {
  constexpr const char* fn = "Model::forward_step";
  const int64_t n = static_cast<int64_t>(seq_ids.size()), V = vocab_size();
  if (static_cast<int64_t>(cu_seqlens.size()) != n + 1 || n < 1)
    return invalid_argument(std::string(fn) + ": cu_seqlens has " +
                            std::to_string(cu_seqlens.size()) + " entries; must be seq_ids' " +
                            std::to_string(n) + " + 1, with at least one sequence");
  if (cu_seqlens[0] != 0 || cu_seqlens[static_cast<size_t>(n)] != std::ssize(token_ids))
    return invalid_argument(std::string(fn) + ": cu_seqlens must run from 0 to token_ids' size " +
                            std::to_string(token_ids.size()));
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (size_t s = 0; s < rows.size(); ++s) {
    if (cu_seqlens[s + 1] <= cu_seqlens[s])
      return invalid_argument(std::string(fn) + ": cu_seqlens[" + std::to_string(s + 1) +
                              "] = " + std::to_string(cu_seqlens[s + 1]) +
                              " must exceed cu_seqlens[" + std::to_string(s) +
                              "] = " + std::to_string(cu_seqlens[s]) + " (a token per sequence)");
    rows[s] = cu_seqlens[s + 1] - 1;
  }
  if (std::ssize(logits) != n * V)
    return invalid_argument(std::string(fn) + ": logits has " + std::to_string(logits.size()) +
                            " values; must be num_seqs * vocab_size = " + std::to_string(n * V));
  ATTNKIT_RETURN_IF_ERROR(check_tokens(fn, token_ids, V));
  const int64_t nlinear = static_cast<int64_t>(impl_->linear.size());
  if (states.num_layers() != nlinear)
    return invalid_argument(std::string(fn) + ": states has " +
                            std::to_string(states.num_layers()) + " layers; this model has " +
                            std::to_string(nlinear) +
                            " linear-attention layers (use new_state_pool)");
  // run_tokens writes the logits only once every layer has succeeded.
  return run_tokens(*impl_, token_ids, cu_seqlens, seq_ids, pool, states, rows, logits.data(), run,
                    fn);
}

Result<Tensor> Model::forward(const TensorView& token_ids) {
  constexpr const char* fn = "Model::forward";
  if (token_ids.rank != 2 || (token_ids.dtype != DType::kI32 && token_ids.dtype != DType::kI64) ||
      token_ids.shape[0] < 1 || token_ids.shape[1] < 1 || token_ids.data == nullptr)
    return invalid_argument(std::string(fn) + ": token_ids " + token_ids.describe() +
                            " must be [batch, seq] int32 or int64 with batch, seq >= 1");
  const int64_t B = token_ids.shape[0], S = token_ids.shape[1], V = vocab_size();
  // The packed step indexes tokens with int32 (cu_seqlens).
  if (S > std::numeric_limits<int32_t>::max() / B)
    return invalid_argument(std::string(fn) + ": token_ids " + token_ids.describe() +
                            " holds more than 2^31 - 1 tokens");
  std::vector<int32_t> tokens(static_cast<size_t>(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t off = b * token_ids.strides[0] + s * token_ids.strides[1];
      const int64_t id = token_ids.dtype == DType::kI32 ? token_ids.ptr<const int32_t>()[off]
                                                        : token_ids.ptr<const int64_t>()[off];
      if (id < 0 || id >= V)
        return invalid_argument(std::string(fn) + ": token_ids[" + std::to_string(b) + ", " +
                                std::to_string(s) + "] = " + std::to_string(id) +
                                " is outside the vocabulary [0, " + std::to_string(V) + ")");
      tokens[static_cast<size_t>(b * S + s)] = static_cast<int32_t>(id);
    }
  constexpr int64_t kPage = 16;
  ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache pool,
                           new_pool(B * ((S + kPage - 1) / kPage), kPage, DType::kF32, false));
  std::vector<int64_t> ids(static_cast<size_t>(B)), lengths(static_cast<size_t>(B), S);
  std::vector<int32_t> cu(static_cast<size_t>(B + 1));
  for (int64_t b = 0; b < B; ++b) {
    ids[static_cast<size_t>(b)] = pool.add_sequence();
    cu[static_cast<size_t>(b + 1)] = static_cast<int32_t>((b + 1) * S);
  }
  ATTNKIT_RETURN_IF_ERROR(pool.append(ids, lengths));
  // The linear-attention layers' slots, under the pool's ids.
  ATTNKIT_ASSIGN_OR_RETURN(LinearStatePool states, new_state_pool(0));
  if (states.num_layers() > 0)
    for (int64_t id : ids) ATTNKIT_RETURN_IF_ERROR(states.add_sequence(id));
  std::vector<int64_t> rows(static_cast<size_t>(B * S));
  for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<int64_t>(r);
  ATTNKIT_ASSIGN_OR_RETURN(Tensor logits, Tensor::zeros(DType::kF32, {B, S, V}));
  ATTNKIT_RETURN_IF_ERROR(run_tokens(*impl_, tokens, cu, ids, pool, states, rows,
                                     logits.ptr<float>(), impl_->options.run, fn));
  return logits;
}

}  // namespace attnkit
