// AttentionLayer: validate -> project (q/k/v, the gate) -> per-head norm
// -> RoPE -> L2 norm / temperature -> attention (sdpa, or the KV cache) ->
// gate -> o_proj.
//
// MHA, MQA and GQA are one path: only num_kv_heads differs, and the kernels
// map query head h to kv head h / (num_heads / num_kv_heads) without
// expanding K/V. Activations live in per-call scratch owned here (kernels
// never allocate), laid out [batch, seq, heads, head_dim] contiguous, which
// is both kernels::linear's [rows, out_features] and the attention layout.
// Every check runs before anything the caller can see is written: `out`
// is written last (o_proj), and the cache is touched only by its own
// attend(), which is all-or-nothing.
#include "attnkit/attention_layer.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/checked_math.h"
#include "io/weight_loader.h"
#include "kernels/linear.h"
#include "layers/paged_positions.h"
#include "ops/attention_checks.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "AttentionLayer::create";
constexpr const char* kLoad = "AttentionLayer::load_weights";
constexpr const char* kWeight = "AttentionLayer::weight";
constexpr const char* kNewCache = "AttentionLayer::new_cache";
constexpr const char* kForward = "AttentionLayer::forward";
constexpr const char* kForwardQkv = "AttentionLayer::forward_qkv";
constexpr const char* kForwardBatch = "AttentionLayer::forward_batch";
constexpr const char* kNewPagedCache = "AttentionLayer::new_paged_cache";

using check::prefixed;

// Zeroed contiguous f32 scratch [batch, seq, heads, dim].
Status scratch(const char* fn, const char* what, int64_t batch, int64_t seq, int64_t heads,
               int64_t dim, Tensor* t) {
  auto r = Tensor::zeros(DType::kF32, {batch, seq, heads, dim});
  if (!r.ok())
    return Status(r.status().code(),
                  std::string(fn) + ": scratch for " + what + ": " + r.status().message());
  *t = std::move(r).value();
  return Status::Ok();
}

// y = x W^T (+ bias) for every batch item; x [batch, seq, in] with row
// stride x.strides[1] (unit inner stride), y [batch, seq, out] likewise.
// Batch items whose rows lie at one stride go in one call, so that
// batched decode is one GEMM of `batch` rows rather than `batch` GEMVs.
void project(const TensorView& x, const Tensor& w, const Tensor& bias, const TensorView& y,
             const RunOptions& run, bool gemv_for_one_row = true) {
  const int64_t batch = x.shape[0], seq = x.shape[1];
  const int64_t in = w.dim(1), outf = w.dim(0);
  // Row strides with batch and seq merged (a size-1 seq's stride is moot).
  const int64_t ldx = seq == 1 ? x.strides[0] : x.strides[1];
  const int64_t ldy = seq == 1 ? y.strides[0] : y.strides[1];
  const bool one_call = batch == 1 || (x.strides[0] == seq * ldx && y.strides[0] == seq * ldy);
  const kernels::LinearOptions opt{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = gemv_for_one_row};
  if (one_call) {
    kernels::linear(x.ptr<const float>(), ldx, kernels::weight_of(w), bias.ptr<const float>(),
                    y.ptr<float>(), ldy, batch * seq, outf, in, opt);
    return;
  }
  for (int64_t b = 0; b < batch; ++b)
    kernels::linear(x.ptr<const float>() + b * x.strides[0], x.strides[1], kernels::weight_of(w),
                    bias.ptr<const float>(), y.ptr<float>() + b * y.strides[0], y.strides[1], seq,
                    outf, in, opt);
}

// The [batch, seq, heads * dim] view of a [batch, seq, heads, dim] scratch
// tensor, for project().
TensorView flat(const Tensor& t) {
  return make_view(t.data(), DType::kF32, {t.dim(0), t.dim(1), t.dim(2) * t.dim(3)});
}

