// KVCache: validate, append the new tokens, dispatch attention over the
// cache storage. The cache owns its scratch (kernels never allocate), and
// every allocation and check happens before the first byte is written, so a
// failed call leaves the cache (contents and length) and `out` untouched.
//
// Without a window the new rows are written first and one kernel call reads
// keys [0, length + T) straight from the storage. With a window W the ring
// holds only the W-1 newest tokens, so the new chunk cannot simply be
// appended before attending (it could overwrite tokens that its own first
// queries still see). Instead two partial attentions over disjoint key sets
// are merged by their log-sum-exp:
//   A: the T queries over the held ring tokens (oldest -> newest),
//   B: the T queries over the new chunk itself,
// and only then are the newest min(T, slots) tokens written into the ring.
//
// With chunks of C tokens (chunked local attention) token t lives in slot
// t mod C, so the current chunk's tokens fill slots [0, length mod C) in
// order and the slots after them hold only older chunks' tokens, which no
// query will see again. The new tokens that continue the current chunk are
// written there first and attend with one call over slots [0, ...); those
// that start later chunks (which see only new tokens) attend the new tokens
// themselves, with the chunk rule, and are written into the ring only after
// every call succeeded, since they overwrite the current chunk's slots.
#include "attnkit/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/check.h"
#include "core/checked_math.h"
#include "kernels/dispatch.h"
#include "ops/attention_checks.h"
#include "ops/kv_quant.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "KVCache::create";
constexpr const char* kAttend = "KVCache::attend";

kernels::Strides4 strides_of(const TensorView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.strides[3]};
}

// K or V storage: the [batch, rows, heads, dim] view of the values and,
// for the 8-bit types, the [batch, rows, heads, 1] view of their scales.
struct Rows {
  TensorView data, scales;
};

// Copies token `t` of src [batch, T, heads, dim] (any strides) into row
// `row` of dst. f32 -> bf16 rounds to nearest even; f32 -> 8-bit quantizes
// (ops/kv_quant.h); bf16 -> bf16 and 8-bit -> 8-bit (codes and scales of
// the same type) are exact.
void store_token(const Rows& src, int64_t t, const Rows& dst, int64_t row) {
  const TensorView &in = src.data, &out = dst.data;
  const int64_t batch = in.shape[0], heads = in.shape[2], dim = in.shape[3];
  if (is_kv_quantized(out.dtype)) {
    const TensorView &ss = src.scales, &ds = dst.scales;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h) {
        uint8_t* codes =
            out.ptr<uint8_t>() + b * out.strides[0] + row * out.strides[1] + h * out.strides[2];
        float* scale =
            ds.ptr<float>() + b * ds.strides[0] + row * ds.strides[1] + h * ds.strides[2];
        const int64_t s0 = b * in.strides[0] + t * in.strides[1] + h * in.strides[2];
        if (in.dtype == out.dtype) {
          for (int64_t d = 0; d < dim; ++d)
            codes[d] = in.ptr<const uint8_t>()[s0 + d * in.strides[3]];
          *scale = ss.ptr<const float>()[b * ss.strides[0] + t * ss.strides[1] + h * ss.strides[2]];
        } else {
          quantize_kv(in.ptr<const float>() + s0, in.strides[3], dim, out.dtype, 0, codes, scale);
        }
      }
    return;
  }
  const TensorView &src_v = in, &dst_v = out;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t s0 = b * src_v.strides[0] + t * src_v.strides[1] + h * src_v.strides[2];
      const int64_t d0 = b * dst_v.strides[0] + row * dst_v.strides[1] + h * dst_v.strides[2];
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t si = s0 + d * src_v.strides[3], di = d0 + d * dst_v.strides[3];
        if (src_v.dtype == DType::kBF16)
          dst_v.ptr<bf16>()[di] = src_v.ptr<const bf16>()[si];  // dst is then bf16 too
        else if (dst_v.dtype == DType::kBF16)
          dst_v.ptr<bf16>()[di] = float_to_bf16(src_v.ptr<const float>()[si]);
        else
          dst_v.ptr<float>()[di] = src_v.ptr<const float>()[si];
      }
    }
}

