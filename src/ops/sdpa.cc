// Public sdpa() and merge_attention_states(): validate every argument, fill
// the kernel params, dispatch. Nothing is written before validation passes.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "core/check.h"
#include "kernels/dispatch.h"
#include "kernels/sparse.h"
#include "ops/attention_checks.h"

namespace attnkit {
namespace {

constexpr const char* kFn = "sdpa";

kernels::Strides4 strides_of(const TensorView& v) {
  return {v.strides[0], v.strides[1], v.strides[2], v.strides[3]};
}

// scale, softcap, causal, window, chunk, sinks, sparse pattern and
// threads from `o` (checked by check_attention_options and check_sinks).
void fill_options(const AttentionOptions& o, int64_t head_dim, kernels::AttentionParams* prm) {
  prm->scale = o.softmax_scale > 0.0f
                   ? o.softmax_scale
                   : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  prm->softcap = o.softcap;
  prm->causal = o.causal;
  prm->window_left = o.window_size.left;
  prm->window_right = o.window_size.right;
  prm->sparse = o.sparse;
  prm->chunk_size = o.chunk_size;
  if (o.sinks.present()) {
    prm->sinks = o.sinks.ptr<const float>();
    prm->sinks_stride = o.sinks.strides[0];
  }
  prm->num_threads = o.num_threads;
}

// options.key_indices: int32 [batch, seqlen_q, topk], every entry -1 or a
// valid key of its row (attention.h), and no other visibility rule.
Status check_key_indices(const AttentionOptions& o, int64_t batch, int64_t seqlen_q,
                         int64_t seqlen_k, bool probs, kernels::KeyIndices* out) {
  const TensorView& ki = o.key_indices;
  const std::string f = std::string(kFn) + ": options.key_indices";
  ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "options.key_indices", ki, 3, {DType::kI32}));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kFn, "options.key_indices", ki, 0, "batch", batch, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kFn, "options.key_indices", ki, 1, "seqlen_q", seqlen_q, "q.shape[1]"));
  const char* other = o.mask.present()                                      ? "mask"
                      : o.sparse.kind != SparsePattern::Kind::kNone         ? "sparse"
                      : o.window_size.left >= 0 || o.window_size.right >= 0 ? "window_size"
                      : o.chunk_size > 0                                    ? "chunk_size"
                      : o.sinks.present()                                   ? "sinks"
                      : probs                                               ? "probs"
                                                                            : nullptr;
  if (other)
    return invalid_argument(f + " is given together with " + other +
                            "; the indices are the whole visibility, so " + other +
                            " must be absent");
  const int64_t topk = ki.shape[2];
  const int32_t* base = ki.ptr<const int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t L = o.seqlens_k.empty() ? seqlen_k : o.seqlens_k[static_cast<size_t>(b)];
    for (int64_t i = 0; i < seqlen_q; ++i)
      for (int64_t n = 0; n < topk; ++n) {
        const int32_t j = base[b * ki.strides[0] + i * ki.strides[1] + n * ki.strides[2]];
        const int64_t limit = o.causal ? std::min(L, i + L - seqlen_q + 1) : L;
        if (j == -1 || (j >= 0 && j < limit)) continue;
        return invalid_argument(
            f + "[" + std::to_string(b) + ", " + std::to_string(i) + ", " + std::to_string(n) +
            "] = " + std::to_string(j) + " must be -1 or in [0, " + std::to_string(limit) + ") (" +
            (o.causal ? "the keys row i sees causally" : "the valid keys") + ")");
      }
  }
  *out = {base, {ki.strides[0], ki.strides[1], ki.strides[2]}, topk};
  return Status::Ok();
}

}  // namespace

