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
#include "attnkit/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/check.h"
#include "core/checked_math.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/dispatch.h"
#include "ops/attention_checks.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "KVCache::create";
constexpr const char* kAttend = "KVCache::attend";

kernels::Strides4 strides_of(const TensorView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.strides[3]};
}

// Copies token `t` of src [batch, T, heads, dim] (f32 or bf16, any strides)
// into row `row` of dst [batch, rows, heads, dim] (f32 or bf16, any
// strides). f32 -> bf16 rounds to nearest even; bf16 -> bf16 is exact.
void store_token(const TensorView& src, int64_t t, const TensorView& dst, int64_t row) {
  const int64_t batch = src.shape[0], heads = src.shape[2], dim = src.shape[3];
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t s0 = b * src.strides[0] + t * src.strides[1] + h * src.strides[2];
      const int64_t d0 = b * dst.strides[0] + row * dst.strides[1] + h * dst.strides[2];
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t si = s0 + d * src.strides[3], di = d0 + d * dst.strides[3];
        if (src.dtype == DType::kBF16)
          dst.ptr<bf16>()[di] = src.ptr<const bf16>()[si];  // dst is then bf16 too
        else if (dst.dtype == DType::kBF16)
          dst.ptr<bf16>()[di] = float_to_bf16(src.ptr<const float>()[si]);
        else
          dst.ptr<float>()[di] = src.ptr<const float>()[si];
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

// Storage [batch, slots, stride] (zeroed) and the [batch, slots, heads, dim]
// view of its first heads * dim elements per token.
Status make_storage(DType dtype, int64_t batch, int64_t slots, int64_t heads, int64_t dim,
                    Tensor* storage, TensorView* view) {
  const int64_t stride = kv_token_stride(heads, dim, dtype);
  if (stride == 0) return resource_exhausted("element count overflows 64 bits");
  auto t = Tensor::zeros(dtype, {batch, slots, stride});
  if (!t.ok()) return t.status();
  *storage = std::move(t).value();
  *view = kv_cache_view(storage->data(), dtype, batch, slots, heads, dim);
  return Status::Ok();
}

}  // namespace

int64_t kv_token_stride(int64_t num_kv_heads, int64_t dim, DType dtype) {
  int64_t row;
  if (num_kv_heads < 1 || dim < 1 || !checked_mul(num_kv_heads, dim, &row)) return 0;
  return kernels::cpu::padded_token_row(row, static_cast<int64_t>(dtype_size(dtype)));
}

TensorView kv_cache_view(void* data, DType dtype, int64_t batch, int64_t tokens,
                         int64_t num_kv_heads, int64_t dim) {
  const int64_t stride = kv_token_stride(num_kv_heads, dim, dtype);
  TensorView v = make_view(data, dtype, {batch, tokens, num_kv_heads, dim});
  v.strides[1] = stride;
  v.strides[0] = tokens * stride;
  return v;
}

