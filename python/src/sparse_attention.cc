// Bindings for DeepSeek-V3.2's lightning indexer (attnkit/sparse_attention.h):
// indexer_quantize (fp8 E4M3 codes with one scale per 128-value block) and
// lightning_indexer_topk (per-query scores and top-k key indices), the
// low-level pieces an engine combines with sdpa(..., key_indices=).
// numpy has no fp8: codes travel as uint8 arrays holding the E4M3 bits.
#include <algorithm>
#include <string>

#include "attnkit/sparse_attention.h"
#include "attnkit/tensor.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

py::tuple indexer_quantize_py(py::object x, bool ue8m0) {
  constexpr const char* kFn = "indexer_quantize";
  const InputArray xi = f32_input(x, {kFn, "x", 1, 4, "[..., dim]"});
  // The C++ call takes [rows, dim]: leading dimensions fold into rows, which
  // needs them contiguous; a strided input is copied once.
  const py::array_t<float, py::array::c_style | py::array::forcecast> xc(xi.array);
  const int rank = xi.view.rank;
  const int64_t dim = xi.view.shape[rank - 1];
  int64_t rows = 1;
  for (int i = 0; i + 1 < rank; ++i) rows *= xi.view.shape[i];
  const TensorView xv = make_view(xc.data(), DType::kF32, {rows, dim});

  std::vector<py::ssize_t> code_shape(xi.array.shape(), xi.array.shape() + rank);
  std::vector<py::ssize_t> scale_shape = code_shape;
  scale_shape.back() = dim / kIndexerBlock;
  py::array codes_a(py::dtype::of<uint8_t>(), code_shape);
  py::array scales_a(py::dtype::of<float>(), scale_shape);
  const TensorView cv = make_view(codes_a.mutable_data(), DType::kFp8E4M3, {rows, dim});
  const TensorView sv =
      make_view(scales_a.mutable_data(), DType::kF32, {rows, dim / kIndexerBlock});
  Status st;
  {
    py::gil_scoped_release nogil;
    st = indexer_quantize(xv, cv, sv, ue8m0);
  }
  throw_if_error(st);
  return py::make_tuple(codes_a, scales_a);
}

py::object lightning_indexer_topk_py(py::object q_codes, py::object q_scales, py::object weights,
                                     py::object k_codes, py::object k_scales, int64_t topk,
                                     bool return_scores, const std::string& backend,
                                     int num_threads) {
  constexpr const char* kFn = "lightning_indexer_topk";
  const InputArray qc =
      typed_input(q_codes, {kFn, "q_codes", 4, 4, "[batch, seqlen_q, n_heads, head_dim]"},
                  DType::kFp8E4M3, "u");
  const InputArray qs =
      f32_input(q_scales, {kFn, "q_scales", 4, 4, "[batch, seqlen_q, n_heads, head_dim / 128]"});
  const InputArray wi = f32_input(weights, {kFn, "weights", 3, 3, "[batch, seqlen_q, n_heads]"});
  const InputArray kc = typed_input(k_codes, {kFn, "k_codes", 3, 3, "[batch, seqlen_k, head_dim]"},
                                    DType::kFp8E4M3, "u");
  const InputArray ks =
      f32_input(k_scales, {kFn, "k_scales", 3, 3, "[batch, seqlen_k, head_dim / 128]"});
  IndexerOptions opt;
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;

  const int64_t B = qc.view.shape[0], T = qc.view.shape[1], S = kc.view.shape[1];
  // topk < 1 is refused by the C++ call, in its words; the array only needs
  // a valid shape until then.
  TensorView idx, scores;
  py::array idx_a = new_array(DType::kI32, {B, T, std::max<int64_t>(topk, 1)}, &idx);
  py::array scores_a;
  if (return_scores) scores_a = new_array(DType::kF32, {B, T, S}, &scores);
  Status st;
  {
    py::gil_scoped_release nogil;
    st =
        lightning_indexer_topk(qc.view, qs.view, wi.view, kc.view, ks.view, topk, idx, scores, opt);
  }
  throw_if_error(st);
  if (!return_scores) return idx_a;
  return py::make_tuple(idx_a, scores_a);
}

constexpr const char* kQuantizeDoc = R"doc(
Block fp8 quantization of the lightning indexer's queries and keys
(DeepSeek-V3.2's act_quant), one scale per 128 values of the last axis.

    x       float [..., dim]   finite, dim a multiple of 128
    -> (codes  uint8   [..., dim]          the fp8 E4M3 bits,
        scales float32 [..., dim / 128])

Per block: amax = max(max |x|, 1e-4); scale = amax / 448, rounded up to a
power of two when ue8m0 (DeepSeek-V3.2's default, "ue8m0" scales); code =
E4M3(x / scale), nearest with ties to even. x ~= decode(code) * scale.
Raises ValueError naming the argument on a non-finite value or a bad shape.
)doc";

constexpr const char* kTopkDoc = R"doc(
DeepSeek-V3.2's lightning indexer: scores every visible key for each query
and keeps the best topk.

    q_codes  uint8   [batch, seqlen_q, n_heads, head_dim]   fp8 E4M3 bits
    q_scales float32 [batch, seqlen_q, n_heads, head_dim / 128], > 0
    weights  float32 [batch, seqlen_q, n_heads]   per-head weights w_t,h
    k_codes  uint8   [batch, seqlen_k, head_dim]   one key per token
    k_scales float32 [batch, seqlen_k, head_dim / 128], > 0
    -> indices int32 [batch, seqlen_q, topk]; with return_scores also
       scores float32 [batch, seqlen_q, seqlen_k]

score(t, s) = sum_h w_t,h * ReLU(q_t,h . k_s), both dequantized (code *
block scale). Query t sees keys s <= seqlen_k - seqlen_q + t (bottom-right
causal). indices[b, t] holds the min(topk, visible) best keys in increasing
key order, then -1; equal scores go to the lower key. scores is -inf where
a key is not visible. Pass indices to sdpa(..., key_indices=) to attend.
The fast backend scores in float32, the reference in float64: keys whose
scores differ by less than ~1e-6 relative may be chosen differently.
)doc";

}  // namespace

void bind_sparse_attention(py::module_& m) {
  m.def("indexer_quantize", &indexer_quantize_py, py::arg("x"), py::kw_only(),
        py::arg("ue8m0") = true, kQuantizeDoc);
  m.def("lightning_indexer_topk", &lightning_indexer_topk_py, py::arg("q_codes"),
        py::arg("q_scales"), py::arg("weights"), py::arg("k_codes"), py::arg("k_scales"),
        py::arg("topk"), py::kw_only(), py::arg("return_scores") = false,
        py::arg("backend") = "auto", py::arg("num_threads") = 0, kTopkDoc);
}

}  // namespace attnkit::python