// The per-layer fields the layer itself relies on, beyond validate().
Status check_layer_fields(const AttentionConfig& c) {
  const std::string f = kCreate;
  if (c.qk_norm != QkNorm::kNone && c.qk_norm != QkNorm::kRms && c.qk_norm != QkNorm::kRmsOnePlus &&
      c.qk_norm != QkNorm::kL2)
    return invalid_argument(f + ": qk_norm = " + std::to_string(static_cast<int>(c.qk_norm)) +
                            " is not a QkNorm value");
  if (c.chunk_size < 0)
    return invalid_argument(f + ": chunk_size = " + std::to_string(c.chunk_size) +
                            " must be >= 0 (0 = no chunked attention)");
  if (c.chunk_size > 0 && c.sliding_window > 0)
    return invalid_argument(f + ": chunk_size = " + std::to_string(c.chunk_size) +
                            " and sliding_window = " + std::to_string(c.sliding_window) +
                            " are both set; a layer has at most one of them");
  if (c.temperature_tuning) {
    if (!std::isfinite(c.floor_scale) || !(c.floor_scale > 0.0))
      return invalid_argument(f + ": floor_scale = " + std::to_string(c.floor_scale) +
                              " must be finite and > 0 (temperature_tuning)");
    if (!std::isfinite(c.attn_scale))
      return invalid_argument(f + ": attn_scale = " + std::to_string(c.attn_scale) +
                              " must be finite (temperature_tuning)");
  }
  return Status::Ok();
}

}  // namespace

Result<AttentionLayer> AttentionLayer::create(const AttentionConfig& config) {
  ATTNKIT_RETURN_IF_ERROR(prefixed(kCreate, validate(config)));
  ATTNKIT_RETURN_IF_ERROR(check_layer_fields(config));
  AttentionLayer layer;
  layer.config_ = config;
  if (config.use_rope) {
    auto rope = Rope::create(config.rope);
    if (!rope.ok()) return prefixed(kCreate, rope.status());
    layer.rope_ = std::move(rope).value();
  }
  if (config.qk_norm == QkNorm::kL2) {
    // No weight: RMSNorm with unit gains.
    for (Tensor* g : {&layer.q_gain_, &layer.k_gain_}) {
      auto ones = Tensor::zeros(DType::kF32, {config.head_dim});
      if (!ones.ok()) return prefixed(kCreate, ones.status());
      *g = std::move(ones).value();
      std::fill_n(g->ptr<float>(), config.head_dim, 1.0f);
    }
  }
  return layer;
}

std::vector<std::string> AttentionLayer::weight_names() const {
  std::vector<std::string> names = {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                    "o_proj.weight"};
  if (config_.qkv_bias)
    for (const char* n : {"q_proj.bias", "k_proj.bias", "v_proj.bias"}) names.emplace_back(n);
  if (config_.o_bias) names.emplace_back("o_proj.bias");
  if (config_.qk_norm == QkNorm::kRms || config_.qk_norm == QkNorm::kRmsOnePlus)
    for (const char* n : {"q_norm.weight", "k_norm.weight"}) names.emplace_back(n);
  if (config_.sinks) names.emplace_back("sinks");
  return names;
}

