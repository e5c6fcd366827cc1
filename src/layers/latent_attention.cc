// LatentAttention: validate -> project -> RoPE -> (append to the latent
// cache) -> one of the two attention forms -> o_proj.
//
// Both forms run the one attention kernel (kernels::run_attention) and
// differ only in what they hand it:
//   naive     q [B, T, H, d_qk]; K/V decompressed from the latent rows into
//             kv [B, S, H, d_qk + d_v] (per head: k_nope | k_rope | v), K and
//             V being two strided views of it; head_dim d_qk, head_dim_v d_v.
//   absorbed  qa [B, T, H, d_c + d_r] = [W_UK_h^T q_nope ; q_rope]; K and V
//             are the latent rows themselves (cache storage or this call's
//             rows), one kv head, head_dim d_c + d_r, head_dim_v d_c (the
//             first d_c values of the same row); the output [B, T, H, d_c]
//             goes through W_UV_h per head.
// W_UK_h and W_UV_h are never copied: kv_b_proj is [H, d_n + d_v, d_c], so
// head h's W_UK is rows [h (d_n + d_v), +d_n) and W_UV the d_v rows after.
#include "attnkit/latent_attention.h"

#include "attnkit/sparse_attention.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/checked_math.h"
#include "core/threads.h"
#include "io/weight_loader.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"
#include "kernels/sparse.h"
#include "layers/paged_positions.h"
#include "ops/kv_quant.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "LatentAttention::create";
constexpr const char* kLoad = "LatentAttention::load_weights";
constexpr const char* kNewCache = "LatentAttention::new_cache";
constexpr const char* kForward = "LatentAttention::forward";
constexpr const char* kForwardBatch = "LatentAttention::forward_batch";
constexpr const char* kNewPagedCache = "LatentAttention::new_paged_cache";

// What one attention multiply-add costs relative to one multiply-add of the
// per-head decompression (kernels::linear over d_c inputs), for
// choose_form(). Measured with bench/mla_form_bench at a DeepSeek-V3-shaped
// layer, oneDNN projections and the fast attention kernel (2026-11-22): a
// decompression MAC 0.0144 ns wall / 0.0229 ns CPU, an absorbed-attention
// MAC 0.0048 / 0.0097 ns, a ratio of 0.33 / 0.42 (docs/MLA.md, "Choosing
// the form").
constexpr double kAttentionMacCost = 0.4;

// Uninitialised f32 scratch; allocation failure is reported, not thrown.
class Scratch {
 public:
  Status alloc(int64_t n, const char* what) {
    try {
      buf_ = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(n));
    } catch (const std::bad_alloc&) {
      return resource_exhausted(std::string(kForward) + ": cannot allocate " + std::to_string(n) +
                                " floats of scratch for " + what);
    }
    return Status::Ok();
  }
  float* data() const { return buf_.get(); }

 private:
  std::unique_ptr<float[]> buf_;
};

// Frees what std::aligned_alloc gave.
struct FreeAligned {
  void operator()(uint8_t* p) const { std::free(p); }
};

kernels::Strides4 strides4(int64_t batch, int64_t row, int64_t head) {
  return {batch, row, head, 1};
}

}  // namespace

Result<LatentAttention> LatentAttention::create(const MlaConfig& config) {
  ATTNKIT_RETURN_IF_ERROR(check::prefixed(kCreate, validate(config)));
  RopeConfig rc;
  rc.head_dim = config.qk_rope_head_dim;
  rc.rotary_dim = config.qk_rope_head_dim;
  rc.theta = config.rope_theta;
  // DeepSeek's checkpoints hold their q/k rope rows interleaved; a config
  // with rope_interleave = false rotates them half-split (Hugging Face's
  // DeepSeek-V3 applies rotate_half without its interleaving permutation).
  rc.pairing = config.rope_interleave ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  rc.scaling = config.rope_scaling;
  if (rc.scaling.type == RopeScaling::Type::kYarn) {
    // cos/sin amplitude: HF's mscale ratio when the config gives both (1 in
    // every released config); never YaRN's bare mscale(factor), whose
    // correction already sits in the softmax scale (mla_softmax_scale).
    const RopeScaling& y = rc.scaling;
    const auto m = [&](double s) { return 0.1 * s * std::log(y.factor) + 1.0; };
    rc.scaling.attention_factor = (y.mscale > 0.0 && y.mscale_all_dim > 0.0 && y.factor > 1.0)
                                      ? m(y.mscale) / m(y.mscale_all_dim)
                                      : 1.0;
  }
  Result<Rope> rope = Rope::create(rc);
  if (!rope.ok())
    return Status(rope.status().code(), std::string(kCreate) + ": " + rope.status().message());
  LatentAttention layer;
  if (config.sparse()) {
    // The indexer's RoPE: MLA's frequencies, pairs (i, i + d_r/2) as
    // DeepSeek's code since its Nov-2025 fix, and no amplitude factor (its
    // freqs_cis are unit complex numbers).
    rc.pairing = RopePairing::kHalfSplit;
    if (rc.scaling.type == RopeScaling::Type::kYarn) rc.scaling.attention_factor = 1.0;
    Result<Rope> index_rope = Rope::create(rc);
    if (!index_rope.ok())
      return Status(index_rope.status().code(),
                    std::string(kCreate) + ": indexer " + index_rope.status().message());
    layer.index_rope_ = std::move(index_rope).value();
  }
  layer.config_ = config;
  layer.softmax_scale_ = mla_softmax_scale(config);
  layer.rope_ = std::move(rope).value();
  return layer;
}