// Fields shared by every kernel call of one attend(): shapes, q, scale,
// softcap, sparse pattern, threads. The caller sets k/v, keys and masks.
kernels::AttentionParams base_params(const TensorView& q, int64_t num_kv_heads, int64_t head_dim_v,
                                     const AttentionOptions& options) {
  kernels::AttentionParams prm;
  prm.batch = q.shape[0];
  prm.seqlen_q = q.shape[1];
  prm.num_heads = q.shape[2];
  prm.num_kv_heads = num_kv_heads;
  prm.head_dim = q.shape[3];
  prm.head_dim_v = head_dim_v;
  prm.q = q.ptr<const float>();
  prm.q_stride = strides_of(q);
  prm.scale = options.softmax_scale > 0.0f
                  ? options.softmax_scale
                  : static_cast<float>(1.0 / std::sqrt(static_cast<double>(prm.head_dim)));
  prm.softcap = options.softcap;
  prm.causal = true;
  prm.sparse = options.sparse;
  prm.num_threads = options.num_threads;
  if (options.sinks.present()) {
    prm.sinks = options.sinks.ptr<const float>();
    prm.sinks_stride = options.sinks.strides[0];
  }
  return prm;
}

void set_out(const TensorView& out, const TensorView& lse, kernels::AttentionParams* prm) {
  prm->out = out.ptr<float>();
  prm->out_stride = strides_of(out);
  if (lse.present()) {
    prm->lse = lse.ptr<float>();
    prm->lse_stride_batch = lse.strides[0];
    prm->lse_stride_head = lse.strides[1];
    prm->lse_stride_row = lse.strides[2];
  }
}

// Storage [batch, slots, stride] (zeroed) and the views of its rows.
Status make_storage(DType dtype, int64_t batch, int64_t slots, int64_t heads, int64_t dim,
                    Tensor* storage, Rows* rows) {
  const int64_t stride = kv_token_stride(heads, dim, dtype);
  if (stride == 0) return resource_exhausted("element count overflows 64 bits");
  auto t = Tensor::zeros(dtype, {batch, slots, stride});
  if (!t.ok()) return t.status();
  *storage = std::move(t).value();
  rows->data = kv_cache_view(storage->data(), dtype, batch, slots, heads, dim);
  rows->scales = kv_cache_scales_view(storage->data(), dtype, batch, slots, heads, dim);
  return Status::Ok();
}

// Points prm's K (V) and its scales at `rows`.
void set_kv(const Rows& k, const Rows& v, kernels::AttentionParams* prm) {
  prm->k = k.data.data;
  prm->k_stride = strides_of(k.data);
  prm->v = v.data.data;
  prm->v_stride = strides_of(v.data);
  prm->kv_dtype = k.data.dtype;
  if (k.scales.present()) {
    prm->k_scale = k.scales.ptr<const float>();
    prm->k_scale_stride = strides_of(k.scales);
    prm->v_scale = v.scales.ptr<const float>();
    prm->v_scale_stride = strides_of(v.scales);
  }
}

}  // namespace

int64_t kv_token_stride(int64_t num_kv_heads, int64_t dim, DType dtype) {
  return kv_row_layout(num_kv_heads, dim, dtype).row;
}

TensorView kv_cache_scales_view(void* data, DType dtype, int64_t batch, int64_t tokens,
                                int64_t num_kv_heads, int64_t dim) {
  if (!is_kv_quantized(dtype)) return {};
  const KvRowLayout l = kv_row_layout(num_kv_heads, dim, dtype);
  TensorView v = make_view(static_cast<char*>(data) + l.scale_offset, DType::kF32,
                           {batch, tokens, num_kv_heads, 1});
  v.strides[1] = l.row / 4;
  v.strides[0] = tokens * v.strides[1];
  return v;
}

TensorView kv_cache_view(void* data, DType dtype, int64_t batch, int64_t tokens,
                         int64_t num_kv_heads, int64_t dim) {
  const int64_t stride = kv_token_stride(num_kv_heads, dim, dtype);
  TensorView v = make_view(data, dtype, {batch, tokens, num_kv_heads, dim});
  v.strides[1] = stride;
  v.strides[0] = tokens * stride;
  return v;
}

