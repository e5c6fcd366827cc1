// Bindings for attention on arrays: sdpa (MHA/MQA/GQA with FlashAttention's
// semantics, bf16 K/V, masks, block-sparse patterns, LSE and probabilities)
// and merge_attention_states. Inputs are viewed in place where they can be
// (numpy_util.h); compute runs without the GIL.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

py::object sdpa_py(py::object q, py::object k, py::object v, std::optional<double> softmax_scale,
                   bool causal, py::object window_size, double softcap, py::object seqlens_k,
                   bool return_lse, py::object mask, py::object sparse, bool return_probs,
                   const std::string& kv_dtype, const std::string& backend, int num_threads,
                   py::object sinks, int64_t chunk_size, py::object key_indices) {
  constexpr const char* kFn = "sdpa";
  const InputArray qi = f32_input(q, {kFn, "q", 4, 4, "[batch, seqlen_q, num_heads, head_dim]"});
  const InputArray ki = f32_input(k, {kFn, "k", 4, 4, "[batch, seqlen_k, num_kv_heads, head_dim]"});
  const InputArray vi =
      f32_input(v, {kFn, "v", 4, 4, "[batch, seqlen_k, num_kv_heads, head_dim_v]"});
  const DType kv = parse_cache_dtype(kv_dtype, kFn, "kv_dtype");

  InputArray mi;
  AttentionOptions opt = parse_sdpa_options(kFn, softmax_scale, causal, window_size, softcap, mask,
                                            sparse, backend, num_threads, &mi);
  const std::vector<int32_t> lens = parse_seqlens_k(seqlens_k, kFn);
  opt.seqlens_k = lens;
  InputArray si;
  parse_sinks_and_chunk(sinks, chunk_size, kFn, &opt, &si);
  InputArray ii;
  if (!key_indices.is_none()) {
    ii = typed_input(key_indices, {kFn, "key_indices", 3, 3, "[batch, seqlen_q, topk]"},
                     DType::kI32, "iu");
    opt.key_indices = ii.view;
  }

  const TensorView &qv = qi.view, &kv_view = ki.view, &vv = vi.view;
  TensorView out, lse, probs;
  py::array out_a =
      new_array(DType::kF32, {qv.shape[0], qv.shape[1], qv.shape[2], vv.shape[3]}, &out);
  py::array lse_a, probs_a;
  if (return_lse) lse_a = new_array(DType::kF32, {qv.shape[0], qv.shape[2], qv.shape[1]}, &lse);
  if (return_probs)
    probs_a =
        new_array(DType::kF32, {qv.shape[0], qv.shape[2], qv.shape[1], kv_view.shape[1]}, &probs);
  Status st;
  {
    py::gil_scoped_release nogil;
    if (kv == DType::kBF16) {
      Result<Tensor> kb = Tensor::zeros(DType::kBF16, kv_view.shape.data(), 4);
      Result<Tensor> vb = Tensor::zeros(DType::kBF16, vv.shape.data(), 4);
      if (!kb.ok()) {
        st = kb.status();
      } else if (!vb.ok()) {
        st = vb.status();
      } else {
        round_to_bf16(kv_view, kb->ptr<bf16>());
        round_to_bf16(vv, vb->ptr<bf16>());
        st = attnkit::sdpa(qv, kb->view(), vb->view(), out, opt, lse, probs);
      }
    } else if (kv == DType::kI8 || kv == DType::kFp8E4M3) {
      // Each row of each kv head quantized as a KVCache stores it.
      const int64_t* ks = kv_view.shape.data();
      const int64_t* vs = vv.shape.data();
      Result<Tensor> kc = Tensor::zeros(kv, ks, 4), vc = Tensor::zeros(kv, vs, 4);
      Result<Tensor> ksc = Tensor::zeros(DType::kF32, {ks[0], ks[1], ks[2], 1});
      Result<Tensor> vsc = Tensor::zeros(DType::kF32, {vs[0], vs[1], vs[2], 1});
      for (const Result<Tensor>* t : {&kc, &vc, &ksc, &vsc})
        if (st.ok() && !t->ok()) st = t->status();
      if (st.ok()) st = quantize_kv_rows(kv_view, kc->view(), ksc->view());
      if (st.ok()) st = quantize_kv_rows(vv, vc->view(), vsc->view());
      if (st.ok()) {
        opt.k_scales = ksc->view();
        opt.v_scales = vsc->view();
        st = attnkit::sdpa(qv, kc->view(), vc->view(), out, opt, lse, probs);
      }
    } else {
      st = attnkit::sdpa(qv, kv_view, vv, out, opt, lse, probs);
    }
  }
  throw_if_error(st);
  if (!return_lse && !return_probs) return out_a;
  if (return_lse && return_probs) return py::make_tuple(out_a, lse_a, probs_a);
  return py::make_tuple(out_a, return_lse ? lse_a : probs_a);
}