std::vector<std::string> LatentAttention::weight_names() const {
  std::vector<std::string> names;
  if (config_.q_lora_rank > 0)
    names = {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"};
  else
    names = {"q_proj.weight"};
  for (const char* n :
       {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"})
    names.emplace_back(n);
  if (config_.sparse())
    for (const char* n : {"indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight",
                          "indexer.k_norm.bias", "indexer.weights_proj.weight"})
      names.emplace_back(n);
  return names;
}

Status LatentAttention::load_weights(const WeightMap& weights, std::string_view prefix) {
  const MlaConfig& c = config_;
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dqk = c.qk_head_dim(), dr = c.qk_rope_head_dim,
                dn = c.qk_nope_head_dim, dv = c.v_head_dim;
  io::WeightLoader loader(weights, prefix, kLoad);
  Weights staged;  // swapped in only when everything loaded
  if (dq > 0) {
    ATTNKIT_RETURN_IF_ERROR(
        loader.load_matrix("q_a_proj.weight", {dq, d}, "q_lora_rank, hidden_size", &staged.q_a));
    ATTNKIT_RETURN_IF_ERROR(
        loader.load("q_a_layernorm.weight", {dq}, "q_lora_rank", &staged.q_a_norm));
    ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(
        "q_b_proj.weight", {H * dqk, dq},
        "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim), q_lora_rank", &staged.q_b));
  } else {
    ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(
        "q_proj.weight", {H * dqk, d},
        "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim), hidden_size", &staged.q));
  }
  ATTNKIT_RETURN_IF_ERROR(loader.load_matrix("kv_a_proj_with_mqa.weight", {dc + dr, d},
                                             "kv_lora_rank+qk_rope_head_dim, hidden_size",
                                             &staged.kv_a));
  ATTNKIT_RETURN_IF_ERROR(
      loader.load("kv_a_layernorm.weight", {dc}, "kv_lora_rank", &staged.kv_a_norm));
  ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(
      "kv_b_proj.weight", {H * (dn + dv), dc},
      "num_attention_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank", &staged.kv_b));
  ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(
      "o_proj.weight", {d, H * dv}, "hidden_size, num_attention_heads*v_head_dim", &staged.o));
  if (c.sparse()) {
    const int64_t hi = c.index_n_heads, di = c.index_head_dim;
    ATTNKIT_RETURN_IF_ERROR(loader.load_matrix("indexer.wq_b.weight", {hi * di, dq},
                                               "index_n_heads*index_head_dim, q_lora_rank",
                                               &staged.idx_wq_b));
    ATTNKIT_RETURN_IF_ERROR(loader.load_matrix("indexer.wk.weight", {di, d},
                                               "index_head_dim, hidden_size", &staged.idx_wk));
    ATTNKIT_RETURN_IF_ERROR(
        loader.load("indexer.k_norm.weight", {di}, "index_head_dim", &staged.idx_k_norm));
    ATTNKIT_RETURN_IF_ERROR(
        loader.load("indexer.k_norm.bias", {di}, "index_head_dim", &staged.idx_k_norm_bias));
    ATTNKIT_RETURN_IF_ERROR(loader.load_matrix("indexer.weights_proj.weight", {hi, d},
                                               "index_n_heads, hidden_size",
                                               &staged.idx_weights_proj));
  }
  ATTNKIT_RETURN_IF_ERROR(loader.finish());
  // Non-finite indexer weights would make every score NaN and the
  // selection arbitrary: refuse them here, once.
  for (const auto& [name, t] :
       {std::pair<const char*, const Tensor*>{"indexer.wq_b.weight", &staged.idx_wq_b},
        {"indexer.wk.weight", &staged.idx_wk},
        {"indexer.k_norm.weight", &staged.idx_k_norm},
        {"indexer.k_norm.bias", &staged.idx_k_norm_bias},
        {"indexer.weights_proj.weight", &staged.idx_weights_proj}}) {
    if (!t->data()) continue;
    const int64_t n = t->view().numel();
    for (int64_t i = 0; i < n; ++i) {
      const float v = t->dtype() == DType::kBF16 ? bf16_to_float(t->view().ptr<const bf16>()[i])
                                                 : t->view().ptr<const float>()[i];
      if (!std::isfinite(v))
        return invalid_argument(std::string(kLoad) + ": " + std::string(prefix) + name +
                                " holds a non-finite value (" + std::to_string(v) + " at element " +
                                std::to_string(i) + ")");
    }
  }
  w_ = std::move(staged);
  loaded_ = true;
  return Status::Ok();
}

Result<TensorView> LatentAttention::weight(std::string_view name) const {
  const std::pair<const char*, const Tensor*> table[] = {
      {"q_a_proj.weight", &w_.q_a},
      {"q_a_layernorm.weight", &w_.q_a_norm},
      {"q_b_proj.weight", &w_.q_b},
      {"q_proj.weight", &w_.q},
      {"kv_a_proj_with_mqa.weight", &w_.kv_a},
      {"kv_a_layernorm.weight", &w_.kv_a_norm},
      {"kv_b_proj.weight", &w_.kv_b},
      {"o_proj.weight", &w_.o},
      {"indexer.wq_b.weight", &w_.idx_wq_b},
      {"indexer.wk.weight", &w_.idx_wk},
      {"indexer.k_norm.weight", &w_.idx_k_norm},
      {"indexer.k_norm.bias", &w_.idx_k_norm_bias},
      {"indexer.weights_proj.weight", &w_.idx_weights_proj}};
  for (const auto& [n, t] : table)
    if (name == n) {
      if (!loaded_ || !t->data())
        return not_found("LatentAttention::weight: " + std::string(name) +
                         (loaded_ ? " is not a weight of this configuration"
                                  : " is not loaded yet (call load_weights)"));
      return t->view();
    }
  return not_found("LatentAttention::weight: no weight named \"" + std::string(name) + "\"");
}

Result<LatentCache> LatentAttention::new_cache(int64_t batch_size, int64_t max_seq_len,
                                               DType dtype) const {
  const std::string f = kNewCache;
  if (batch_size < 1)
    return invalid_argument(f + ": batch_size = " + std::to_string(batch_size) + " must be >= 1");
  if (max_seq_len < 1)
    return invalid_argument(f + ": max_seq_len = " + std::to_string(max_seq_len) + " must be >= 1");
  if (dtype != DType::kF32 && dtype != DType::kBF16 && !is_kv_quantized(dtype))
    return invalid_argument(f + ": dtype = " + dtype_name(dtype) +
                            " must be f32, bf16, int8 or fp8_e4m3");
  const int64_t values = config_.cache_values_per_token();
  // Unpadded rows for f32 and bf16, as before; 8-bit rows with their scales.
  const KvRowLayout l = kv_row_layout(1, values, dtype, kLatentScaleBlock);
  const int64_t row = is_kv_quantized(dtype) ? l.row : values;
  Result<Tensor> storage = Tensor::zeros(dtype, {batch_size, max_seq_len, row});
  if (!storage.ok()) return Status(storage.status().code(), f + ": " + storage.status().message());
  LatentCache cache;
  cache.kv_lora_rank_ = config_.kv_lora_rank;
  cache.qk_rope_head_dim_ = config_.qk_rope_head_dim;
  cache.storage_ = std::move(storage).value();
  cache.view_ = make_view(cache.storage_.data(), dtype, {batch_size, max_seq_len, values});
  cache.view_.strides[1] = row;
  cache.view_.strides[0] = max_seq_len * row;
  if (is_kv_quantized(dtype)) {
    cache.scales_ = make_view(static_cast<char*>(cache.storage_.data()) + l.scale_offset,
                              DType::kF32, {batch_size, max_seq_len, l.scales_per_head});
    cache.scales_.strides[1] = row / 4;
    cache.scales_.strides[0] = max_seq_len * row / 4;
  }
  if (config_.sparse()) {
    // Codes [B, S, Di] bytes, then scales [B, S, Di / 128] f32.
    const int64_t di = config_.index_head_dim, ns = di / kIndexerBlock;
    const int64_t code_bytes = batch_size * max_seq_len * di;
    Result<Tensor> idx =
        Tensor::zeros(DType::kF32, {code_bytes / 4 + batch_size * max_seq_len * ns});
    if (!idx.ok()) return Status(idx.status().code(), f + ": " + idx.status().message());
    cache.index_storage_ = std::move(idx).value();
    char* base = static_cast<char*>(cache.index_storage_.data());
    cache.index_keys_ = make_view(base, DType::kFp8E4M3, {batch_size, max_seq_len, di});
    cache.index_scales_ = make_view(base + code_bytes, DType::kF32, {batch_size, max_seq_len, ns});
  }
  return cache;
}

size_t LatentCache::nbytes() const {
  const size_t values = static_cast<size_t>(view_.numel()) * dtype_size(view_.dtype);
  const size_t index = index_keys_.present() ? static_cast<size_t>(index_keys_.numel()) +
                                                   static_cast<size_t>(index_scales_.numel()) * 4
                                             : 0;
  return values + index +
         (scales_.present() ? static_cast<size_t>(scales_.numel()) * sizeof(float) : 0);
}