// Rejects an output view in which two distinct elements provably share
// memory: a dim of size > 1 with stride 0, or stride[a] = m * stride[b] with
// 1 <= m < shape[b] (element 1 along a is element m along b). Writing such a
// view would make the result depend on write order. It never rejects a
// layout that does not overlap, so "any strides" stays true for valid ones.
Status check_no_self_overlap(const char* fn, const char* name, const TensorView& v) {
  // An empty view has no elements to share (and row-major strides of an
  // empty shape, as make_view and numpy compute them, contain zeros).
  for (int i = 0; i < v.rank; ++i)
    if (v.shape[i] == 0) return Status::Ok();
  const std::string n = name;
  for (int b = 0; b < v.rank; ++b) {
    if (v.shape[b] < 2) continue;
    const std::string sb =
        n + ".strides[" + std::to_string(b) + "] = " + std::to_string(v.strides[b]);
    if (v.strides[b] == 0)
      return invalid_argument(std::string(fn) + ": " + sb + " with " + n + ".shape[" +
                              std::to_string(b) + "] = " + std::to_string(v.shape[b]) +
                              " makes distinct elements share memory; an output must not "
                              "overlap itself");
    for (int a = 0; a < v.rank; ++a) {
      if (a == b || v.shape[a] < 2 || v.strides[a] % v.strides[b] != 0) continue;
      const int64_t m = v.strides[a] / v.strides[b];
      if (m >= 1 && m < v.shape[b])
        return invalid_argument(std::string(fn) + ": " + n + ".strides[" + std::to_string(a) +
                                "] = " + std::to_string(v.strides[a]) + " is " + std::to_string(m) +
                                " * " + sb + " with " + n + ".shape[" + std::to_string(b) +
                                "] = " + std::to_string(v.shape[b]) +
                                ", so distinct elements share memory; an output must not "
                                "overlap itself");
    }
  }
  return Status::Ok();
}

Status check_attention_options(const char* fn, const AttentionOptions& o, bool kv_scales) {
  const std::string f = fn;
  if (!kv_scales && (o.k_scales.present() || o.v_scales.present()))
    return invalid_argument(f + ": options." + (o.k_scales.present() ? "k_scales" : "v_scales") +
                            " must be absent: only sdpa() takes 8-bit K/V with their scales");
  if (!kv_scales && o.key_indices.present())
    return invalid_argument(f +
                            ": options.key_indices must be absent: only sdpa() takes "
                            "per-query key indices");
  if (!std::isfinite(o.softmax_scale) || o.softmax_scale < 0.0f)
    return invalid_argument(f + ": softmax_scale = " + std::to_string(o.softmax_scale) +
                            " must be finite and > 0 (or 0 for 1/sqrt(head_dim))");
  if (!std::isfinite(o.softcap) || o.softcap < 0.0f)
    return invalid_argument(f + ": softcap = " + std::to_string(o.softcap) +
                            " must be finite and >= 0 (0 = off)");
  // The fast kernels multiply by 1 / softcap, which is +inf for a subnormal
  // cap (and 0 * inf is NaN); no model uses a cap anywhere near this small.
  if (o.softcap > 0.0f && o.softcap < std::numeric_limits<float>::min()) {
    char value[32];  // shortest round-trip form: "1e-40", not "0.000000"
    const auto end = std::to_chars(value, value + sizeof value, o.softcap).ptr;
    return invalid_argument(f + ": softcap = " + std::string(value, end) +
                            " is subnormal; a nonzero softcap must be >= FLT_MIN = 1.1754944e-38");
  }
  if (o.window_size.left < -1)
    return invalid_argument(f + ": window_size.left = " + std::to_string(o.window_size.left) +
                            " must be >= 0, or -1 for unlimited");
  if (o.window_size.right < -1)
    return invalid_argument(f + ": window_size.right = " + std::to_string(o.window_size.right) +
                            " must be >= 0, or -1 for unlimited");
  if (o.chunk_size < 0)
    return invalid_argument(f + ": chunk_size = " + std::to_string(o.chunk_size) +
                            " must be >= 0 (0 = off)");
  ATTNKIT_RETURN_IF_ERROR(check::run_options(fn, o.num_threads, o.backend, ""));
  const SparsePattern& sp = o.sparse;
  if (sp.kind != SparsePattern::Kind::kNone && sp.kind != SparsePattern::Kind::kStrided &&
      sp.kind != SparsePattern::Kind::kFixed)
    return invalid_argument(f + ": sparse.kind = " + std::to_string(static_cast<int>(sp.kind)) +
                            " is not a SparsePattern::Kind value");
  if (sp.kind != SparsePattern::Kind::kNone) {
    if (sp.block_size < 1)
      return invalid_argument(f + ": sparse.block_size = " + std::to_string(sp.block_size) +
                              " must be >= 1");
    if (sp.stride < 1)
      return invalid_argument(f + ": sparse.stride = " + std::to_string(sp.stride) +
                              " must be >= 1");
    if (sp.kind == SparsePattern::Kind::kFixed && (sp.summary < 1 || sp.summary > sp.stride))
      return invalid_argument(f + ": sparse.summary = " + std::to_string(sp.summary) +
                              " must be in [1, sparse.stride = " + std::to_string(sp.stride) + "]");
  }
  return Status::Ok();
}