Status AttentionLayer::load_weights(const WeightMap& weights, std::string_view prefix) {
  const AttentionConfig& c = config_;
  const int64_t hidden = c.hidden_size, q_out = c.num_heads * c.head_dim,
                kv_out = c.num_kv_heads * c.head_dim;
  // Under output_gate, q_proj also emits the gate: [query | gate] per head.
  const int64_t q_rows = c.output_gate ? 2 * q_out : q_out;
  const char* q_meaning = c.output_gate ? "num_heads*2*head_dim (query and gate, output_gate), "
                                          "hidden_size"
                                        : "num_heads*head_dim, hidden_size";
  io::WeightLoader w(weights, prefix, kLoad);
  // Staged, and moved into the layer only when every weight validated.
  Tensor wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, qg, kg, sinks;
  ATTNKIT_RETURN_IF_ERROR(w.load_matrix("q_proj.weight", {q_rows, hidden}, q_meaning, &wq));
  ATTNKIT_RETURN_IF_ERROR(
      w.load_matrix("k_proj.weight", {kv_out, hidden}, "num_kv_heads*head_dim, hidden_size", &wk));
  ATTNKIT_RETURN_IF_ERROR(
      w.load_matrix("v_proj.weight", {kv_out, hidden}, "num_kv_heads*head_dim, hidden_size", &wv));
  ATTNKIT_RETURN_IF_ERROR(
      w.load_matrix("o_proj.weight", {hidden, q_out}, "hidden_size, num_heads*head_dim", &wo));
  if (c.qkv_bias) {
    ATTNKIT_RETURN_IF_ERROR(w.load("q_proj.bias", {q_rows},
                                   c.output_gate ? "num_heads*2*head_dim" : "num_heads*head_dim",
                                   &bq));
    ATTNKIT_RETURN_IF_ERROR(w.load("k_proj.bias", {kv_out}, "num_kv_heads*head_dim", &bk));
    ATTNKIT_RETURN_IF_ERROR(w.load("v_proj.bias", {kv_out}, "num_kv_heads*head_dim", &bv));
  }
  if (c.o_bias) ATTNKIT_RETURN_IF_ERROR(w.load("o_proj.bias", {hidden}, "hidden_size", &bo));
  if (c.qk_norm == QkNorm::kRms || c.qk_norm == QkNorm::kRmsOnePlus) {
    ATTNKIT_RETURN_IF_ERROR(w.load("q_norm.weight", {c.head_dim}, "head_dim", &qn));
    ATTNKIT_RETURN_IF_ERROR(w.load("k_norm.weight", {c.head_dim}, "head_dim", &kn));
    // The gains RMSNorm multiplies by: Gemma's and Qwen3-Next's norms store
    // w and scale by 1 + w (rounded to f32 once, as their f32 forward does).
    const float offset = c.qk_norm == QkNorm::kRmsOnePlus ? 1.0f : 0.0f;
    for (auto [src, dst] : {std::pair{&qn, &qg}, std::pair{&kn, &kg}}) {
      ATTNKIT_ASSIGN_OR_RETURN(*dst, Tensor::zeros(DType::kF32, {c.head_dim}));
      for (int64_t d = 0; d < c.head_dim; ++d)
        dst->ptr<float>()[d] = offset + src->ptr<const float>()[d];
    }
  }
  if (c.sinks) {
    ATTNKIT_RETURN_IF_ERROR(w.load("sinks", {c.num_heads}, "num_heads", &sinks));
    for (int64_t h = 0; h < c.num_heads; ++h)
      if (!std::isfinite(sinks.ptr<const float>()[h]))
        return invalid_argument(std::string(kLoad) + ": " + io::weight_name(prefix, "sinks") + "[" +
                                std::to_string(h) +
                                "] = " + std::to_string(sinks.ptr<const float>()[h]) +
                                " is not finite; every sink logit must be finite");
  }
  ATTNKIT_RETURN_IF_ERROR(w.finish());
  wq_ = std::move(wq);
  wk_ = std::move(wk);
  wv_ = std::move(wv);
  wo_ = std::move(wo);
  bq_ = std::move(bq);
  bk_ = std::move(bk);
  bv_ = std::move(bv);
  bo_ = std::move(bo);
  q_norm_ = std::move(qn);
  k_norm_ = std::move(kn);
  if (c.qk_norm != QkNorm::kL2) {  // kL2's unit gains were set by create()
    q_gain_ = std::move(qg);
    k_gain_ = std::move(kg);
  }
  sinks_ = std::move(sinks);
  return Status::Ok();
}