py::tuple merge_py(py::object out_a, py::object lse_a, py::object out_b, py::object lse_b) {
  constexpr const char* kFn = "merge_attention_states";
  const char* o_shape = "[batch, seqlen_q, num_heads, head_dim_v]";
  const char* l_shape = "[batch, num_heads, seqlen_q]";
  const InputArray oa = f32_input(out_a, {kFn, "out_a", 4, 4, o_shape});
  const InputArray la = f32_input(lse_a, {kFn, "lse_a", 3, 3, l_shape});
  const InputArray ob = f32_input(out_b, {kFn, "out_b", 4, 4, o_shape});
  const InputArray lb = f32_input(lse_b, {kFn, "lse_b", 3, 3, l_shape});
  const TensorView& o = oa.view;
  TensorView out, lse;
  py::array out_arr =
      new_array(DType::kF32, {o.shape[0], o.shape[1], o.shape[2], o.shape[3]}, &out);
  py::array lse_arr = new_array(DType::kF32, {o.shape[0], o.shape[2], o.shape[1]}, &lse);
  Status st;
  {
    py::gil_scoped_release nogil;
    st = merge_attention_states(oa.view, la.view, ob.view, lb.view, out, lse);
  }
  throw_if_error(st);
  return py::make_tuple(out_arr, lse_arr);
}

constexpr const char* kSdpaDoc = R"doc(
Scaled dot-product attention (FlashAttention semantics) for MHA, MQA and GQA.

    q    [batch, seqlen_q, num_heads,    head_dim]
    k    [batch, seqlen_k, num_kv_heads, head_dim]
    v    [batch, seqlen_k, num_kv_heads, head_dim_v]
    ->   out [batch, seqlen_q, num_heads, head_dim_v] float32

num_kv_heads must divide num_heads; query head h reads kv head
h // (num_heads // num_kv_heads) (K/V are never repeated). float32 arrays
are used in place whatever their strides; other dtypes are converted.

Keyword arguments:
    softmax_scale: multiplies q.k; None = 1/sqrt(head_dim).
    causal: bottom-right aligned causal mask (query row i sits at key
        position i + L - seqlen_q, L = valid keys of that batch item).
    window_size: (left, right) inclusive sliding window; -1 = unlimited.
    softcap: > 0 applies s = softcap * tanh(s / softcap) (Gemma-2); 0 = off.
    seqlens_k: int [batch], valid keys per batch item (the rest are
        padding and are never read).
    mask: bool (True = attend) or float (added to the scores), numpy-
        broadcastable to [batch, num_heads, seqlen_q, seqlen_k].
    sparse: Sparse Transformer pattern, {"kind": "strided"|"fixed",
        "stride": l, "summary": c, "block_size": b}.
    return_lse: also return lse [batch, num_heads, seqlen_q] (natural log).
    return_probs: also return probs [batch, num_heads, seqlen_q, seqlen_k].
    kv_dtype: "float32", or "bfloat16" to round K/V to bf16 storage first, or
              "int8" / "fp8_e4m3" to quantize each row of each kv head as an
              8-bit KVCache stores it (one float32 scale per row)
        (numpy has no bfloat16; this exercises the bf16 K/V kernels).
    backend: "auto" | "reference" | "fast".
    num_threads: 0 = ATTNKIT_NUM_THREADS or all cores.
    sinks: float [num_heads], one learned logit per query head (gpt-oss;
        FlashAttention's and FlashInfer's `sinks`): it joins every row's
        softmax denominator and is dropped, out = sum_j e^s_j v_j /
        (sum_j e^s_j + e^sink); lse includes it; probs exclude it (a row
        sums to less than 1). Each value finite.
    chunk_size: chunked local attention (Llama 4): a query at key position
        p sees key j only when j // chunk_size == p // chunk_size; 0 = off.
    key_indices: int32 [batch, seqlen_q, topk] (FlashMLA's sparse
        interface, DeepSeek-V3.2's DSA): row i attends to exactly the keys
        it names, -1 = an unused slot; each in [0, seqlen_k) and <= the
        row's position when causal. Keys are read in place. mask, sparse,
        window_size, chunk_size, sinks and return_probs must then be unset.

Returns out; (out, lse) or (out, probs) with one flag; (out, lse, probs)
with both. A row that sees no key gets out = 0, lse = -inf (with sinks:
lse = the head's sink), probs = 0.
Raises ValueError naming the argument on any invalid input.
)doc";

constexpr const char* kMergeDoc = R"doc(
Merges two partial attentions over disjoint key sets (FlashInfer's
merge_state) into the attention over their union.

    out_a, out_b  [batch, seqlen_q, num_heads, head_dim_v]
    lse_a, lse_b  [batch, num_heads, seqlen_q]   (as returned by sdpa)
    -> (out [batch, seqlen_q, num_heads, head_dim_v],
        lse [batch, num_heads, seqlen_q])   float32, new arrays
)doc";

}  // namespace

void bind_sdpa(py::module_& m) {
  m.def("sdpa", &sdpa_py, py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(),
        py::arg("softmax_scale") = py::none(), py::arg("causal") = false,
        py::arg("window_size") = py::make_tuple(-1, -1), py::arg("softcap") = 0.0,
        py::arg("seqlens_k") = py::none(), py::arg("return_lse") = false,
        py::arg("mask") = py::none(), py::arg("sparse") = py::none(),
        py::arg("return_probs") = false, py::arg("kv_dtype") = "float32",
        py::arg("backend") = "auto", py::arg("num_threads") = 0, py::arg("sinks") = py::none(),
        py::arg("chunk_size") = 0, py::arg("key_indices") = py::none(), kSdpaDoc);
  m.def("merge_attention_states", &merge_py, py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"),
        py::arg("lse_b"), kMergeDoc);
}

}  // namespace attnkit::python