// Writes n values (x, `stride` apart) as row `t` of batch item b.
void LatentCache::write_row(int64_t b, int64_t t, const float* x, int64_t stride) {
  const int64_t n = values_per_token();
  const int64_t at = b * view_.strides[0] + t * view_.strides[1];
  if (is_kv_quantized(dtype())) {
    quantize_kv(x, stride, n, dtype(), kLatentScaleBlock, view_.ptr<uint8_t>() + at,
                scales_.ptr<float>() + b * scales_.strides[0] + t * scales_.strides[1]);
  } else if (dtype() == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) view_.ptr<bf16>()[at + i] = float_to_bf16(x[i * stride]);
  } else {
    for (int64_t i = 0; i < n; ++i) view_.ptr<float>()[at + i] = x[i * stride];
  }
}

Status LatentCache::append(const TensorView& rows) {
  constexpr const char* fn = "LatentCache::append";
  if (index_keys_.present())
    return invalid_argument(std::string(fn) +
                            ": this cache holds sparse attention's indexer keys, which the "
                            "latent rows do not determine; fill it with "
                            "LatentAttention::forward");
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "rows", rows, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "rows", rows, 0, "batch", batch_size(), "batch_size()"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "rows", rows, 2, "kv_lora_rank + qk_rope_head_dim",
                                     values_per_token(), "values_per_token()"));
  const int64_t T = rows.shape[1], L = length_;
  if (T > max_seq_len() - L)
    return out_of_range(std::string(fn) + ": cache overflow: length " + std::to_string(L) + " + " +
                        std::to_string(T) +
                        " new tokens > max_seq_len = " + std::to_string(max_seq_len()));
  if (check::overlaps(rows, storage_.view()))
    return invalid_argument(std::string(fn) + ": rows overlap the cache storage");
  for (int64_t b = 0; b < batch_size(); ++b)
    for (int64_t t = 0; t < T; ++t)
      write_row(b, L + t, rows.ptr<const float>() + b * rows.strides[0] + t * rows.strides[1],
                rows.strides[2]);
  length_ += T;
  return Status::Ok();
}