Result<TensorView> AttentionLayer::weight(std::string_view name) const {
  const std::pair<const char*, const Tensor*> table[] = {
      {"q_proj.weight", &wq_},     {"k_proj.weight", &wk_}, {"v_proj.weight", &wv_},
      {"o_proj.weight", &wo_},     {"q_proj.bias", &bq_},   {"k_proj.bias", &bk_},
      {"v_proj.bias", &bv_},       {"o_proj.bias", &bo_},   {"q_norm.weight", &q_norm_},
      {"k_norm.weight", &k_norm_}, {"sinks", &sinks_}};
  for (const auto& [n, t] : table)
    if (name == n) {
      if (wq_.data() == nullptr)
        return not_found(std::string(kWeight) + ": " + n +
                         " is not loaded yet (call load_weights)");
      if (t->data() == nullptr)
        return not_found(std::string(kWeight) + ": " + n +
                         " is not a weight of this configuration");
      return t->view();
    }
  return not_found(std::string(kWeight) + ": no weight named \"" + std::string(name) + "\"");
}

Result<KVCache> AttentionLayer::new_cache(int64_t batch_size, int64_t max_seq_len,
                                          DType dtype) const {
  auto cache =
      KVCache::create({batch_size, max_seq_len, config_.num_kv_heads, config_.head_dim,
                       config_.head_dim, dtype, config_.sliding_window, config_.chunk_size});
  if (!cache.ok()) return prefixed(kNewCache, cache.status());
  return cache;
}

Status AttentionLayer::forward(const TensorView& x, const TensorView& out,
                               std::span<const int64_t> positions, KVCache* cache,
                               const RunOptions& run) {
  // ---- validation: nothing is written before all of it passes ----------
  const std::string f = kForward;
  const AttentionConfig& c = config_;
  if (wq_.data() == nullptr)
    return invalid_argument(f + ": no weights loaded (call load_weights first)");
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForward, "x", x, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForward, "out", out, c.hidden_size));
  const int64_t B = x.shape[0], T = x.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForward, "out", out, 0, "batch", B, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForward, "out", out, 1, "seq", T, "x.shape[1]"));
  if (check::overlaps(out, x)) return invalid_argument(f + ": out overlaps x; it must not alias");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kForward, "out", out));
  ATTNKIT_RETURN_IF_ERROR(check::run_options(kForward, run));
  int64_t rows;
  if (!checked_mul(B, T, &rows)) return invalid_argument(f + ": batch * seq overflows 64 bits");
  ATTNKIT_RETURN_IF_ERROR(check::positions(kForward, positions, T, rows, true));
  const int64_t L = cache ? cache->length() : 0;
  if (cache) {
    const KVCacheSpec& s = cache->spec();
    if (!c.causal)
      return invalid_argument(f + ": a cache needs a causal layer; config().causal is false");
    const struct {
      const char* name;
      int64_t have, want;
      const char* source;
    } match[] = {{"num_kv_heads", s.num_kv_heads, c.num_kv_heads, "config().num_kv_heads"},
                 {"head_dim", s.head_dim, c.head_dim, "config().head_dim"},
                 {"head_dim_v", s.head_dim_v, c.head_dim, "config().head_dim"},
                 {"sliding_window", s.sliding_window, c.sliding_window, "config().sliding_window"},
                 {"chunk_size", s.chunk_size, c.chunk_size, "config().chunk_size"},
                 {"batch_size", s.batch_size, B, "x.shape[0] (batch)"}};
    for (const auto& m : match)
      if (m.have != m.want)
        return invalid_argument(f + ": cache spec." + m.name + " = " + std::to_string(m.have) +
                                " must equal " + m.source + " = " + std::to_string(m.want) +
                                " (a cache from another layer?)");
    if (T > s.max_seq_len - L)
      return out_of_range(f + ": cache length " + std::to_string(L) + " + " + std::to_string(T) +
                          " new tokens exceeds max_seq_len = " + std::to_string(s.max_seq_len));
    if (check::overlaps(out, cache->keys()) || check::overlaps(out, cache->values()))
      return invalid_argument(f + ": out overlaps the cache's storage");
  }
  if (rows == 0) return Status::Ok();
  return compute(kForward, x, out, positions, L, run, /*gemv_for_one_row=*/true,
                 [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o) {
                   AttentionOptions opt = attention_options(run);
                   // The cache supplies causality, the window and the
                   // chunk; it changes only if this succeeds, and nothing
                   // after it can fail.
                   if (cache) return cache->attend(q.view(), k.view(), v.view(), o.view(), opt);
                   opt.causal = c.causal;
                   if (c.sliding_window > 0) opt.window_size.left = c.sliding_window - 1;
                   opt.chunk_size = c.chunk_size;
                   return sdpa(q.view(), k.view(), v.view(), o.view(), opt);
                 });
}

