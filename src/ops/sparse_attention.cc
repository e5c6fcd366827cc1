// Public indexer_quantize() and lightning_indexer_topk(): validate every
// argument, fill the kernel params, dispatch (kernels/sparse.h). Nothing is
// written before validation passes.
#include "attnkit/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/check.h"
#include "core/threads.h"
#include "kernels/sparse.h"
#include "ops/attention_checks.h"

namespace attnkit {
namespace {

constexpr const char* kQuantize = "indexer_quantize";
constexpr const char* kIndexer = "lightning_indexer_topk";

kernels::Strides3 strides3(const TensorView& v) {
  return {v.strides[0], v.strides[1], v.strides[2]};
}

Status check_block_dim(const char* fn, const char* name, int64_t dim) {
  if (dim >= kIndexerBlock && dim % kIndexerBlock == 0) return Status::Ok();
  return invalid_argument(std::string(fn) + ": " + name + " = " + std::to_string(dim) +
                          " must be a positive multiple of 128 (one fp8 scale per 128 values)");
}

// Every value of a float view is finite (and > 0 when positive).
Status check_values(const char* fn, const char* name, const TensorView& v, bool positive) {
  const int64_t n = v.numel();
  // A contiguous view (every cached token's key scale, in a decode step):
  // first one pass over the bits without a branch per element, which the
  // compiler vectorizes (finite and > 0: bits - 1 < 0x7f7fffff, as
  // unsigned; finite: |bits| < 0x7f800000); the loop below runs to name
  // the first bad value only when there is one.
  const bool flat = v.is_contiguous();
  if (flat) {
    const float* x = v.ptr<const float>();
    uint32_t bad = 0;
    for (int64_t e = 0; e < n; ++e) {
      uint32_t bits;
      std::memcpy(&bits, x + e, sizeof bits);
      bad |= positive ? static_cast<uint32_t>(bits - 1u >= 0x7f7fffffu)
                      : static_cast<uint32_t>((bits & 0x7fffffffu) >= 0x7f800000u);
    }
    if (bad == 0) return Status::Ok();
  }
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = flat ? e : 0, rest = e;
    for (int a = v.rank - 1; a >= 0 && !flat; --a) {
      off += (rest % v.shape[a]) * v.strides[a];
      rest /= v.shape[a];
    }
    const float x = v.ptr<const float>()[off];
    if (!std::isfinite(x) || (positive && !(x > 0.0f)))
      return invalid_argument(std::string(fn) + ": " + name + " holds " + std::to_string(x) +
                              " (element " + std::to_string(e) + "); every value must be finite" +
                              (positive ? " and > 0" : ""));
  }
  return Status::Ok();
}

}  // namespace

Status indexer_quantize(const TensorView& x, const TensorView& codes, const TensorView& scales,
                        bool ue8m0) {
  ATTNKIT_RETURN_IF_ERROR(check::view(kQuantize, "x", x, 2, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kQuantize, "codes", codes, 2, {DType::kFp8E4M3}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kQuantize, "scales", scales, 2, {DType::kF32}));
  const int64_t rows = x.shape[0], dim = x.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check_block_dim(kQuantize, "x.shape[1]", dim));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kQuantize, "codes", codes, 0, "rows", rows, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kQuantize, "codes", codes, 1, "dim", dim, "x.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kQuantize, "scales", scales, 0, "rows", rows, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kQuantize, "scales", scales, 1, "dim / 128",
                                     dim / kIndexerBlock, "x.shape[1] / 128"));
  if (codes.strides[1] != 1 || scales.strides[1] != 1)
    return invalid_argument(std::string(kQuantize) +
                            ": codes and scales need unit stride along their last axis");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kQuantize, "codes", codes));
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kQuantize, "scales", scales));
  if (check::overlaps(codes, x) || check::overlaps(scales, x) || check::overlaps(codes, scales))
    return invalid_argument(std::string(kQuantize) + ": codes, scales and x must not overlap");
  ATTNKIT_RETURN_IF_ERROR(check_values(kQuantize, "x", x, false));
  for (int64_t r = 0; r < rows; ++r)
    kernels::indexer_quantize_row(x.ptr<const float>() + r * x.strides[0], x.strides[1], dim, ue8m0,
                                  codes.ptr<uint8_t>() + r * codes.strides[0],
                                  scales.ptr<float>() + r * scales.strides[0]);
  return Status::Ok();
}