Status quantize_kv_rows(const TensorView& x, const TensorView& codes, const TensorView& scales) {
  constexpr const char* fn = "quantize_kv_rows";
  if (x.rank < 1)
    return invalid_argument(std::string(fn) + ": x has rank " + std::to_string(x.rank) +
                            ", must have rank 1 to 4");
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "x", x, x.rank, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "codes", codes, x.rank, {DType::kI8, DType::kFp8E4M3}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "scales", scales, x.rank, {DType::kF32}));
  const int last = x.rank - 1;
  for (int i = 0; i < x.rank; ++i) {
    if (codes.shape[i] != x.shape[i])
      return invalid_argument(std::string(fn) + ": codes.shape[" + std::to_string(i) +
                              "] = " + std::to_string(codes.shape[i]) + " must equal x.shape[" +
                              std::to_string(i) + "] = " + std::to_string(x.shape[i]));
    const int64_t want = i == last ? 1 : x.shape[i];
    if (scales.shape[i] != want)
      return invalid_argument(std::string(fn) + ": scales.shape[" + std::to_string(i) +
                              "] = " + std::to_string(scales.shape[i]) + " must be " +
                              std::to_string(want) + (i == last ? " (one scale per row)" : ""));
  }
  if (codes.shape[last] > 1 && codes.strides[last] != 1)
    return invalid_argument(std::string(fn) + ": codes.strides[" + std::to_string(last) +
                            "] = " + std::to_string(codes.strides[last]) +
                            " must be 1 (rows of codes are contiguous)");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "codes", codes));
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "scales", scales));
  const NamedView outputs[] = {{"codes", &codes}, {"scales", &scales}};
  const NamedView inputs[] = {{"x", &x}};
  ATTNKIT_RETURN_IF_ERROR(check_outputs_apart(fn, outputs, inputs));
  if (check::overlaps(codes, scales))
    return invalid_argument(std::string(fn) + ": codes overlap scales");
  int64_t shape[3] = {1, 1, 1}, xs[3] = {0, 0, 0}, cs[3] = {0, 0, 0}, ss[3] = {0, 0, 0};
  for (int i = 0; i < last; ++i) {
    shape[3 - last + i] = x.shape[i];
    xs[3 - last + i] = x.strides[i];
    cs[3 - last + i] = codes.strides[i];
    ss[3 - last + i] = scales.strides[i];
  }
  const int64_t dim = x.shape[last];
  if (dim == 0) return Status::Ok();
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c) {
        const float* row = x.ptr<const float>() + a * xs[0] + b * xs[1] + c * xs[2];
        uint8_t* out = codes.ptr<uint8_t>() + a * cs[0] + b * cs[1] + c * cs[2];
        float* scale = scales.ptr<float>() + a * ss[0] + b * ss[1] + c * ss[2];
        quantize_kv(row, x.strides[last], dim, codes.dtype, 0, out, scale);
      }
  return Status::Ok();
}

size_t KVCache::nbytes() const {
  const int64_t values = keys_.numel() + values_.numel();
  const int64_t scales = key_scales_.present() ? key_scales_.numel() + value_scales_.numel() : 0;
  return static_cast<size_t>(values) * dtype_size(spec_.dtype) +
         static_cast<size_t>(scales) * sizeof(float);
}