AttentionOptions AttentionLayer::attention_options(const RunOptions& run) const {
  AttentionOptions opt;
  opt.softmax_scale = config_.softmax_scale;
  opt.softcap = config_.softcap;
  if (config_.sinks) opt.sinks = sinks_.view();
  opt.backend = run.backend;
  opt.num_threads = run.num_threads;
  return opt;
}

Status AttentionLayer::compute(const char* fn, const TensorView& x, const TensorView& out,
                               std::span<const int64_t> positions, int64_t first_position,
                               const RunOptions& run, bool gemv_for_one_row,
                               const AttendFn& attend) const {
  const AttentionConfig& c = config_;
  const int64_t B = x.shape[0], T = x.shape[1];
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  Tensor q, gate, k, v, o;
  ATTNKIT_RETURN_IF_ERROR(project_q(fn, x, run, gemv_for_one_row, &q, &gate));
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "k", B, T, Hkv, D, &k));
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "v", B, T, Hkv, D, &v));
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "the attention output", B, T, H, D, &o));
  std::vector<int64_t> default_pos;
  if (positions.empty()) {
    default_pos.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) default_pos[static_cast<size_t>(t)] = first_position + t;
    positions = default_pos;
  }

  // ---- projections, qk-norm, RoPE (scratch only) ------------------------
  project(x, wk_, bk_, flat(k), run, gemv_for_one_row);
  project(x, wv_, bv_, flat(v), run, gemv_for_one_row);
  ATTNKIT_RETURN_IF_ERROR(position_qk(fn, q, k, positions, positions));

  // ---- attention, the gate, then o_proj into the caller's out -----------
  ATTNKIT_RETURN_IF_ERROR(prefixed(fn, attend(q, k, v, o)));
  apply_gate(o, gate);
  project(flat(o), wo_, bo_, out, run, gemv_for_one_row);
  return Status::Ok();
}

Status AttentionLayer::project_q(const char* fn, const TensorView& x, const RunOptions& run,
                                 bool gemv_for_one_row, Tensor* q, Tensor* gate) const {
  const AttentionConfig& c = config_;
  const int64_t B = x.shape[0], T = x.shape[1], H = c.num_heads, D = c.head_dim;
  if (!c.output_gate) {
    ATTNKIT_RETURN_IF_ERROR(scratch(fn, "q", B, T, H, D, q));
    project(x, wq_, bq_, flat(*q), run, gemv_for_one_row);
    return Status::Ok();
  }
  // One GEMM for query and gate ([query | gate] per head, as the weight
  // stores them), then split into two contiguous tensors: the attention
  // kernels and the norms take q packed.
  Tensor both;
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "q and the gate", B, T, H, 2 * D, &both));
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "q", B, T, H, D, q));
  ATTNKIT_RETURN_IF_ERROR(scratch(fn, "the gate", B, T, H, D, gate));
  project(x, wq_, bq_, flat(both), run, gemv_for_one_row);
  const float* src = both.ptr<const float>();
  float* qd = q->ptr<float>();
  float* gd = gate->ptr<float>();
  for (int64_t r = 0; r < B * T * H; ++r) {
    std::copy_n(src + 2 * r * D, D, qd + r * D);
    std::copy_n(src + (2 * r + 1) * D, D, gd + r * D);
  }
  return Status::Ok();
}