Status lightning_indexer_topk(const TensorView& q_codes, const TensorView& q_scales,
                              const TensorView& weights, const TensorView& k_codes,
                              const TensorView& k_scales, int64_t topk, const TensorView& indices,
                              const TensorView& scores, const IndexerOptions& options) {
  const char* fn = kIndexer;
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "q_codes", q_codes, 4, {DType::kFp8E4M3}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "q_scales", q_scales, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "weights", weights, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "k_codes", k_codes, 3, {DType::kFp8E4M3}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "k_scales", k_scales, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "indices", indices, 3, {DType::kI32}));
  const int64_t B = q_codes.shape[0], T = q_codes.shape[1], H = q_codes.shape[2],
                D = q_codes.shape[3], S = k_codes.shape[1];
  // A decode step over many keys starts its scoring threads after the
  // checks below (a scan of every key scale) and the query's packing:
  // their wake-up overlaps those now.
  if (S > topk) parallel_prewake(resolve_num_threads(std::max(options.num_threads, 0)));
  ATTNKIT_RETURN_IF_ERROR(check_block_dim(fn, "q_codes.shape[3] (head_dim)", D));
  const std::string f = fn;
  if (topk < 1)
    return invalid_argument(f + ": topk = " + std::to_string(topk) +
                            " must be >= 1 (the keys each query keeps)");
  if (T > S)
    return invalid_argument(f + ": seqlen_q = " + std::to_string(T) +
                            " must be <= seqlen_k = " + std::to_string(S) +
                            " (the queries are the last seqlen_q of the keys' tokens)");
  const struct {
    const char* name;
    const TensorView& v;
    int axis;
    const char* what;
    int64_t want;
    const char* src;
  } dims[] = {
      {"q_scales", q_scales, 0, "batch", B, "q_codes.shape[0]"},
      {"q_scales", q_scales, 1, "seqlen_q", T, "q_codes.shape[1]"},
      {"q_scales", q_scales, 2, "n_heads", H, "q_codes.shape[2]"},
      {"q_scales", q_scales, 3, "head_dim / 128", D / kIndexerBlock, "q_codes.shape[3] / 128"},
      {"weights", weights, 0, "batch", B, "q_codes.shape[0]"},
      {"weights", weights, 1, "seqlen_q", T, "q_codes.shape[1]"},
      {"weights", weights, 2, "n_heads", H, "q_codes.shape[2]"},
      {"k_codes", k_codes, 0, "batch", B, "q_codes.shape[0]"},
      {"k_codes", k_codes, 2, "head_dim", D, "q_codes.shape[3]"},
      {"k_scales", k_scales, 0, "batch", B, "q_codes.shape[0]"},
      {"k_scales", k_scales, 1, "seqlen_k", S, "k_codes.shape[1]"},
      {"k_scales", k_scales, 2, "head_dim / 128", D / kIndexerBlock, "q_codes.shape[3] / 128"},
      {"indices", indices, 0, "batch", B, "q_codes.shape[0]"},
      {"indices", indices, 1, "seqlen_q", T, "q_codes.shape[1]"},
      {"indices", indices, 2, "topk", topk, "topk"}};
  for (const auto& d : dims)
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, d.name, d.v, d.axis, d.what, d.want, d.src));
  if (scores.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(fn, "scores", scores, 3, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "scores", scores, 0, "batch", B, "q_codes.shape[0]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "scores", scores, 1, "seqlen_q", T, "q_codes.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "scores", scores, 2, "seqlen_k", S, "k_codes.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "scores", scores));
  }
  if (topk > (int64_t{1} << 30))
    return invalid_argument(f + ": topk = " + std::to_string(topk) + " must be <= 2^30");
  if (options.num_threads < 0)
    return invalid_argument(f + ": options.num_threads = " + std::to_string(options.num_threads) +
                            " must be >= 0 (0 = default)");
  if (options.backend != Backend::kAuto && options.backend != Backend::kReference &&
      options.backend != Backend::kFast)
    return invalid_argument(
        f + ": options.backend = " + std::to_string(static_cast<int>(options.backend)) +
        " is not a Backend value");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "indices", indices));
  const NamedView outputs[] = {{"indices", &indices}, {"scores", &scores}};
  const NamedView inputs[] = {{"q_codes", &q_codes},
                              {"q_scales", &q_scales},
                              {"weights", &weights},
                              {"k_codes", &k_codes},
                              {"k_scales", &k_scales}};
  ATTNKIT_RETURN_IF_ERROR(check_outputs_apart(fn, outputs, inputs));
  ATTNKIT_RETURN_IF_ERROR(check_values(fn, "weights", weights, false));
  ATTNKIT_RETURN_IF_ERROR(check_values(fn, "q_scales", q_scales, true));
  // The key scales (one per cached token and block, the longest of these
  // scans) of one query row are checked by the kernel as its scoring
  // threads read them (kernels/sparse.h), which writes nothing when one is
  // bad; this scan then names it. Every other call scans them here.
  const bool fold_k_scales = B * T == 1;
  if (!fold_k_scales) ATTNKIT_RETURN_IF_ERROR(check_values(fn, "k_scales", k_scales, true));

  kernels::IndexerParams p;
  p.batch = B;
  p.seqlen_q = T;
  p.seqlen_k = S;
  p.n_heads = H;
  p.head_dim = D;
  p.q_codes = q_codes.ptr<const uint8_t>();
  p.q_codes_stride = {q_codes.strides[0], q_codes.strides[1], q_codes.strides[2],
                      q_codes.strides[3]};
  p.q_scales = q_scales.ptr<const float>();
  p.q_scales_stride = {q_scales.strides[0], q_scales.strides[1], q_scales.strides[2],
                       q_scales.strides[3]};
  p.weights = weights.ptr<const float>();
  p.weights_stride = strides3(weights);
  p.k_codes = k_codes.ptr<const uint8_t>();
  p.k_codes_stride = strides3(k_codes);
  p.k_scales = k_scales.ptr<const float>();
  p.k_scales_stride = strides3(k_scales);
  p.topk = topk;
  p.indices = indices.ptr<int32_t>();
  p.indices_stride = strides3(indices);
  if (scores.present()) {
    p.scores = scores.ptr<float>();
    p.scores_stride = strides3(scores);
  }
  p.num_threads = options.num_threads;
  bool k_scales_bad = false;
  if (fold_k_scales) p.k_scales_bad = &k_scales_bad;
  ATTNKIT_RETURN_IF_ERROR(kernels::run_indexer(p, options.backend));
  if (!k_scales_bad) return Status::Ok();
  ATTNKIT_RETURN_IF_ERROR(check_values(fn, "k_scales", k_scales, true));
  return internal_error(f + ": the kernel refused a key scale that the check passes");
}

}  // namespace attnkit