Result<KVCache> KVCache::create(const KVCacheSpec& spec) {
  const std::string f = kCreate;
  const struct {
    const char* name;
    int64_t value;
  } sizes[] = {{"batch_size", spec.batch_size},
               {"max_seq_len", spec.max_seq_len},
               {"num_kv_heads", spec.num_kv_heads},
               {"head_dim", spec.head_dim}};
  for (const auto& s : sizes)
    if (s.value < 1)
      return invalid_argument(f + ": spec." + s.name + " = " + std::to_string(s.value) +
                              " must be >= 1");
  if (spec.head_dim_v < 0)
    return invalid_argument(f + ": spec.head_dim_v = " + std::to_string(spec.head_dim_v) +
                            " must be >= 1 (or 0 for head_dim)");
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16 && !is_kv_quantized(spec.dtype))
    return invalid_argument(f + ": spec.dtype = " + dtype_name(spec.dtype) +
                            " must be f32, bf16, int8 or fp8_e4m3");
  if (spec.sliding_window < 0)
    return invalid_argument(f + ": spec.sliding_window = " + std::to_string(spec.sliding_window) +
                            " must be >= 1 (or 0 for none)");
  if (spec.chunk_size < 0)
    return invalid_argument(f + ": spec.chunk_size = " + std::to_string(spec.chunk_size) +
                            " must be >= 1 (or 0 for none)");
  if (spec.chunk_size > 0 && spec.sliding_window > 0)
    return invalid_argument(f + ": spec.sliding_window = " + std::to_string(spec.sliding_window) +
                            " and spec.chunk_size = " + std::to_string(spec.chunk_size) +
                            " are both set; a cache has at most one of them");

  KVCache cache;
  cache.spec_ = spec;
  if (cache.spec_.head_dim_v == 0) cache.spec_.head_dim_v = spec.head_dim;
  // A window W sees at most W-1 earlier tokens, so W == 1 keeps none.
  // A chunk of C sees at most its own C tokens.
  cache.slots_ = spec.sliding_window > 0 ? std::min(spec.max_seq_len, spec.sliding_window - 1)
                 : spec.chunk_size > 0   ? std::min(spec.max_seq_len, spec.chunk_size)
                                         : spec.max_seq_len;
  // Tensor::zeros checks the element and byte counts for overflow.
  Rows k, v;
  Status st = make_storage(spec.dtype, spec.batch_size, cache.slots_, spec.num_kv_heads,
                           spec.head_dim, &cache.key_storage_, &k);
  if (!st.ok()) return Status(st.code(), f + ": keys: " + st.message());
  st = make_storage(spec.dtype, spec.batch_size, cache.slots_, spec.num_kv_heads,
                    cache.spec_.head_dim_v, &cache.value_storage_, &v);
  if (!st.ok()) return Status(st.code(), f + ": values: " + st.message());
  cache.keys_ = k.data;
  cache.key_scales_ = k.scales;
  cache.values_ = v.data;
  cache.value_scales_ = v.scales;
  return cache;
}