Status AttentionLayer::position_qk(const char* fn, const Tensor& q, const Tensor& k,
                                   std::span<const int64_t> pos_q,
                                   std::span<const int64_t> pos_k) const {
  const AttentionConfig& c = config_;
  const int64_t D = c.head_dim;
  const int64_t q_rows = q.dim(0) * q.dim(1) * q.dim(2), k_rows = k.dim(0) * k.dim(1) * k.dim(2);
  const auto norm = [&] {
    kernels::rms_norm(q.ptr<float>(), D, q_gain_.ptr<float>(), q.ptr<float>(), D, q_rows, D,
                      c.rms_norm_eps);
    kernels::rms_norm(k.ptr<float>(), D, k_gain_.ptr<float>(), k.ptr<float>(), D, k_rows, D,
                      c.rms_norm_eps);
  };
  // Qwen3, Gemma 3 and Qwen3-Next normalise before RoPE, Llama 4 after.
  if (c.qk_norm == QkNorm::kRms || c.qk_norm == QkNorm::kRmsOnePlus) norm();
  if (c.use_rope) {
    ATTNKIT_RETURN_IF_ERROR(prefixed(fn, rope_.apply(q.view(), pos_q)));
    ATTNKIT_RETURN_IF_ERROR(prefixed(fn, rope_.apply(k.view(), pos_k)));
  }
  if (c.qk_norm == QkNorm::kL2) norm();
  if (c.temperature_tuning && !c.use_rope) {
    // Llama 4 tunes the temperature of its NoPE layers only, by the
    // query's absolute position; computed in double, applied once in f32.
    const int64_t B = q.dim(0), T = q.dim(1), per_token = q.dim(2) * D;
    const bool shared = static_cast<int64_t>(pos_q.size()) == T;
    float* qd = q.ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = pos_q[static_cast<size_t>(shared ? t : b * T + t)];
        const double scale =
            std::log1p(std::floor((static_cast<double>(p) + 1.0) / c.floor_scale)) * c.attn_scale +
            1.0;
        float* row = qd + (b * T + t) * per_token;
        for (int64_t i = 0; i < per_token; ++i) row[i] = static_cast<float>(row[i] * scale);
      }
  }
  return Status::Ok();
}

void AttentionLayer::apply_gate(const Tensor& o, const Tensor& gate) const {
  if (!config_.output_gate) return;
  float* od = o.ptr<float>();
  const float* gd = gate.ptr<const float>();
  for (int64_t i = 0; i < o.numel(); ++i) od[i] = od[i] / (1.0f + std::exp(-gd[i]));
}

Result<PagedKVCache> AttentionLayer::new_paged_cache(int64_t num_pages, int64_t page_size,
                                                     int64_t num_layers, DType dtype) const {
  PagedKVCacheSpec spec;
  spec.num_layers = num_layers;
  spec.num_pages = num_pages;
  spec.page_size = page_size;
  spec.num_kv_heads = config_.num_kv_heads;
  spec.head_dim = config_.head_dim;
  spec.dtype = dtype;
  spec.sliding_window = config_.sliding_window;
  spec.chunk_size = config_.chunk_size;
  auto pool = PagedKVCache::create(spec);
  if (!pool.ok()) return prefixed(kNewPagedCache, pool.status());
  return pool;
}