MlaForm LatentAttention::choose_form(int64_t new_tokens, int64_t cached_tokens) const {
  // Work both forms share cancels: the q/kv_a/o projections, and absorbing
  // T queries (W_UK^T, W_UV) costs exactly what decompressing T tokens does.
  // What differs, for T new queries over L cached tokens:
  //   naive:    decompress the L cached tokens again, L*H*(d_n+d_v)*d_c MACs,
  //             plus attention at d_qk + d_v MACs per (query, key, head);
  //   absorbed: attention at (d_c + d_r) + d_c MACs per (query, key, head).
  // So decode (T = 1, L > 0) is absorbed and prefill from empty (L = 0) is
  // naive; a chunked prefill over a long cache is absorbed until the chunk
  // is long enough (~430 tokens at DeepSeek-V3 shapes) that the 3.4x larger
  // attention outweighs re-decompressing the cache.
  const MlaConfig& c = config_;
  const double T = static_cast<double>(new_tokens), L = static_cast<double>(cached_tokens);
  const double pairs = T * L + T * (T + 1.0) / 2.0;  // causal (query, key) pairs
  const double H = static_cast<double>(c.num_attention_heads);
  const double decompress =
      L * H * static_cast<double>((c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank);
  const double naive = decompress + kAttentionMacCost * pairs * H *
                                        static_cast<double>(c.qk_head_dim() + c.v_head_dim);
  const double absorbed =
      kAttentionMacCost * pairs * H * static_cast<double>(2 * c.kv_lora_rank + c.qk_rope_head_dim);
  return naive <= absorbed ? MlaForm::kNaive : MlaForm::kAbsorbed;
}

Status LatentAttention::forward(const TensorView& x, const TensorView& out,
                                std::span<const int64_t> positions, LatentCache* cache,
                                const RunOptions& run, MlaForm form) {
  // ---- validation: nothing is written before all of it passes ----------
  const std::string f = kForward;
  if (!loaded_) return invalid_argument(f + ": no weights loaded (call load_weights first)");
  ATTNKIT_RETURN_IF_ERROR(check::view(kForward, "x", x, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kForward, "out", out, 3, {DType::kF32}));
  const MlaConfig& c = config_;
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForward, "x", x, 2, "hidden_size", c.hidden_size, "config().hidden_size"));
  const int64_t B = x.shape[0], T = x.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForward, "out", out, 0, "batch", B, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForward, "out", out, 1, "seq", T, "x.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForward, "out", out, 2, "hidden_size", c.hidden_size, "config().hidden_size"));
  if (!x.is_contiguous())
    return invalid_argument(f + ": x " + x.describe() + " must be contiguous (row-major)");
  if (!out.is_contiguous())
    return invalid_argument(f + ": out " + out.describe() + " must be contiguous (row-major)");
  if (check::overlaps(out, x)) return invalid_argument(f + ": out overlaps x");
  ATTNKIT_RETURN_IF_ERROR(check::run_options(kForward, run));
  if (form != MlaForm::kAuto && form != MlaForm::kNaive && form != MlaForm::kAbsorbed)
    return invalid_argument(f + ": form = " + std::to_string(static_cast<int>(form)) +
                            " is not an MlaForm value");
  int64_t rows;
  if (!checked_mul(B, T, &rows)) return invalid_argument(f + ": batch * seq overflows");
  const int64_t npos = static_cast<int64_t>(positions.size());
  ATTNKIT_RETURN_IF_ERROR(check::positions(kForward, positions, T, rows, true));
  const int64_t L = cache ? cache->length() : 0;
  if (cache) {
    if (cache->kv_lora_rank() != c.kv_lora_rank || cache->qk_rope_head_dim() != c.qk_rope_head_dim)
      return invalid_argument(f + ": cache holds kv_lora_rank + qk_rope_head_dim = " +
                              std::to_string(cache->kv_lora_rank()) + " + " +
                              std::to_string(cache->qk_rope_head_dim()) + ", this layer needs " +
                              std::to_string(c.kv_lora_rank) + " + " +
                              std::to_string(c.qk_rope_head_dim));
    if (cache->batch_size() != B)
      return invalid_argument(f + ": cache batch_size = " + std::to_string(cache->batch_size()) +
                              " must equal x.shape[0] (batch) = " + std::to_string(B));
    if (T > cache->max_seq_len() - L)
      return out_of_range(f + ": cache overflow: length " + std::to_string(L) + " + " +
                          std::to_string(T) +
                          " new tokens > max_seq_len = " + std::to_string(cache->max_seq_len()));
    if (check::overlaps(out, cache->storage()))
      return invalid_argument(f + ": out overlaps the cache storage");
  }
  if (rows == 0) return Status::Ok();

  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dqk = c.qk_head_dim(), dv = c.v_head_dim;
  const int64_t dkv = dc + dr;  // one latent row: [c ; k_rope]
  const int64_t S = L + T;      // keys the new queries attend over
  const MlaForm chosen = form == MlaForm::kAuto ? choose_form(T, L) : form;

  std::vector<int64_t> default_pos;
  if (npos == 0) {
    default_pos.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) default_pos[static_cast<size_t>(t)] = L + t;
    positions = default_pos;
  }

  // ---- scratch, all allocated before anything visible is written -------
  // Sizes are bounded by validated dims (<= 2^20 each) times the tokens.
  const auto n = [&](std::initializer_list<int64_t> dims, int64_t* out_n) {
    int64_t v = 1;
    for (int64_t e : dims)
      if (!checked_mul(v, e, &v)) return false;
    *out_n = v;
    return true;
  };
  Scratch cq, q, kv_new, o, lat, kvh, qa, oa;
  int64_t sz = 0;
  const auto need = [&](Scratch& s, std::initializer_list<int64_t> dims, const char* what) {
    if (!n(dims, &sz))
      return resource_exhausted(f + ": scratch size for " + what + " overflows 64 bits");
    return s.alloc(sz, what);
  };
  if (dq > 0) ATTNKIT_RETURN_IF_ERROR(need(cq, {rows, dq}, "c_q"));
  ATTNKIT_RETURN_IF_ERROR(need(q, {rows, H, dqk}, "q"));
  ATTNKIT_RETURN_IF_ERROR(need(kv_new, {rows, dkv}, "the new latent rows"));
  ATTNKIT_RETURN_IF_ERROR(need(o, {rows, H, dv}, "o"));
  // A bf16 or 8-bit cache's rows are widened (dequantized) to f32 for the
  // naive form's projections.
  const bool widen_cache = cache && cache->dtype() != DType::kF32;
  // Sparse attention: the indexer keys are computed for every call (later
  // calls select among them); the selection runs only when some query sees
  // more than index_topk keys, and then attention reads the selected keys
  // only (absorbed, or naive when the caller forces it).
  const int64_t hi = c.index_n_heads, di = c.index_head_dim, nsc = di / kIndexerBlock;
  const bool select = c.sparse() && S > c.index_topk;
  // A selecting call runs absorbed unless the caller asked for a form: the
  // naive form would do 3.4x fewer FLOPs per chosen pair in a prefill, but
  // with one query head per kv head the sparse kernel is bound by the
  // latency of scattered row loads and measured ~7x slower than dense on
  // a 2-vCPU Xeon (bench/dsa_prefill_bench --dsa-form naive, docs/MLA.md).
  const MlaForm used = select && form == MlaForm::kAuto ? MlaForm::kAbsorbed : chosen;
  Scratch ik, iq, iw, iq_scales, ik_own;
  std::unique_ptr<uint8_t[]> iq_codes, ik_codes;
  std::unique_ptr<int32_t[]> picked;
  if (c.sparse()) {
    ATTNKIT_RETURN_IF_ERROR(need(ik, {rows, di}, "indexer keys"));
    if (!cache) {
      ATTNKIT_RETURN_IF_ERROR(need(ik_own, {rows, nsc}, "indexer key scales"));
      ik_codes.reset(new (std::nothrow) uint8_t[static_cast<size_t>(rows * di)]);
      if (!ik_codes) return resource_exhausted(f + ": cannot allocate the indexer key codes");
    }
  }
  if (select) {
    ATTNKIT_RETURN_IF_ERROR(need(iq, {rows, hi, di}, "indexer queries"));
    ATTNKIT_RETURN_IF_ERROR(need(iq_scales, {rows, hi, nsc}, "indexer query scales"));
    ATTNKIT_RETURN_IF_ERROR(need(iw, {rows, hi}, "indexer head weights"));
    iq_codes.reset(new (std::nothrow) uint8_t[static_cast<size_t>(rows * hi * di)]);
    picked.reset(new (std::nothrow) int32_t[static_cast<size_t>(rows * c.index_topk)]);
    if (!iq_codes || !picked)
      return resource_exhausted(f + ": cannot allocate the indexer's codes and selection");
  }
  if (used == MlaForm::kNaive) {
    if (widen_cache) ATTNKIT_RETURN_IF_ERROR(need(lat, {B, S, dkv}, "the widened latent rows"));
    ATTNKIT_RETURN_IF_ERROR(need(kvh, {B, S, H, dqk + dv}, "decompressed K and V"));
  } else {
    ATTNKIT_RETURN_IF_ERROR(need(qa, {rows, H, dkv}, "absorbed queries"));
    ATTNKIT_RETURN_IF_ERROR(need(oa, {rows, H, dc}, "latent outputs"));
  }

  // ---- projections and RoPE ----------------------------------------------
  const kernels::LinearOptions lin{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = true};
  ATTNKIT_RETURN_IF_ERROR(project(x.ptr<const float>(), B, T, positions, run,
                                  /*gemv_for_one_row=*/true, cq.data(), q.data(), kv_new.data()));
  // Indexer keys of the new tokens: into the cache's rows [L, S) (beyond
  // its length, so not yet visible) or into this call's scratch.
  const uint8_t* idx_codes = nullptr;
  const float* idx_scales = nullptr;
  kernels::Strides3 idx_codes_st, idx_scales_st;
  if (c.sparse()) {
    if (cache) {
      const TensorView &kc = cache->index_keys(), &ks = cache->index_scales();
      ATTNKIT_RETURN_IF_ERROR(index_keys(x.ptr<const float>(), B, T, positions, run, ik.data(),
                                         kc.ptr<uint8_t>() + L * kc.strides[1], kc.strides[0],
                                         kc.strides[1], ks.ptr<float>() + L * ks.strides[1],
                                         ks.strides[0], ks.strides[1]));
      idx_codes = kc.ptr<const uint8_t>();
      idx_scales = ks.ptr<const float>();
      idx_codes_st = {kc.strides[0], kc.strides[1], 1};
      idx_scales_st = {ks.strides[0], ks.strides[1], 1};
    } else {
      ATTNKIT_RETURN_IF_ERROR(index_keys(x.ptr<const float>(), B, T, positions, run, ik.data(),
                                         ik_codes.get(), T * di, di, ik_own.data(), T * nsc, nsc));
      idx_codes = ik_codes.get();
      idx_scales = ik_own.data();
      idx_codes_st = {T * di, di, 1};
      idx_scales_st = {T * nsc, nsc, 1};
    }
  }
  if (select) {
    ATTNKIT_RETURN_IF_ERROR(index_queries(x.ptr<const float>(), cq.data(), B, T, positions, run,
                                          iq.data(), iq_codes.get(), iq_scales.data(), iw.data()));
    kernels::IndexerParams ip;
    ip.batch = B;
    ip.seqlen_q = T;
    ip.seqlen_k = S;
    ip.n_heads = hi;
    ip.head_dim = di;
    ip.q_codes = iq_codes.get();
    ip.q_codes_stride = {T * hi * di, hi * di, di, 1};
    ip.q_scales = iq_scales.data();
    ip.q_scales_stride = {T * hi * nsc, hi * nsc, nsc, 1};
    ip.weights = iw.data();
    ip.weights_stride = {T * hi, hi, 1};
    ip.k_codes = idx_codes;
    ip.k_codes_stride = idx_codes_st;
    ip.k_scales = idx_scales;
    ip.k_scales_stride = idx_scales_st;
    ip.topk = c.index_topk;
    ip.indices = picked.get();
    ip.indices_stride = {T * c.index_topk, c.index_topk, 1};
    ip.num_threads = run.num_threads;
    ATTNKIT_RETURN_IF_ERROR(kernels::run_indexer(ip, run.backend));
  }

  // ---- the latent rows the queries attend over --------------------------
  // Rows [L, S) of the cache are beyond its length, so writing them leaves
  // the cache's visible state unchanged until length advances at the end.
  const void* kv_rows = kv_new.data();  // [B, S, d_c + d_r]
  DType kv_dtype = DType::kF32;
  int64_t kv_batch_stride = T * dkv, kv_row_stride = dkv;
  if (cache) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        cache->write_row(b, L + t, kv_new.data() + (b * T + t) * dkv, 1);
    const TensorView& st = cache->storage();
    kv_rows = st.data;
    kv_dtype = st.dtype;
    kv_batch_stride = st.strides[0];
    kv_row_stride = st.strides[1];
  }

  kernels::AttentionParams prm;
  prm.batch = B;
  prm.seqlen_q = T;
  prm.seqlen_k = S;  // queries sit at S - T + i (bottom-right causal)
  prm.num_heads = H;
  prm.scale = static_cast<float>(softmax_scale_);
  prm.causal = true;
  prm.num_threads = run.num_threads;
  const kernels::Weight kv_b = kernels::weight_of(w_.kv_b);

  if (used == MlaForm::kNaive) {
    // Latent rows as f32, [B, S, d_c + d_r] with batch stride lat_bs.
    const float* latent = static_cast<const float*>(kv_rows);
    int64_t lat_bs = kv_batch_stride;
    if (widen_cache) {
      const TensorView &st = cache->storage(), &sc = cache->scales();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < S; ++t) {
          float* dst = lat.data() + (b * S + t) * dkv;
          const int64_t at = b * st.strides[0] + t * st.strides[1];
          if (kv_dtype == DType::kBF16) {
            for (int64_t i = 0; i < dkv; ++i) dst[i] = bf16_to_float(st.ptr<const bf16>()[at + i]);
            continue;
          }
          const float* scale = sc.ptr<const float>() + b * sc.strides[0] + t * sc.strides[1];
          for (int64_t i = 0; i < dkv; ++i)
            dst[i] = kv_code_value(kv_dtype, st.ptr<const uint8_t>()[at + i]) *
                     scale[i / kLatentScaleBlock];
        }
      latent = lat.data();
      lat_bs = S * dkv;
    }
    // kvh [B, S, H, d_qk + d_v], per head [k_nope (d_n) | k_rope (d_r) | v (d_v)].
    const int64_t wh = dqk + dv;
    for (int64_t b = 0; b < B; ++b) {
      const float* lb = latent + b * lat_bs;
      float* kb = kvh.data() + b * S * H * wh;
      for (int64_t h = 0; h < H; ++h) {
        const kernels::Weight w_uk = kv_b.at(h * (dn + dv) * dc);  // [d_n, d_c]
        const kernels::Weight w_uv = w_uk.at(dn * dc);             // [d_v, d_c]
        kernels::linear(lb, dkv, w_uk, nullptr, kb + h * wh, H * wh, S, dn, dc, lin);
        kernels::linear(lb, dkv, w_uv, nullptr, kb + h * wh + dqk, H * wh, S, dv, dc, lin);
      }
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(kb + (s * H + h) * wh + dn, lb + s * dkv + dc,
                      static_cast<size_t>(dr) * sizeof(float));
    }
    prm.num_kv_heads = H;
    prm.head_dim = dqk;
    prm.head_dim_v = dv;
    prm.q = q.data();
    prm.q_stride = strides4(T * H * dqk, H * dqk, dqk);
    prm.k = kvh.data();
    prm.k_stride = strides4(S * H * wh, H * wh, wh);
    prm.v = kvh.data() + dqk;
    prm.v_stride = prm.k_stride;
    prm.kv_dtype = DType::kF32;
    prm.out = o.data();
    prm.out_stride = strides4(T * H * dv, H * dv, dv);
    if (select) {
      const kernels::KeyIndices sel{
          picked.get(), {T * c.index_topk, c.index_topk, 1}, c.index_topk};
      ATTNKIT_RETURN_IF_ERROR(kernels::run_sparse_attention(prm, sel, run.backend));
    } else {
      ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(prm, run.backend));
    }
  } else {
    absorb_queries(q.data(), rows, qa.data(), run);
    // One kv head: key = the whole latent row, value = its first d_c values.
    prm.num_kv_heads = 1;
    prm.head_dim = dkv;
    prm.head_dim_v = dc;
    prm.q = qa.data();
    prm.q_stride = strides4(T * H * dkv, H * dkv, dkv);
    prm.k = kv_rows;
    prm.k_stride = strides4(kv_batch_stride, kv_row_stride, dkv);
    prm.v = kv_rows;
    prm.v_stride = prm.k_stride;
    prm.kv_dtype = kv_dtype;
    if (is_kv_quantized(kv_dtype)) {  // values share the keys' rows, hence their scales
      const TensorView& sc = cache->scales();
      prm.k_scale = prm.v_scale = sc.ptr<const float>();
      prm.k_scale_stride = prm.v_scale_stride = strides4(sc.strides[0], sc.strides[1], 0);
      prm.scale_block = kLatentScaleBlock;
    }
    prm.out = oa.data();
    prm.out_stride = strides4(T * H * dc, H * dc, dc);
    if (select) {
      const kernels::KeyIndices sel{
          picked.get(), {T * c.index_topk, c.index_topk, 1}, c.index_topk};
      ATTNKIT_RETURN_IF_ERROR(kernels::run_sparse_attention(prm, sel, run.backend));
    } else {
      ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(prm, run.backend));
    }
    expand_values(oa.data(), rows, o.data(), run, /*gemv_for_one_row=*/true);
  }

  kernels::linear(o.data(), H * dv, kernels::weight_of(w_.o), nullptr, out.ptr<float>(), d, rows, d,
                  H * dv, lin);
  if (cache) cache->length_ += T;
  return Status::Ok();
}