Status fill_mask(const char* fn, const TensorView& mask, int64_t batch, int64_t num_heads,
                 int64_t seqlen_q, int64_t seqlen_k, kernels::AttentionParams* prm) {
  if (!mask.present()) return Status::Ok();
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "mask", mask, 4, {DType::kBool, DType::kF32}));
  const int64_t full[4] = {batch, num_heads, seqlen_q, seqlen_k};
  const char* names[4] = {"batch", "num_heads", "seqlen_q", "seqlen_k"};
  int64_t st[4];
  for (int i = 0; i < 4; ++i) {
    if (mask.shape[i] != full[i] && mask.shape[i] != 1)
      return invalid_argument(std::string(fn) + ": mask.shape[" + std::to_string(i) +
                              "] = " + std::to_string(mask.shape[i]) + " must be 1 or " + names[i] +
                              " = " + std::to_string(full[i]));
    st[i] = mask.shape[i] == 1 ? 0 : mask.strides[i];
  }
  // Mask axes are [batch, head, query, key]; the params name them
  // batch, head, row, dim.
  prm->mask_stride = {st[0], st[2], st[1], st[3]};
  if (mask.dtype == DType::kBool)
    prm->bool_mask = mask.ptr<const uint8_t>();
  else
    prm->add_mask = mask.ptr<const float>();
  return Status::Ok();
}

Status check_sinks(const char* fn, const TensorView& sinks, int64_t num_heads) {
  if (!sinks.present()) return Status::Ok();
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "options.sinks", sinks, 1, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(fn, "options.sinks", sinks, 0, "num_heads", num_heads, "the query heads"));
  const float* x = sinks.ptr<const float>();
  for (int64_t h = 0; h < num_heads; ++h) {
    const float value = x[h * sinks.strides[0]];
    // A sink of +inf would zero every output; -inf is no sink at all, and
    // NaN would poison every row: none is a logit a model learns.
    if (!std::isfinite(value))
      return invalid_argument(std::string(fn) + ": options.sinks[" + std::to_string(h) +
                              "] = " + std::to_string(value) + " must be finite");
  }
  return Status::Ok();
}

// 8-bit K/V's scales: present exactly when k is 8-bit, f32, rank 4,
// [batch, seqlen_k, num_kv_heads, 1].
Status check_kv_scales(const TensorView& k, const AttentionOptions& o) {
  const bool eight_bit = k.dtype == DType::kI8 || k.dtype == DType::kFp8E4M3;
  const struct {
    const char* name;
    const TensorView& view;
  } scales[] = {{"options.k_scales", o.k_scales}, {"options.v_scales", o.v_scales}};
  for (const auto& s : scales) {
    if (!eight_bit) {
      if (s.view.present())
        return invalid_argument(std::string(kFn) + ": " + s.name + " is given, but k.dtype = " +
                                dtype_name(k.dtype) + " has no scales (only int8 and fp8_e4m3)");
      continue;
    }
    if (!s.view.present())
      return invalid_argument(std::string(kFn) + ": " + s.name + " is absent; k.dtype = " +
                              dtype_name(k.dtype) + " needs the fp32 scale of every K and V row");
    ATTNKIT_RETURN_IF_ERROR(check::view(kFn, s.name, s.view, 4, {DType::kF32}));
    const int64_t want[4] = {k.shape[0], k.shape[1], k.shape[2], 1};
    const char* axis[4] = {"batch", "seqlen_k", "num_kv_heads", "1 (one scale per row)"};
    for (int i = 0; i < 4; ++i)
      if (s.view.shape[i] != want[i])
        return invalid_argument(std::string(kFn) + ": " + s.name + ".shape[" + std::to_string(i) +
                                "] = " + std::to_string(s.view.shape[i]) + " must be " + axis[i] +
                                " = " + std::to_string(want[i]));
  }
  return Status::Ok();
}