Status AttentionLayer::forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                                     std::span<const int64_t> seq_ids, PagedKVCache& cache,
                                     int64_t layer_index, const TensorView& out,
                                     const RunOptions& run) {
  // ---- validation: nothing is written before all of it passes ----------
  const std::string f = kForwardBatch;
  const AttentionConfig& c = config_;
  if (wq_.data() == nullptr)
    return invalid_argument(f + ": no weights loaded (call load_weights first)");
  if (!c.causal)
    return invalid_argument(f + ": a paged cache needs a causal layer; config().causal is false");
  ATTNKIT_RETURN_IF_ERROR(check::view(kForwardBatch, "x", x, 2, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kForwardBatch, "out", out, 2, {DType::kF32}));
  const int64_t total = x.shape[0];
  // As [1, total, hidden], the layout forward() and its checks take.
  const auto as3 = [](const TensorView& v) {
    TensorView r = v;
    r.rank = 3;
    r.shape = {1, v.shape[0], v.shape[1], 0};
    r.strides = {v.shape[0] * v.strides[0], v.strides[0], v.strides[1], 0};
    return r;
  };
  const TensorView x3 = as3(x), out3 = as3(out);
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardBatch, "x", x3, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardBatch, "out", out3, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForwardBatch, "out", out, 0, "total_tokens", total, "x.shape[0]"));
  if (check::overlaps(out, x)) return invalid_argument(f + ": out overlaps x; it must not alias");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kForwardBatch, "out", out));
  ATTNKIT_RETURN_IF_ERROR(check::run_options(kForwardBatch, run));
  const PagedKVCacheSpec& s = cache.spec();
  const struct {
    const char* name;
    int64_t have, want;
    const char* source;
  } match[] = {{"kv_lora_rank", s.kv_lora_rank, 0, "0 (not MLA's latent layout)"},
               {"num_kv_heads", s.num_kv_heads, c.num_kv_heads, "config().num_kv_heads"},
               {"head_dim", s.head_dim, c.head_dim, "config().head_dim"},
               {"head_dim_v", s.head_dim_v, c.head_dim, "config().head_dim"}};
  for (const auto& m : match)
    if (m.have != m.want)
      return invalid_argument(f + ": cache spec." + m.name + " = " + std::to_string(m.have) +
                              " must equal " + m.source + " = " + std::to_string(m.want) +
                              " (a pool shaped for another layer?)");
  // A pool of this layer's kind (window or chunk, which it releases pages
  // by), or one shared by layers of several kinds (both 0), where the
  // layer's own window and chunk go with each attend() call.
  const struct {
    const char* name;
    int64_t have, want;
  } kind[] = {{"sliding_window", s.sliding_window, c.sliding_window},
              {"chunk_size", s.chunk_size, c.chunk_size}};
  for (const auto& m : kind)
    if (m.have != 0 && m.have != m.want)
      return invalid_argument(f + ": cache spec." + m.name + " = " + std::to_string(m.have) +
                              " must equal config()." + m.name + " = " + std::to_string(m.want) +
                              ", or be 0 in a pool shared by layers of several kinds");
  ATTNKIT_ASSIGN_OR_RETURN(
      std::vector<int64_t> positions,
      paged_positions(kForwardBatch, cu_seqlens_q, seq_ids, cache, layer_index, total));
  if (total == 0) return Status::Ok();
  // One GEMM per projection over every sequence's rows, without the
  // one-row GEMV: a row's result must not depend on the rows beside it
  // (kernels::linear_rows_independent()), so that batching changes no bits.
  return compute(kForwardBatch, x3, out3, positions, 0, run, /*gemv_for_one_row=*/false,
                 [&](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o) {
                   const auto rows = [&](const Tensor& t) {
                     return make_view(t.data(), DType::kF32, {total, t.dim(2), t.dim(3)});
                   };
                   AttentionOptions opt = attention_options(run);
                   if (c.sliding_window > 0) opt.window_size.left = c.sliding_window - 1;
                   opt.chunk_size = c.chunk_size;
                   return cache.attend(layer_index, rows(q), rows(k), rows(v), cu_seqlens_q,
                                       seq_ids, rows(o), opt);
                 });
}