Status LatentAttention::project(const float* x, int64_t B, int64_t T,
                                std::span<const int64_t> positions, const RunOptions& run,
                                bool gemv_for_one_row, float* cq, float* q, float* kv_new) const {
  const MlaConfig& c = config_;
  const int64_t rows = B * T, H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dqk = c.qk_head_dim(), dkv = dc + dr;
  const kernels::LinearOptions lin{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = gemv_for_one_row};
  if (dq > 0) {
    kernels::linear(x, d, kernels::weight_of(w_.q_a), nullptr, cq, dq, rows, dq, d, lin);
    kernels::rms_norm(cq, dq, w_.q_a_norm.ptr<float>(), cq, dq, rows, dq, c.rms_norm_eps);
    kernels::linear(cq, dq, kernels::weight_of(w_.q_b), nullptr, q, H * dqk, rows, H * dqk, dq,
                    lin);
  } else {
    kernels::linear(x, d, kernels::weight_of(w_.q), nullptr, q, H * dqk, rows, H * dqk, d, lin);
  }
  kernels::linear(x, d, kernels::weight_of(w_.kv_a), nullptr, kv_new, dkv, rows, dkv, d, lin);
  // RMSNorm on the latent only; the rope key is not normalised.
  kernels::rms_norm(kv_new, dkv, w_.kv_a_norm.ptr<float>(), kv_new, dkv, rows, dc, c.rms_norm_eps);

  // RoPE on the rope part of each query head and on the shared key.
  TensorView q_rope;  // [B, T, H, d_r] inside q
  q_rope.data = q + dn;
  q_rope.rank = 4;
  q_rope.shape = {B, T, H, dr};
  q_rope.strides = {T * H * dqk, H * dqk, dqk, 1};
  TensorView k_rope;  // [B, T, 1, d_r] inside the new latent rows
  k_rope.data = kv_new + dc;
  k_rope.rank = 4;
  k_rope.shape = {B, T, 1, dr};
  k_rope.strides = {T * dkv, dkv, dkv, 1};
  ATTNKIT_RETURN_IF_ERROR(rope_.apply(q_rope, positions));
  return rope_.apply(k_rope, positions);
}