Status KVCache::attend(const TensorView& q, const TensorView& k_new, const TensorView& v_new,
                       const TensorView& out, const AttentionOptions& options) {
  const std::string f = kAttend;
  ATTNKIT_RETURN_IF_ERROR(check::view(kAttend, "q", q, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kAttend, "k_new", k_new, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kAttend, "v_new", v_new, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kAttend, "out", out, 4, {DType::kF32}));

  const int64_t batch = spec_.batch_size, num_kv_heads = spec_.num_kv_heads;
  const int64_t head_dim = spec_.head_dim, head_dim_v = spec_.head_dim_v;
  const int64_t T = q.shape[1], num_heads = q.shape[2];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kAttend, "q", q, 0, "batch", batch, "spec.batch_size"));
  if (T < 1)
    return invalid_argument(f + ": q.shape[1] (T) = " + std::to_string(T) + " must be >= 1");
  ATTNKIT_RETURN_IF_ERROR(check::dim(kAttend, "q", q, 3, "head_dim", head_dim, "spec.head_dim"));
  ATTNKIT_RETURN_IF_ERROR(
      check_head_layout(kAttend, num_heads, num_kv_heads, head_dim, head_dim_v));
  const struct {
    const char* name;
    const TensorView* view;
    int64_t heads, dim;
    const char* heads_src;
    const char* dim_src;
  } shaped[] = {
      {"k_new", &k_new, num_kv_heads, head_dim, "spec.num_kv_heads", "spec.head_dim"},
      {"v_new", &v_new, num_kv_heads, head_dim_v, "spec.num_kv_heads", "spec.head_dim_v"},
      {"out", &out, num_heads, head_dim_v, "q.shape[2]", "spec.head_dim_v"},
  };
  for (const auto& s : shaped) {
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(kAttend, s.name, *s.view, 0, "batch", batch, "spec.batch_size"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kAttend, s.name, *s.view, 1, "T", T, "q.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kAttend, s.name, *s.view, 2,
                                       s.view == &out ? "num_heads" : "num_kv_heads", s.heads,
                                       s.heads_src));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kAttend, s.name, *s.view, 3,
                                       s.view == &k_new ? "head_dim" : "head_dim_v", s.dim,
                                       s.dim_src));
  }

  // Threads write distinct output rows; rows that share memory would race.
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kAttend, "out", out));
  ATTNKIT_RETURN_IF_ERROR(check_attention_options(kAttend, options));
  if (options.mask.present())
    return invalid_argument(f +
                            ": options.mask is not supported; a cache's mask is causal "
                            "(plus its window)");
  if (!options.seqlens_k.empty())
    return invalid_argument(f +
                            ": options.seqlens_k is not supported; every sequence of a "
                            "cache has length() tokens");
  if (options.window_size.left != -1 || options.window_size.right != -1)
    return invalid_argument(f + ": options.window_size = (" +
                            std::to_string(options.window_size.left) + ", " +
                            std::to_string(options.window_size.right) +
                            ") must be (-1, -1); the window is the cache's spec.sliding_window");
  const int64_t W = spec_.sliding_window, C = spec_.chunk_size;
  if (W > 0 && options.sparse.kind != SparsePattern::Kind::kNone)
    return invalid_argument(f +
                            ": options.sparse cannot be combined with a sliding-window "
                            "cache (spec.sliding_window = " +
                            std::to_string(W) +
                            "): the pattern is defined on absolute positions, which the ring "
                            "does not keep");
  if (C > 0 && options.sparse.kind != SparsePattern::Kind::kNone)
    return invalid_argument(f +
                            ": options.sparse cannot be combined with a chunked cache "
                            "(spec.chunk_size = " +
                            std::to_string(C) +
                            "): the pattern is defined on absolute positions, which the ring "
                            "does not keep");
  if (options.chunk_size != 0 && options.chunk_size != C)
    return invalid_argument(f + ": options.chunk_size = " + std::to_string(options.chunk_size) +
                            " must be 0 or spec.chunk_size = " + std::to_string(C) +
                            "; the chunk is the cache's");
  ATTNKIT_RETURN_IF_ERROR(check_sinks(kAttend, options.sinks, num_heads));

  const TensorView* inputs[] = {&q, &k_new, &v_new};
  const char* in_names[] = {"q", "k_new", "v_new"};
  for (int i = 0; i < 3; ++i) {
    if (check::overlaps(out, *inputs[i]))
      return invalid_argument(f + ": out overlaps input " + in_names[i] +
                              "; outputs must not alias inputs");
  }
  if (check::overlaps(out, options.sinks))
    return invalid_argument(f +
                            ": out overlaps input options.sinks; outputs must not alias inputs");
  const TensorView* all[] = {&q, &k_new, &v_new, &out};
  const char* all_names[] = {"q", "k_new", "v_new", "out"};
  for (int i = 0; i < 4; ++i)
    if (check::overlaps(*all[i], keys_) || check::overlaps(*all[i], values_))
      return invalid_argument(f + ": " + all_names[i] + " overlaps the cache's own storage");

  int64_t new_length;
  if (!checked_add(length_, T, &new_length) || new_length > spec_.max_seq_len)
    return out_of_range(f + ": length() + T = " + std::to_string(length_) + " + " +
                        std::to_string(T) +
                        " exceeds max_seq_len = " + std::to_string(spec_.max_seq_len));

  kernels::AttentionParams prm = base_params(q, num_kv_heads, head_dim_v, options);
  const Rows keys{keys_, key_scales_}, values{values_, value_scales_};
  const Rows k_in{k_new, {}}, v_in{v_new, {}};

  if (C > 0) return attend_chunked(q, k_new, v_new, out, options);
  if (W == 0) {
    // Slots [length, length + T) hold no token yet, so writing them before
    // attending changes nothing observable if the kernel call fails.
    for (int64_t t = 0; t < T; ++t) {
      store_token(k_in, t, keys, length_ + t);
      store_token(v_in, t, values, length_ + t);
    }
    prm.seqlen_k = new_length;  // bottom-right causal: q_offset = length
    set_kv(keys, values, &prm);
    set_out(out, {}, &prm);
    ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(prm, options.backend));
    length_ = new_length;
    return Status::Ok();
  }

  // Sliding window. Scratch first, so an allocation failure writes nothing.
  const int64_t held = stored();
  auto alloc = [&](DType dt, std::initializer_list<int64_t> shape, Tensor* t) -> Status {
    auto r = Tensor::zeros(dt, shape);
    if (!r.ok()) return Status(r.status().code(), f + ": scratch: " + r.status().message());
    *t = std::move(r).value();
    return Status::Ok();
  };
  Tensor out_a, lse_a, out_b, lse_b, q_offset, k_chunk, v_chunk;
  ATTNKIT_RETURN_IF_ERROR(alloc(DType::kF32, {batch, T, num_heads, head_dim_v}, &out_b));
  ATTNKIT_RETURN_IF_ERROR(alloc(DType::kF32, {batch, num_heads, T}, &lse_b));
  if (held > 0) {
    ATTNKIT_RETURN_IF_ERROR(alloc(DType::kF32, {batch, T, num_heads, head_dim_v}, &out_a));
    ATTNKIT_RETURN_IF_ERROR(alloc(DType::kF32, {batch, num_heads, T}, &lse_a));
    ATTNKIT_RETURN_IF_ERROR(alloc(DType::kI64, {batch}, &q_offset));
  }
  // A bf16 or 8-bit cache rounds (quantizes) the chunk into its own layout
  // before part B reads it, so that the new tokens are seen exactly as the
  // no-window path (write, then read) sees them and results do not depend
  // on whether a window is configured.
  Rows k_src = k_in, v_src = v_in;
  if (spec_.dtype != DType::kF32) {
    auto chunk = [&](int64_t dim, Tensor* t, Rows* rows) -> Status {
      const Status st = make_storage(spec_.dtype, batch, T, num_kv_heads, dim, t, rows);
      if (!st.ok()) return Status(st.code(), f + ": scratch: " + st.message());
      return Status::Ok();
    };
    ATTNKIT_RETURN_IF_ERROR(chunk(head_dim, &k_chunk, &k_src));
    ATTNKIT_RETURN_IF_ERROR(chunk(head_dim_v, &v_chunk, &v_src));
    for (int64_t t = 0; t < T; ++t) {
      store_token(k_in, t, k_src, t);
      store_token(v_in, t, v_src, t);
    }
  }

  // B: the chunk over itself, causal (q_offset = 0) within the window. It
  // alone carries the sinks (prm's): merged with A, the sink then counts
  // once in the denominator.
  kernels::AttentionParams pb = prm;
  pb.seqlen_k = T;
  pb.window_left = W - 1;
  set_kv(k_src, v_src, &pb);
  set_out(out_b.view(), lse_b.view(), &pb);
  ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(pb, options.backend));

  if (held > 0) {
    // A: logical key j (0 = oldest held) is absolute position
    // length - held + j, in slot (length - held + j) mod slots. Query t sits
    // at absolute length + t, i.e. at held + t relative to the held keys;
    // the window then keeps j >= held + t - (W - 1), and causal admits all.
    kernels::AttentionParams pa = prm;
    pa.sinks = nullptr;
    pa.seqlen_k = held;
    pa.ring_capacity = slots_;
    pa.ring_start = (length_ - held) % slots_;
    int64_t* offsets = q_offset.ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) offsets[b] = held;
    pa.q_offset = offsets;
    pa.window_left = W - 1;
    set_kv(keys, values, &pa);
    set_out(out_a.view(), lse_a.view(), &pa);
    ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(pa, options.backend));
    // The views' shapes were set from validated sizes; merge cannot fail.
    ATTNKIT_RETURN_IF_ERROR(merge_attention_states(out_a.view(), lse_a.view(), out_b.view(),
                                                   lse_b.view(), out, lse_a.view()));
  } else {
    const TensorView& ob = out_b.view();
    float* o = out.ptr<float>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < num_heads; ++h)
          for (int64_t d = 0; d < head_dim_v; ++d)
            o[b * out.strides[0] + t * out.strides[1] + h * out.strides[2] + d * out.strides[3]] =
                ob.ptr<float>()[((b * T + t) * num_heads + h) * head_dim_v + d];
  }

  // Keep the newest min(T, slots) tokens; older chunk tokens would be
  // overwritten within this same loop anyway.
  for (int64_t t = std::max<int64_t>(0, T - slots_); t < T; ++t) {
    const int64_t slot = (length_ + t) % slots_;
    store_token(k_src, t, keys, slot);
    store_token(v_src, t, values, slot);
  }
  length_ = new_length;
  return Status::Ok();
}