Status sdpa(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
            const AttentionOptions& options, const TensorView& lse, const TensorView& probs) {
  ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "q", q, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(
      check::view(kFn, "k", k, 4, {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "v", v, 4, {k.dtype}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "out", out, 4, {DType::kF32}));

  const int64_t batch = q.shape[0], seqlen_q = q.shape[1], num_heads = q.shape[2],
                head_dim = q.shape[3];
  const int64_t seqlen_k = k.shape[1], num_kv_heads = k.shape[2], head_dim_v = v.shape[3];
  ATTNKIT_RETURN_IF_ERROR(check_head_layout(kFn, num_heads, num_kv_heads, head_dim, head_dim_v));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "k", k, 0, "batch", batch, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "k", k, 3, "head_dim", head_dim, "q.shape[3]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "v", v, 0, "batch", batch, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "v", v, 1, "seqlen_k", seqlen_k, "k.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "v", v, 2, "num_kv_heads", num_kv_heads, "k.shape[2]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "out", out, 0, "batch", batch, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "out", out, 1, "seqlen_q", seqlen_q, "q.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "out", out, 2, "num_heads", num_heads, "q.shape[2]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "out", out, 3, "head_dim_v", head_dim_v, "v.shape[3]"));
  ATTNKIT_RETURN_IF_ERROR(check_attention_options(kFn, options, true));
  ATTNKIT_RETURN_IF_ERROR(check_kv_scales(k, options));
  ATTNKIT_RETURN_IF_ERROR(check_sinks(kFn, options.sinks, num_heads));

  if (lse.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "lse", lse, 3, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "lse", lse, 0, "batch", batch, "q.shape[0]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "lse", lse, 1, "num_heads", num_heads, "q.shape[2]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "lse", lse, 2, "seqlen_q", seqlen_q, "q.shape[1]"));
  }
  if (probs.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(kFn, "probs", probs, 4, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "probs", probs, 0, "batch", batch, "q.shape[0]"));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(kFn, "probs", probs, 1, "num_heads", num_heads, "q.shape[2]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "probs", probs, 2, "seqlen_q", seqlen_q, "q.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(kFn, "probs", probs, 3, "seqlen_k", seqlen_k, "k.shape[1]"));
  }
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kFn, "out", out));
  if (lse.present()) ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kFn, "lse", lse));
  if (probs.present()) ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kFn, "probs", probs));
  const NamedView outputs[] = {{"out", &out}, {"lse", &lse}, {"probs", &probs}};
  const NamedView inputs[] = {{"q", &q},
                              {"k", &k},
                              {"v", &v},
                              {"mask", &options.mask},
                              {"options.k_scales", &options.k_scales},
                              {"options.v_scales", &options.v_scales},
                              {"options.sinks", &options.sinks},
                              {"options.key_indices", &options.key_indices}};
  ATTNKIT_RETURN_IF_ERROR(check_outputs_apart(kFn, outputs, inputs));

  if (!options.seqlens_k.empty()) {
    if (static_cast<int64_t>(options.seqlens_k.size()) != batch)
      return invalid_argument(std::string(kFn) + ": seqlens_k has " +
                              std::to_string(options.seqlens_k.size()) +
                              " entries, must have batch = " + std::to_string(batch));
    for (size_t b = 0; b < options.seqlens_k.size(); ++b) {
      const int32_t n = options.seqlens_k[b];
      if (n < 0 || n > seqlen_k)
        return invalid_argument(std::string(kFn) + ": seqlens_k[" + std::to_string(b) +
                                "] = " + std::to_string(n) +
                                " must be in [0, seqlen_k = " + std::to_string(seqlen_k) + "]");
    }
  }

  kernels::KeyIndices sparse;
  if (options.key_indices.present())
    ATTNKIT_RETURN_IF_ERROR(
        check_key_indices(options, batch, seqlen_q, seqlen_k, probs.present(), &sparse));

  kernels::AttentionParams prm;
  ATTNKIT_RETURN_IF_ERROR(fill_mask(kFn, options.mask, batch, num_heads, seqlen_q, seqlen_k, &prm));
  prm.batch = batch;
  prm.seqlen_q = seqlen_q;
  prm.seqlen_k = seqlen_k;
  prm.num_heads = num_heads;
  prm.num_kv_heads = num_kv_heads;
  prm.head_dim = head_dim;
  prm.head_dim_v = head_dim_v;
  prm.q = q.ptr<const float>();
  prm.q_stride = strides_of(q);
  prm.k = k.data;
  prm.k_stride = strides_of(k);
  prm.v = v.data;
  prm.v_stride = strides_of(v);
  prm.kv_dtype = k.dtype;
  if (options.k_scales.present()) {
    prm.k_scale = options.k_scales.ptr<const float>();
    prm.k_scale_stride = strides_of(options.k_scales);
    prm.v_scale = options.v_scales.ptr<const float>();
    prm.v_scale_stride = strides_of(options.v_scales);
  }
  prm.out = out.ptr<float>();
  prm.out_stride = strides_of(out);
  if (lse.present()) {
    prm.lse = lse.ptr<float>();
    prm.lse_stride_batch = lse.strides[0];
    prm.lse_stride_head = lse.strides[1];
    prm.lse_stride_row = lse.strides[2];
  }
  if (probs.present()) {
    prm.probs = probs.ptr<float>();
    prm.probs_stride = {probs.strides[0], probs.strides[2], probs.strides[1], probs.strides[3]};
  }
  fill_options(options, head_dim, &prm);
  prm.k_len = options.seqlens_k.empty() ? nullptr : options.seqlens_k.data();
  if (options.key_indices.present())
    return kernels::run_sparse_attention(prm, sparse, options.backend);
  return kernels::run_attention(prm, options.backend);
}