size_t KVCache::nbytes() const {
  return static_cast<size_t>(keys_.numel() + values_.numel()) * dtype_size(spec_.dtype);
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
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16)
    return invalid_argument(f + ": spec.dtype = " + dtype_name(spec.dtype) +
                            " must be f32 or bf16");
  if (spec.sliding_window < 0)
    return invalid_argument(f + ": spec.sliding_window = " + std::to_string(spec.sliding_window) +
                            " must be >= 1 (or 0 for none)");

  KVCache cache;
  cache.spec_ = spec;
  if (cache.spec_.head_dim_v == 0) cache.spec_.head_dim_v = spec.head_dim;
  // A window W sees at most W-1 earlier tokens, so W == 1 keeps none.
  cache.slots_ = spec.sliding_window == 0 ? spec.max_seq_len
                                          : std::min(spec.max_seq_len, spec.sliding_window - 1);
  // Tensor::zeros checks the element and byte counts for overflow.
  Status st = make_storage(spec.dtype, spec.batch_size, cache.slots_, spec.num_kv_heads,
                           spec.head_dim, &cache.key_storage_, &cache.keys_);
  if (!st.ok()) return Status(st.code(), f + ": keys: " + st.message());
  st = make_storage(spec.dtype, spec.batch_size, cache.slots_, spec.num_kv_heads,
                    cache.spec_.head_dim_v, &cache.value_storage_, &cache.values_);
  if (!st.ok()) return Status(st.code(), f + ": values: " + st.message());
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
  const int64_t W = spec_.sliding_window;
  if (W > 0 && options.sparse.kind != SparsePattern::Kind::kNone)
    return invalid_argument(f +
                            ": options.sparse cannot be combined with a sliding-window "
                            "cache (spec.sliding_window = " +
                            std::to_string(W) +
                            "): the pattern is defined on absolute positions, which the ring "
                            "does not keep");

  const TensorView* inputs[] = {&q, &k_new, &v_new};
  const char* in_names[] = {"q", "k_new", "v_new"};
  for (int i = 0; i < 3; ++i) {
    if (check::overlaps(out, *inputs[i]))
      return invalid_argument(f + ": out overlaps input " + in_names[i] +
                              "; outputs must not alias inputs");
  }
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
  prm.kv_dtype = spec_.dtype;

  if (W == 0) {
    // Slots [length, length + T) hold no token yet, so writing them before
    // attending changes nothing observable if the kernel call fails.
    for (int64_t t = 0; t < T; ++t) {
      store_token(k_new, t, keys_, length_ + t);
      store_token(v_new, t, values_, length_ + t);
    }
    prm.seqlen_k = new_length;  // bottom-right causal: q_offset = length
    prm.k = keys_.data;
    prm.k_stride = strides_of(keys_);
    prm.v = values_.data;
    prm.v_stride = strides_of(values_);
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
  // A bf16 cache rounds the chunk before part B reads it, so that the new
  // tokens are seen exactly as the no-window path (write, then read) sees
  // them and results do not depend on whether a window is configured.
  TensorView k_src = k_new, v_src = v_new;
  if (spec_.dtype == DType::kBF16) {
    ATTNKIT_RETURN_IF_ERROR(alloc(DType::kBF16, {batch, T, num_kv_heads, head_dim}, &k_chunk));
    ATTNKIT_RETURN_IF_ERROR(alloc(DType::kBF16, {batch, T, num_kv_heads, head_dim_v}, &v_chunk));
    for (int64_t t = 0; t < T; ++t) {
      store_token(k_new, t, k_chunk.view(), t);
      store_token(v_new, t, v_chunk.view(), t);
    }
    k_src = k_chunk.view();
    v_src = v_chunk.view();
  }

  // B: the chunk over itself, causal (q_offset = 0) within the window.
  kernels::AttentionParams pb = prm;
  pb.seqlen_k = T;
  pb.window_left = W - 1;
  pb.k = k_src.data;
  pb.k_stride = strides_of(k_src);
  pb.v = v_src.data;
  pb.v_stride = strides_of(v_src);
  pb.kv_dtype = k_src.dtype;
  set_out(out_b.view(), lse_b.view(), &pb);
  ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(pb, options.backend));

  if (held > 0) {
    // A: logical key j (0 = oldest held) is absolute position
    // length - held + j, in slot (length - held + j) mod slots. Query t sits
    // at absolute length + t, i.e. at held + t relative to the held keys;
    // the window then keeps j >= held + t - (W - 1), and causal admits all.
    kernels::AttentionParams pa = prm;
    pa.seqlen_k = held;
    pa.ring_capacity = slots_;
    pa.ring_start = (length_ - held) % slots_;
    int64_t* offsets = q_offset.ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) offsets[b] = held;
    pa.q_offset = offsets;
    pa.window_left = W - 1;
    pa.k = keys_.data;
    pa.k_stride = strides_of(keys_);
    pa.v = values_.data;
    pa.v_stride = strides_of(values_);
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
    store_token(k_src, t, keys_, slot);
    store_token(v_src, t, values_, slot);
  }
  length_ = new_length;
  return Status::Ok();
}

}  // namespace attnkit