Status LatentAttention::index_keys(const float* x, int64_t B, int64_t T,
                                   std::span<const int64_t> positions, const RunOptions& run,
                                   float* ik, uint8_t* codes, int64_t codes_bs, int64_t codes_rs,
                                   float* scales, int64_t scales_bs, int64_t scales_rs,
                                   bool gemv_for_one_row) const {
  const MlaConfig& c = config_;
  const int64_t rows = B * T, d = c.hidden_size, di = c.index_head_dim, dr = c.qk_rope_head_dim;
  const kernels::LinearOptions lin{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = gemv_for_one_row};
  kernels::linear(x, d, kernels::weight_of(w_.idx_wk), nullptr, ik, di, rows, di, d, lin);
  // LayerNorm with gain and bias (DeepSeek's eps 1e-6), in double per row.
  const float* gain = w_.idx_k_norm.ptr<float>();
  const float* bias = w_.idx_k_norm_bias.ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* v = ik + r * di;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < di; ++i) mean += v[i];
    mean /= static_cast<double>(di);
    for (int64_t i = 0; i < di; ++i) var += (v[i] - mean) * (v[i] - mean);
    const double inv = 1.0 / std::sqrt(var / static_cast<double>(di) + 1e-6);
    for (int64_t i = 0; i < di; ++i)
      v[i] = static_cast<float>((v[i] - mean) * inv * gain[i] + bias[i]);
  }
  TensorView rot;  // [B, T, 1, d_r]: the first d_r features of each key
  rot.data = ik;
  rot.rank = 4;
  rot.shape = {B, T, 1, dr};
  rot.strides = {T * di, di, di, 1};
  ATTNKIT_RETURN_IF_ERROR(index_rope_.apply(rot, positions));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* v = ik + (b * T + t) * di;
      kernels::hadamard_inplace(v, di);
      kernels::indexer_quantize_row(v, 1, di, c.index_scale_ue8m0,
                                    codes + b * codes_bs + t * codes_rs,
                                    scales + b * scales_bs + t * scales_rs);
    }
  return Status::Ok();
}

Status LatentAttention::index_queries(const float* x, const float* cq, int64_t B, int64_t T,
                                      std::span<const int64_t> positions, const RunOptions& run,
                                      float* iq, uint8_t* codes, float* scales, float* w,
                                      bool gemv_for_one_row) const {
  const MlaConfig& c = config_;
  const int64_t rows = B * T, d = c.hidden_size, dq = c.q_lora_rank, hi = c.index_n_heads,
                di = c.index_head_dim, dr = c.qk_rope_head_dim, nsc = di / kIndexerBlock;
  const kernels::LinearOptions lin{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = gemv_for_one_row};
  kernels::linear(cq, dq, kernels::weight_of(w_.idx_wq_b), nullptr, iq, hi * di, rows, hi * di, dq,
                  lin);
  TensorView rot;  // [B, T, Hi, d_r]: the first d_r features of each head
  rot.data = iq;
  rot.rank = 4;
  rot.shape = {B, T, hi, dr};
  rot.strides = {T * hi * di, hi * di, di, 1};
  ATTNKIT_RETURN_IF_ERROR(index_rope_.apply(rot, positions));
  for (int64_t r = 0; r < rows * hi; ++r) {
    kernels::hadamard_inplace(iq + r * di, di);
    kernels::indexer_quantize_row(iq + r * di, 1, di, c.index_scale_ue8m0, codes + r * di,
                                  scales + r * nsc);
  }
  // w_t,h = weights_proj(x)_h * Hi^-1/2 * Di^-1/2 (the indexer's softmax
  // scale); the query's fp8 scale stays with its codes.
  kernels::linear(x, d, kernels::weight_of(w_.idx_weights_proj), nullptr, w, hi, rows, hi, d, lin);
  const float factor = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hi * di)));
  for (int64_t i = 0; i < rows * hi; ++i) w[i] *= factor;
  return Status::Ok();
}