Status AttentionLayer::forward_qkv(const TensorView& query, const TensorView& key,
                                   const TensorView& value, const TensorView& out,
                                   const AttentionOptions& options, const TensorView& probs) {
  const std::string f = kForwardQkv;
  const AttentionConfig& c = config_;
  if (wq_.data() == nullptr)
    return invalid_argument(f + ": no weights loaded (call load_weights first)");
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardQkv, "query", query, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardQkv, "key", key, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardQkv, "value", value, c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(check::activation(kForwardQkv, "out", out, c.hidden_size));
  const int64_t B = query.shape[0], Sq = query.shape[1], Sk = key.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForwardQkv, "key", key, 0, "batch", B, "query.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForwardQkv, "value", value, 0, "batch", B, "query.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForwardQkv, "value", value, 1, "seqlen_k", Sk, "key.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForwardQkv, "out", out, 0, "batch", B, "query.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForwardQkv, "out", out, 1, "seqlen_q", Sq, "query.shape[1]"));
  const TensorView* ins[] = {&query, &key, &value};
  const char* in_names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    if (check::overlaps(out, *ins[i]))
      return invalid_argument(f + ": out overlaps " + in_names[i] + "; it must not alias");
    if (check::overlaps(probs, *ins[i]))
      return invalid_argument(f + ": probs overlaps " + in_names[i] + "; it must not alias");
  }
  if (check::overlaps(probs, out)) return invalid_argument(f + ": probs overlaps out");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kForwardQkv, "out", out));
  // RoPE positions 0..seqlen-1 on each side must stay exact in double.
  if (c.use_rope && (Sq > check::kMaxPosition || Sk > check::kMaxPosition))
    return invalid_argument(f + ": sequence lengths " + std::to_string(Sq) + ", " +
                            std::to_string(Sk) + " exceed RoPE's 2^53 positions");

  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const RunOptions run{options.backend, options.num_threads};  // for the projections
  Tensor q, gate, k, v, o;
  ATTNKIT_RETURN_IF_ERROR(project_q(kForwardQkv, query, run, true, &q, &gate));
  ATTNKIT_RETURN_IF_ERROR(scratch(kForwardQkv, "k", B, Sk, Hkv, D, &k));
  ATTNKIT_RETURN_IF_ERROR(scratch(kForwardQkv, "v", B, Sk, Hkv, D, &v));
  ATTNKIT_RETURN_IF_ERROR(scratch(kForwardQkv, "the attention output", B, Sq, c.num_heads, D, &o));
  project(key, wk_, bk_, flat(k), run);
  project(value, wv_, bv_, flat(v), run);
  std::vector<int64_t> pos(static_cast<size_t>(std::max(Sq, Sk)));
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(i);
  const std::span<const int64_t> all(pos);
  ATTNKIT_RETURN_IF_ERROR(position_qk(kForwardQkv, q, k, all.first(static_cast<size_t>(Sq)),
                                      all.first(static_cast<size_t>(Sk))));

  AttentionOptions opt = options;
  if (opt.softmax_scale == 0.0f) opt.softmax_scale = c.softmax_scale;
  if (opt.softcap == 0.0f) opt.softcap = c.softcap;
  if (opt.chunk_size == 0) opt.chunk_size = c.chunk_size;
  if (opt.sinks.data == nullptr && c.sinks) opt.sinks = sinks_.view();
  // sdpa validates the masks, the options and probs before writing
  // anything; only then does o_proj write `out`.
  ATTNKIT_RETURN_IF_ERROR(
      prefixed(kForwardQkv, sdpa(q.view(), k.view(), v.view(), o.view(), opt, {}, probs)));
  apply_gate(o, gate);
  project(flat(o), wo_, bo_, out, run);
  return Status::Ok();
}

}  // namespace attnkit