// The chunked cache's attend (the file's header says how), after
// attend() validated every argument: C = spec.chunk_size, slots = min(C,
// max_seq_len), length() + T <= max_seq_len.
Status KVCache::attend_chunked(const TensorView& q, const TensorView& k_new,
                               const TensorView& v_new, const TensorView& out,
                               const AttentionOptions& options) {
  const std::string f = kAttend;
  const int64_t batch = spec_.batch_size, num_kv_heads = spec_.num_kv_heads;
  const int64_t head_dim_v = spec_.head_dim_v, C = spec_.chunk_size;
  const int64_t T = q.shape[1];
  const int64_t held = length_ % C;             // the current chunk's tokens, slots [0, held)
  const int64_t first = std::min(T, C - held);  // new tokens that continue that chunk
  const Rows keys{keys_, key_scales_}, values{values_, value_scales_};
  const Rows k_in{k_new, {}}, v_in{v_new, {}};

  // The later chunks' tokens, as the cache would store them (bf16 rounded,
  // 8-bit quantized), so that they are seen exactly as tokens read back from
  // the cache are. Allocated before anything is written.
  Rows k_src = k_in, v_src = v_in;
  Tensor k_copy, v_copy;
  if (T > first && spec_.dtype != DType::kF32) {
    auto copy = [&](int64_t dim, Tensor* t, Rows* rows) -> Status {
      const Status st = make_storage(spec_.dtype, batch, T, num_kv_heads, dim, t, rows);
      if (!st.ok()) return Status(st.code(), f + ": scratch: " + st.message());
      return Status::Ok();
    };
    ATTNKIT_RETURN_IF_ERROR(copy(spec_.head_dim, &k_copy, &k_src));
    ATTNKIT_RETURN_IF_ERROR(copy(head_dim_v, &v_copy, &v_src));
    for (int64_t t = first; t < T; ++t) {
      store_token(k_in, t, k_src, t);
      store_token(v_in, t, v_src, t);
    }
  }

  // Slots [held, held + first) hold only older chunks' tokens: writing the
  // first tokens there before attending changes nothing observable.
  for (int64_t t = 0; t < first; ++t) {
    store_token(k_in, t, keys, held + t);
    store_token(v_in, t, values, held + t);
  }
  const kernels::AttentionParams prm = base_params(q, num_kv_heads, head_dim_v, options);
  // Queries [0, first) over slots [0, held + first), bottom-right causal.
  kernels::AttentionParams pa = prm;
  pa.seqlen_q = first;
  pa.seqlen_k = held + first;
  set_kv(keys, values, &pa);
  set_out(out, {}, &pa);
  ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(pa, options.backend));

  if (T > first) {
    // Queries [first, T) over new tokens [first, T): token first starts a
    // chunk, so positions counted from it keep the chunks' boundaries.
    kernels::AttentionParams pb = prm;
    pb.seqlen_q = pb.seqlen_k = T - first;
    pb.q = q.ptr<const float>() + first * q.strides[1];
    pb.chunk_size = C;
    Rows k_rest = k_src, v_rest = v_src;
    for (Rows* r : {&k_rest, &v_rest}) {
      const int64_t elem = static_cast<int64_t>(dtype_size(r->data.dtype));
      r->data.data = static_cast<char*>(r->data.data) + first * r->data.strides[1] * elem;
      if (r->scales.present())
        r->scales.data = r->scales.ptr<float>() + first * r->scales.strides[1];
    }
    set_kv(k_rest, v_rest, &pb);
    TensorView out_rest = out;
    out_rest.data = out.ptr<float>() + first * out.strides[1];
    set_out(out_rest, {}, &pb);
    // A failure here leaves slots [held, held + first) written, which only
    // older chunks' tokens occupied: nothing observable has changed yet.
    ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(pb, options.backend));
    // The last chunk's tokens into their slots (from 0).
    for (int64_t t = first + (T - first - 1) / C * C; t < T; ++t) {
      store_token(k_src, t, keys, (length_ + t) % C);
      store_token(v_src, t, values, (length_ + t) % C);
    }
  }
  length_ += T;
  return Status::Ok();
}

}  // namespace attnkit