Status check_cu_seqlens(const char* fn, const char* name, std::span<const int32_t> cu,
                        int64_t count, int64_t total, const char* total_src, int32_t* max_len) {
  const std::string f = std::string(fn) + ": " + name;
  if (static_cast<int64_t>(cu.size()) != count + 1)
    return invalid_argument(f + " has " + std::to_string(cu.size()) + " entries, must have " +
                            std::to_string(count + 1) + " (one more than the sequences)");
  if (cu[0] != 0) return invalid_argument(f + "[0] = " + std::to_string(cu[0]) + " must be 0");
  *max_len = 0;
  for (int64_t s = 0; s < count; ++s) {
    if (cu[s + 1] < cu[s])
      return invalid_argument(f + "[" + std::to_string(s + 1) + "] = " + std::to_string(cu[s + 1]) +
                              " must be >= " + name + "[" + std::to_string(s) +
                              "] = " + std::to_string(cu[s]));
    *max_len = std::max(*max_len, cu[s + 1] - cu[s]);
  }
  if (cu[count] != total)
    return invalid_argument(f + "[" + std::to_string(count) + "] = " + std::to_string(cu[count]) +
                            " must equal " + total_src + " = " + std::to_string(total));
  return Status::Ok();
}

Status check_outputs_apart(const char* fn, std::span<const NamedView> outputs,
                           std::span<const NamedView> inputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (const NamedView& in : inputs)
      if (check::overlaps(*outputs[o].view, *in.view))
        return invalid_argument(std::string(fn) + ": " + outputs[o].name + " overlaps input " +
                                in.name + "; outputs must not alias inputs");
    for (size_t p = o + 1; p < outputs.size(); ++p)
      if (check::overlaps(*outputs[o].view, *outputs[p].view))
        return invalid_argument(std::string(fn) + ": outputs " + outputs[o].name + " and " +
                                outputs[p].name + " overlap");
  }
  return Status::Ok();
}