// qa[r, h] = [W_UK_h^T q_nope[r, h] ; q_rope[r, h]]: one GEMM per head
// against kv_b_proj's rows as stored, the heads spread over the threads.
void LatentAttention::absorb_queries(const float* q, int64_t rows, float* qa,
                                     const RunOptions& run) const {
  const MlaConfig& c = config_;
  const int64_t H = c.num_attention_heads, dc = c.kv_lora_rank, dn = c.qk_nope_head_dim,
                dr = c.qk_rope_head_dim, dv = c.v_head_dim, dqk = c.qk_head_dim(), dkv = dc + dr;
  const kernels::Weight kv_b = kernels::weight_of(w_.kv_b);
  parallel_for(H, resolve_num_threads(run.num_threads), [&](int64_t h, int) {
    const kernels::Weight w_uk = kv_b.at(h * (dn + dv) * dc);  // [d_n, d_c]
    kernels::linear_nn(q + h * dqk, H * dqk, w_uk, dc, qa + h * dkv, H * dkv, rows, dc, dn,
                       run.backend);
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(qa + (r * H + h) * dkv + dc, q + (r * H + h) * dqk + dn,
                  static_cast<size_t>(dr) * sizeof(float));
}

// o[r, h] = W_UV_h oa[r, h].
void LatentAttention::expand_values(const float* oa, int64_t rows, float* o, const RunOptions& run,
                                    bool gemv_for_one_row) const {
  const MlaConfig& c = config_;
  const int64_t H = c.num_attention_heads, dc = c.kv_lora_rank, dn = c.qk_nope_head_dim,
                dv = c.v_head_dim;
  const kernels::LinearOptions lin{
      .num_threads = run.num_threads, .backend = run.backend, .gemv_for_one_row = gemv_for_one_row};
  const kernels::Weight kv_b = kernels::weight_of(w_.kv_b);
  for (int64_t h = 0; h < H; ++h) {
    const kernels::Weight w_uv = kv_b.at((h * (dn + dv) + dn) * dc);  // [d_v, d_c]
    kernels::linear(oa + h * dc, H * dc, w_uv, nullptr, o + h * dv, H * dv, rows, dv, dc, lin);
  }
}

Result<PagedKVCache> LatentAttention::new_paged_cache(int64_t num_pages, int64_t page_size,
                                                      int64_t num_layers, DType dtype) const {
  PagedKVCacheSpec spec;
  spec.index_head_dim = config_.sparse() ? config_.index_head_dim : 0;
  spec.num_layers = num_layers;
  spec.num_pages = num_pages;
  spec.page_size = page_size;
  spec.kv_lora_rank = config_.kv_lora_rank;
  spec.qk_rope_head_dim = config_.qk_rope_head_dim;
  spec.dtype = dtype;
  auto pool = PagedKVCache::create(spec);
  if (!pool.ok()) return check::prefixed(kNewPagedCache, pool.status());
  return pool;
}

Status LatentAttention::forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                                      std::span<const int64_t> seq_ids, PagedKVCache& cache,
                                      int64_t layer_index, const TensorView& out,
                                      const RunOptions& run) {
  // ---- validation: nothing is written before all of it passes ----------
  const std::string f = kForwardBatch;
  const MlaConfig& c = config_;
  if (!loaded_) return invalid_argument(f + ": no weights loaded (call load_weights first)");
  ATTNKIT_RETURN_IF_ERROR(check::view(kForwardBatch, "x", x, 2, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kForwardBatch, "out", out, 2, {DType::kF32}));
  const int64_t total = x.shape[0];
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForwardBatch, "x", x, 1, "hidden_size", c.hidden_size, "config().hidden_size"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kForwardBatch, "out", out, 0, "total_tokens", total, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kForwardBatch, "out", out, 1, "hidden_size", c.hidden_size,
                                     "config().hidden_size"));
  if (!x.is_contiguous())
    return invalid_argument(f + ": x " + x.describe() + " must be contiguous (row-major)");
  if (!out.is_contiguous())
    return invalid_argument(f + ": out " + out.describe() + " must be contiguous (row-major)");
  if (check::overlaps(out, x)) return invalid_argument(f + ": out overlaps x");
  ATTNKIT_RETURN_IF_ERROR(check::run_options(kForwardBatch, run));
  const PagedKVCacheSpec& s = cache.spec();
  if (s.kv_lora_rank != c.kv_lora_rank || s.qk_rope_head_dim != c.qk_rope_head_dim)
    return invalid_argument(
        f + ": cache spec kv_lora_rank + qk_rope_head_dim = " + std::to_string(s.kv_lora_rank) +
        " + " + std::to_string(s.qk_rope_head_dim) + ", this layer needs " +
        std::to_string(c.kv_lora_rank) + " + " + std::to_string(c.qk_rope_head_dim) +
        " (the latent layout)");
  if (s.sliding_window != 0)
    return invalid_argument(f + ": cache spec.sliding_window = " +
                            std::to_string(s.sliding_window) + " must be 0 (MLA has no window)");
  if (c.sparse() && s.index_head_dim != c.index_head_dim)
    return invalid_argument(f +
                            ": cache spec.index_head_dim = " + std::to_string(s.index_head_dim) +
                            " must equal index_head_dim = " + std::to_string(c.index_head_dim) +
                            " (sparse attention stores its indexer keys in the pool; make the "
                            "pool with new_paged_cache)");
  ATTNKIT_ASSIGN_OR_RETURN(
      std::vector<int64_t> positions,
      paged_positions(kForwardBatch, cu_seqlens_q, seq_ids, cache, layer_index, total));
  if (total == 0) return Status::Ok();

  // ---- the absorbed form over the pool's latent pages ------------------
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dq = c.q_lora_rank,
                dc = c.kv_lora_rank, dr = c.qk_rope_head_dim, dqk = c.qk_head_dim(),
                dv = c.v_head_dim, dkv = dc + dr;
  Scratch cq, q, kv_new, qa, oa, o;
  if (dq > 0) ATTNKIT_RETURN_IF_ERROR(cq.alloc(total * dq, "c_q"));
  ATTNKIT_RETURN_IF_ERROR(q.alloc(total * H * dqk, "q"));
  ATTNKIT_RETURN_IF_ERROR(kv_new.alloc(total * dkv, "the new latent rows"));
  ATTNKIT_RETURN_IF_ERROR(qa.alloc(total * H * dkv, "absorbed queries"));
  ATTNKIT_RETURN_IF_ERROR(oa.alloc(total * H * dc, "latent outputs"));
  ATTNKIT_RETURN_IF_ERROR(o.alloc(total * H * dv, "o"));
  // No one-row GEMV: a row's result must not depend on the rows beside it.
  ATTNKIT_RETURN_IF_ERROR(project(x.ptr<const float>(), 1, total, positions, run,
                                  /*gemv_for_one_row=*/false, cq.data(), q.data(), kv_new.data()));
  absorb_queries(q.data(), total, qa.data(), run);
  bool attended = false;
  if (c.sparse())
    ATTNKIT_RETURN_IF_ERROR(attend_paged_sparse(
        x.ptr<const float>(), cq.data(), positions, cu_seqlens_q, seq_ids, cache, layer_index,
        qa.data(), kv_new.data(), oa.data(), run, &attended));
  if (!attended) {
    AttentionOptions opt;
    opt.softmax_scale = static_cast<float>(softmax_scale_);
    opt.backend = run.backend;
    opt.num_threads = run.num_threads;
    Status st =
        cache.attend(layer_index, make_view(qa.data(), DType::kF32, {total, H, dkv}),
                     make_view(kv_new.data(), DType::kF32, {total, 1, dkv}), TensorView{},
                     cu_seqlens_q, seq_ids, make_view(oa.data(), DType::kF32, {total, H, dc}), opt);
    if (!st.ok()) return Status(st.code(), f + ": " + st.message());
  }
  expand_values(oa.data(), total, o.data(), run, /*gemv_for_one_row=*/false);
  const kernels::LinearOptions lin{.num_threads = run.num_threads, .backend = run.backend};
  kernels::linear(o.data(), H * dv, kernels::weight_of(w_.o), nullptr, out.ptr<float>(), d, total,
                  d, H * dv, lin);
  return Status::Ok();
}