Status sdpa_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                   std::span<const int32_t> cu_seqlens_q, std::span<const int32_t> cu_seqlens_k,
                   const TensorView& out, const AttentionOptions& options, const TensorView& lse,
                   const TensorView& probs) {
  constexpr const char* fn = "sdpa_varlen";
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "q", q, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "k", k, 3, {DType::kF32, DType::kBF16}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "v", v, 3, {k.dtype}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "out", out, 3, {DType::kF32}));
  const int64_t total_q = q.shape[0], num_heads = q.shape[1], head_dim = q.shape[2];
  const int64_t total_k = k.shape[0], num_kv_heads = k.shape[1], head_dim_v = v.shape[2];
  ATTNKIT_RETURN_IF_ERROR(check_head_layout(fn, num_heads, num_kv_heads, head_dim, head_dim_v));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "k", k, 2, "head_dim", head_dim, "q.shape[2]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "v", v, 0, "total_k", total_k, "k.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "v", v, 1, "num_kv_heads", num_kv_heads, "k.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, 0, "total_q", total_q, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, 1, "num_heads", num_heads, "q.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, 2, "head_dim_v", head_dim_v, "v.shape[2]"));
  ATTNKIT_RETURN_IF_ERROR(check_attention_options(fn, options));
  ATTNKIT_RETURN_IF_ERROR(check_sinks(fn, options.sinks, num_heads));
  if (!options.seqlens_k.empty())
    return invalid_argument(std::string(fn) +
                            ": options.seqlens_k must be empty; cu_seqlens_k gives every "
                            "sequence's key count");
  // The kernels index rows with int32 offsets, as FlashAttention does.
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  if (total_q > kMaxRows || total_k > kMaxRows)
    return invalid_argument(std::string(fn) + ": total_q = " + std::to_string(total_q) +
                            " and total_k = " + std::to_string(total_k) +
                            " must be <= " + std::to_string(kMaxRows));
  const int64_t n = static_cast<int64_t>(cu_seqlens_q.size()) - 1;
  if (n < 0)
    return invalid_argument(std::string(fn) +
                            ": cu_seqlens_q is empty, must have one entry more than the sequences");
  int32_t max_q = 0, max_k = 0;
  ATTNKIT_RETURN_IF_ERROR(
      check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, n, total_q, "q.shape[0]", &max_q));
  ATTNKIT_RETURN_IF_ERROR(
      check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, n, total_k, "k.shape[0]", &max_k));
  if (lse.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(fn, "lse", lse, 2, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "lse", lse, 0, "num_heads", num_heads, "q.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "lse", lse, 1, "total_q", total_q, "q.shape[0]"));
  }
  if (probs.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(fn, "probs", probs, 4, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "probs", probs, 0, "n", n, "len(cu_seqlens_q) - 1"));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "probs", probs, 1, "num_heads", num_heads, "q.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "probs", probs, 2, "max_seqlen_q", max_q, "the longest query sequence"));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "probs", probs, 3, "max_seqlen_k", max_k, "the longest key sequence"));
  }
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "out", out));
  if (lse.present()) ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "lse", lse));
  if (probs.present()) ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "probs", probs));
  const NamedView outputs[] = {{"out", &out}, {"lse", &lse}, {"probs", &probs}};
  const NamedView inputs[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"mask", &options.mask}, {"options.sinks", &options.sinks}};
  ATTNKIT_RETURN_IF_ERROR(check_outputs_apart(fn, outputs, inputs));

  kernels::AttentionParams prm;
  ATTNKIT_RETURN_IF_ERROR(fill_mask(fn, options.mask, n, num_heads, max_q, max_k, &prm));
  std::vector<int32_t> q_len(static_cast<size_t>(n)), k_len(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    q_len[s] = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
    k_len[s] = cu_seqlens_k[s + 1] - cu_seqlens_k[s];
  }
  prm.batch = n;
  prm.seqlen_q = max_q;
  prm.seqlen_k = max_k;
  prm.num_heads = num_heads;
  prm.num_kv_heads = num_kv_heads;
  prm.head_dim = head_dim;
  prm.head_dim_v = head_dim_v;
  // Rank-3 views as rank-4 ones whose batch stride is 0: the rows of item
  // s start at q_start[s] (k_start[s]).
  prm.q = q.ptr<const float>();
  prm.q_stride = {0, q.strides[0], q.strides[1], q.strides[2]};
  prm.q_start = cu_seqlens_q.data();
  prm.q_len = q_len.data();
  prm.k = k.data;
  prm.k_stride = {0, k.strides[0], k.strides[1], k.strides[2]};
  prm.v = v.data;
  prm.v_stride = {0, v.strides[0], v.strides[1], v.strides[2]};
  prm.kv_dtype = k.dtype;
  prm.k_start = cu_seqlens_k.data();
  prm.k_len = k_len.data();
  prm.out = out.ptr<float>();
  prm.out_stride = {0, out.strides[0], out.strides[1], out.strides[2]};
  if (lse.present()) {
    prm.lse = lse.ptr<float>();
    prm.lse_stride_head = lse.strides[0];
    prm.lse_stride_row = lse.strides[1];
  }
  if (probs.present()) {
    prm.probs = probs.ptr<float>();
    prm.probs_stride = {probs.strides[0], probs.strides[2], probs.strides[1], probs.strides[3]};
  }
  fill_options(options, head_dim, &prm);
  return kernels::run_attention(prm, options.backend);
}

Status merge_attention_states(const TensorView& out_a, const TensorView& lse_a,
                              const TensorView& out_b, const TensorView& lse_b,
                              const TensorView& out, const TensorView& lse) {
  constexpr const char* fn = "merge_attention_states";
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "out_a", out_a, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "lse_a", lse_a, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "out_b", out_b, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "lse_b", lse_b, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "out", out, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "lse", lse, 3, {DType::kF32}));
  const int64_t batch = out_a.shape[0], seqlen_q = out_a.shape[1], num_heads = out_a.shape[2],
                dv = out_a.shape[3];
  for (int i = 0; i < 4; ++i) {
    const char* names[4] = {"batch", "seqlen_q", "num_heads", "head_dim_v"};
    const std::string src = "out_a.shape[" + std::to_string(i) + "]";
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out_b", out_b, i, names[i], out_a.shape[i], src));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, i, names[i], out_a.shape[i], src));
  }
  const int64_t lse_shape[3] = {batch, num_heads, seqlen_q};
  const char* lse_names[3] = {"batch", "num_heads", "seqlen_q"};
  const char* lse_src[3] = {"out_a.shape[0]", "out_a.shape[2]", "out_a.shape[1]"};
  for (int i = 0; i < 3; ++i) {
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "lse_a", lse_a, i, lse_names[i], lse_shape[i], lse_src[i]));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "lse_b", lse_b, i, lse_names[i], lse_shape[i], lse_src[i]));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "lse", lse, i, lse_names[i], lse_shape[i], lse_src[i]));
  }
  // out may be out_a itself and lse may be lse_a itself (each element is
  // read before it is written); any other overlap would let a write clobber
  // a value still to be read.
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "out", out));
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "lse", lse));
  auto same_view = [](const TensorView& x, const TensorView& y) {
    return x.data == y.data && x.strides == y.strides;
  };
  const TensorView* merge_in[] = {&out_a, &lse_a, &out_b, &lse_b};
  const char* merge_in_names[] = {"out_a", "lse_a", "out_b", "lse_b"};
  const TensorView* merge_out[] = {&out, &lse};
  const char* merge_out_names[] = {"out", "lse"};
  for (int o = 0; o < 2; ++o)
    for (int i = 0; i < 4; ++i) {
      if (i == o && same_view(*merge_out[o], *merge_in[i])) continue;  // the allowed alias
      if (check::overlaps(*merge_out[o], *merge_in[i]))
        return invalid_argument(std::string(fn) + ": " + merge_out_names[o] + " overlaps input " +
                                merge_in_names[i] + "; only out == out_a and lse == lse_a " +
                                "(same data and strides) may alias");
    }
  if (check::overlaps(out, lse))
    return invalid_argument(std::string(fn) + ": outputs out and lse overlap");

  const float* oa = out_a.ptr<const float>();
  const float* ob = out_b.ptr<const float>();
  float* o = out.ptr<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < seqlen_q; ++i) {
        auto lse_at = [&](const TensorView& t) -> float& {
          return t.ptr<float>()[b * t.strides[0] + h * t.strides[1] + i * t.strides[2]];
        };
        const double la = lse_at(lse_a), lb = lse_at(lse_b);
        // A NaN lse marks a poisoned row (an unmasked NaN upstream): keep it
        // NaN rather than letting the weights below read it as empty.
        const bool poisoned = std::isnan(la) || std::isnan(lb);
        const double m = std::max(la, lb);
        double wa = 0.0, wb = 0.0;
        if (!poisoned && m != -std::numeric_limits<double>::infinity()) {
          wa = la == m ? 1.0 : std::exp(la - m);
          wb = lb == m ? 1.0 : std::exp(lb - m);
        }
        const double denom = wa + wb;
        constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
        for (int64_t d = 0; d < dv; ++d) {
          const int64_t ia = b * out_a.strides[0] + i * out_a.strides[1] + h * out_a.strides[2] +
                             d * out_a.strides[3];
          const int64_t ib = b * out_b.strides[0] + i * out_b.strides[1] + h * out_b.strides[2] +
                             d * out_b.strides[3];
          const int64_t io =
              b * out.strides[0] + i * out.strides[1] + h * out.strides[2] + d * out.strides[3];
          // Skip a side with zero weight so that its (unread) rows cannot
          // inject NaN through 0 * NaN.
          double acc = 0.0;
          if (wa > 0.0) acc += wa * oa[ia];
          if (wb > 0.0) acc += wb * ob[ib];
          o[io] = poisoned ? kNaN : denom > 0.0 ? static_cast<float>(acc / denom) : 0.0f;
        }
        lse_at(lse) = poisoned      ? kNaN
                      : denom > 0.0 ? static_cast<float>(m + std::log(denom))
                                    : -std::numeric_limits<float>::infinity();
      }
  return Status::Ok();
}

}  // namespace attnkit