Status LatentAttention::attend_paged_sparse(const float* x, const float* cq,
                                            std::span<const int64_t> positions,
                                            std::span<const int32_t> cu_seqlens_q,
                                            std::span<const int64_t> seq_ids, PagedKVCache& cache,
                                            int64_t layer, const float* qa, const float* kv_new,
                                            float* oa, const RunOptions& run,
                                            bool* attended) const {
  const std::string f = kForwardBatch;
  const MlaConfig& c = config_;
  const int64_t n = static_cast<int64_t>(seq_ids.size()), total = cu_seqlens_q[seq_ids.size()];
  const int64_t H = c.num_attention_heads, dc = c.kv_lora_rank, dkv = dc + c.qk_rope_head_dim;
  const int64_t hi = c.index_n_heads, di = c.index_head_dim, nsc = di / kIndexerBlock,
                topk = c.index_topk, ps = cache.spec().page_size;
  // Per sequence: its new rows, its length once they are in, its pages.
  std::vector<int32_t> rows(static_cast<size_t>(n)), len(static_cast<size_t>(n));
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(n));
  int64_t max_rows = 0, max_len = 0, max_pages = 0;
  bool select = false;
  for (int64_t s = 0; s < n; ++s) {
    const size_t si = static_cast<size_t>(s);
    ATTNKIT_ASSIGN_OR_RETURN(tables[si], cache.page_table(seq_ids[si]));
    rows[si] = cu_seqlens_q[si + 1] - cu_seqlens_q[si];
    len[si] =
        rows[si] > 0
            ? static_cast<int32_t>(positions[static_cast<size_t>(cu_seqlens_q[si + 1] - 1)] + 1)
            : 0;
    max_rows = std::max<int64_t>(max_rows, rows[si]);
    max_len = std::max<int64_t>(max_len, len[si]);
    max_pages = std::max<int64_t>(max_pages, static_cast<int64_t>(tables[si].size()));
    select = select || len[si] > topk;
  }
  // The slot (pool row) of token `pos` of sequence s.
  const auto slot = [&](int64_t s, int64_t pos) {
    return static_cast<int64_t>(tables[static_cast<size_t>(s)][static_cast<size_t>(pos / ps)]) *
               ps +
           pos % ps;
  };

  // ---- scratch, all of it before anything is written ---------------------
  Scratch ik, new_scales, iq, iq_scales, iw, gathered_scales;
  ATTNKIT_RETURN_IF_ERROR(ik.alloc(total * di, "indexer keys"));
  ATTNKIT_RETURN_IF_ERROR(new_scales.alloc(total * nsc, "indexer key scales"));
  std::unique_ptr<uint8_t[]> new_codes(new (std::nothrow) uint8_t[static_cast<size_t>(total * di)]);
  std::unique_ptr<uint8_t[]> iq_codes;
  // On a 64-byte line, as LatentCache holds its keys: the AMX indexer reads
  // each key's 128 codes in two 64-byte loads, which a row that straddled
  // lines would split (up to 1.2x its time on one thread).
  std::unique_ptr<uint8_t[], FreeAligned> gathered_codes;
  std::unique_ptr<int32_t[]> picked, table;
  if (!new_codes) return resource_exhausted(f + ": cannot allocate the indexer key codes");
  if (select) {
    ATTNKIT_RETURN_IF_ERROR(iq.alloc(total * hi * di, "indexer queries"));
    ATTNKIT_RETURN_IF_ERROR(iq_scales.alloc(total * hi * nsc, "indexer query scales"));
    ATTNKIT_RETURN_IF_ERROR(iw.alloc(total * hi, "indexer head weights"));
    ATTNKIT_RETURN_IF_ERROR(gathered_scales.alloc(max_len * nsc, "gathered indexer key scales"));
    iq_codes.reset(new (std::nothrow) uint8_t[static_cast<size_t>(total * hi * di)]);
    // di is a multiple of 128, so the size is one of the alignment.
    gathered_codes.reset(
        static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(max_len * di))));
    picked.reset(new (std::nothrow) int32_t[static_cast<size_t>(n * max_rows * topk)]);
    table.reset(new (std::nothrow) int32_t[static_cast<size_t>(n * max_pages)]);
    if (!iq_codes || !gathered_codes || !picked || !table)
      return resource_exhausted(f + ": cannot allocate the indexer's codes and selection");
  }

  // ---- the new tokens' indexer keys, into their slots ---------------------
  // Slots of reserved, unwritten tokens: nothing visible changes yet.
  ATTNKIT_RETURN_IF_ERROR(index_keys(x, 1, total, positions, run, ik.data(), new_codes.get(),
                                     total * di, di, new_scales.data(), total * nsc, nsc,
                                     /*gemv_for_one_row=*/false));
  ATTNKIT_ASSIGN_OR_RETURN(const TensorView pool_codes, cache.index_keys(layer));
  ATTNKIT_ASSIGN_OR_RETURN(const TensorView pool_scales, cache.index_scales(layer));
  for (int64_t s = 0; s < n; ++s)
    for (int64_t i = 0; i < rows[static_cast<size_t>(s)]; ++i) {
      const int64_t r = cu_seqlens_q[static_cast<size_t>(s)] + i, at = slot(s, positions[r]);
      std::memcpy(pool_codes.ptr<uint8_t>() + at * di, new_codes.get() + r * di,
                  static_cast<size_t>(di));
      std::memcpy(pool_scales.ptr<float>() + at * nsc, new_scales.data() + r * nsc,
                  static_cast<size_t>(nsc) * sizeof(float));
    }
  *attended = false;
  if (!select) return Status::Ok();

  // ---- each sequence's selection: the indexer over its gathered keys ------
  ATTNKIT_RETURN_IF_ERROR(index_queries(x, cq, 1, total, positions, run, iq.data(), iq_codes.get(),
                                        iq_scales.data(), iw.data(), /*gemv_for_one_row=*/false));
  for (int64_t s = 0; s < n; ++s) {
    const size_t si = static_cast<size_t>(s);
    if (rows[si] == 0) continue;
    for (int64_t t = 0; t < len[si]; ++t) {
      const int64_t at = slot(s, t);
      std::memcpy(gathered_codes.get() + t * di, pool_codes.ptr<const uint8_t>() + at * di,
                  static_cast<size_t>(di));
      std::memcpy(gathered_scales.data() + t * nsc, pool_scales.ptr<const float>() + at * nsc,
                  static_cast<size_t>(nsc) * sizeof(float));
    }
    const int64_t r0 = cu_seqlens_q[si];
    kernels::IndexerParams ip;
    ip.batch = 1;
    ip.seqlen_q = rows[si];
    ip.seqlen_k = len[si];
    ip.n_heads = hi;
    ip.head_dim = di;
    ip.q_codes = iq_codes.get() + r0 * hi * di;
    ip.q_codes_stride = {0, hi * di, di, 1};
    ip.q_scales = iq_scales.data() + r0 * hi * nsc;
    ip.q_scales_stride = {0, hi * nsc, nsc, 1};
    ip.weights = iw.data() + r0 * hi;
    ip.weights_stride = {0, hi, 1};
    ip.k_codes = gathered_codes.get();
    ip.k_codes_stride = {0, di, 1};
    ip.k_scales = gathered_scales.data();
    ip.k_scales_stride = {0, nsc, 1};
    ip.topk = topk;
    ip.indices = picked.get() + s * max_rows * topk;
    ip.indices_stride = {0, topk, 1};
    ip.num_threads = run.num_threads;
    ATTNKIT_RETURN_IF_ERROR(kernels::run_indexer(ip, run.backend));
  }

  // ---- the new latent rows, then attention over the chosen rows in place --
  Status st = cache.store(layer, make_view(kv_new, DType::kF32, {total, 1, dkv}), TensorView{},
                          cu_seqlens_q, seq_ids);
  if (!st.ok()) return Status(st.code(), f + ": " + st.message());
  for (int64_t s = 0; s < n; ++s) {
    const std::vector<int32_t>& t = tables[static_cast<size_t>(s)];
    std::copy(t.begin(), t.end(), table.get() + s * max_pages);
  }
  ATTNKIT_ASSIGN_OR_RETURN(const TensorView keys, cache.keys(layer));
  kernels::AttentionParams prm;
  prm.batch = n;
  prm.seqlen_q = max_rows;
  prm.seqlen_k = max_len;
  prm.num_heads = H;
  prm.num_kv_heads = 1;  // key = the whole latent row, value = its first d_c values
  prm.head_dim = dkv;
  prm.head_dim_v = dc;
  prm.q = qa;
  prm.q_stride = strides4(0, H * dkv, dkv);
  prm.q_start = cu_seqlens_q.data();
  prm.q_len = rows.data();
  prm.k_len = len.data();
  prm.k = prm.v = keys.data;
  prm.k_stride = prm.v_stride = strides4(0, keys.strides[0], keys.strides[1]);
  prm.kv_dtype = keys.dtype;
  if (is_kv_quantized(keys.dtype)) {  // values share the keys' rows, hence their scales
    ATTNKIT_ASSIGN_OR_RETURN(const TensorView sc, cache.key_scales(layer));
    prm.k_scale = prm.v_scale = sc.ptr<const float>();
    prm.k_scale_stride = prm.v_scale_stride = {0, sc.strides[0], sc.strides[1], sc.strides[2]};
    prm.scale_block = kLatentScaleBlock;
  }
  prm.block_table = table.get();
  prm.block_table_stride = max_pages;
  prm.page_size = ps;
  prm.out = oa;
  prm.out_stride = strides4(0, H * dc, dc);
  prm.scale = static_cast<float>(softmax_scale_);
  prm.causal = true;
  prm.num_threads = run.num_threads;
  const kernels::KeyIndices sel{picked.get(), {max_rows * topk, topk, 1}, topk};
  ATTNKIT_RETURN_IF_ERROR(kernels::run_sparse_attention(prm, sel, run.backend));
  *attended = true;
  return Status::Ok();
}

}  // namespace attnkit
