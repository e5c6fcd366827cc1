// Bindings for the core API: sdpa and merge_attention_states, RoPE, the KV
// cache, the MHA/MQA/GQA attention layer and safetensors. Inputs are viewed
// in place where they can be (numpy_util.h); compute runs without the GIL;
// every failure raises with the C++ Status message.
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/config.h"
#include "attnkit/kv_cache.h"
#include "attnkit/rope.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

// Rounds f32 `src` (rank 4, any strides) into contiguous bf16 `dst`: K/V for
// sdpa's kv_dtype="bfloat16", since numpy has no bfloat16 to pass directly.
void round_to_bf16(const TensorView& src, bf16* dst) {
  const float* p = src.ptr<const float>();
  for (int64_t a = 0; a < src.shape[0]; ++a)
    for (int64_t b = 0; b < src.shape[1]; ++b)
      for (int64_t c = 0; c < src.shape[2]; ++c)
        for (int64_t d = 0; d < src.shape[3]; ++d)
          *dst++ = float_to_bf16(
              p[a * src.strides[0] + b * src.strides[1] + c * src.strides[2] + d * src.strides[3]]);
}

float parse_softmax_scale(const std::optional<double>& scale, const char* fn) {
  if (!scale) return 0.0f;  // the C++ API's "1/sqrt(head_dim)"
  const auto s = static_cast<float>(*scale);
  if (!(std::isfinite(s) && s > 0.0f))
    raise_value_error(fn, "softmax_scale = " + py::repr(py::float_(*scale)).cast<std::string>() +
                              " must be finite and > 0 (None = 1/sqrt(head_dim))");
  return s;
}

py::object sdpa_py(py::object q, py::object k, py::object v, std::optional<double> softmax_scale,
                   bool causal, py::object window_size, double softcap, py::object seqlens_k,
                   bool return_lse, py::object mask, py::object sparse, bool return_probs,
                   const std::string& kv_dtype, const std::string& backend, int num_threads) {
  constexpr const char* kFn = "sdpa";
  const InputArray qi = f32_input(q, {kFn, "q", 4, 4, "[batch, seqlen_q, num_heads, head_dim]"});
  const InputArray ki = f32_input(k, {kFn, "k", 4, 4, "[batch, seqlen_k, num_kv_heads, head_dim]"});
  const InputArray vi =
      f32_input(v, {kFn, "v", 4, 4, "[batch, seqlen_k, num_kv_heads, head_dim_v]"});
  const DType kv = parse_cache_dtype(kv_dtype, kFn, "kv_dtype");

  AttentionOptions opt;
  opt.softmax_scale = parse_softmax_scale(softmax_scale, kFn);
  opt.causal = causal;
  opt.window_size = parse_window_size(window_size, kFn);
  opt.softcap = static_cast<float>(softcap);
  const std::vector<int32_t> lens = parse_seqlens_k(seqlens_k, kFn);
  opt.seqlens_k = lens;
  InputArray mi;
  if (!mask.is_none()) {
    mi = mask_input(mask, kFn);
    opt.mask = mi.view;
  }
  opt.sparse = parse_sparse(sparse, kFn);
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;

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
    kv_dtype: "float32", or "bfloat16" to round K/V to bf16 storage first
        (numpy has no bfloat16; this exercises the bf16 K/V kernels).
    backend: "auto" | "reference" | "fast".
    num_threads: 0 = ATTNKIT_NUM_THREADS or all cores.

Returns out; (out, lse) or (out, probs) with one flag; (out, lse, probs)
with both. A row that sees no key gets out = 0, lse = -inf, probs = 0.
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

// ---------------------------------------------------------------- RoPE

const char* rope_type_name(RopeScaling::Type t) {
  switch (t) {
    case RopeScaling::Type::kNone:
      return "default";
    case RopeScaling::Type::kLinear:
      return "linear";
    case RopeScaling::Type::kLlama3:
      return "llama3";
    case RopeScaling::Type::kYarn:
      return "yarn";
  }
  return "default";
}

// A Hugging Face rope_scaling dict: {"rope_type" (or "type"): "default" |
// "linear" | "llama3" | "yarn", "factor", "low_freq_factor",
// "high_freq_factor", "original_max_position_embeddings", "beta_fast",
// "beta_slow", "mscale", "mscale_all_dim", "attention_factor"}; None values
// count as absent. Unknown keys are errors (a typo would otherwise be
// silently ignored); range checks are Rope::create's.
RopeScaling parse_rope_scaling(py::handle obj, const char* fn) {
  RopeScaling s;
  if (obj.is_none()) return s;
  if (!py::isinstance<py::dict>(obj))
    raise_value_error(fn, "scaling must be None or a Hugging Face rope_scaling dict, got " +
                              py::repr(obj).cast<std::string>());
  const py::dict d = py::reinterpret_borrow<py::dict>(obj);
  bool has_type = false;
  for (auto item : d) {
    const std::string key = py::str(item.first).cast<std::string>();
    const py::handle val = item.second;
    const std::string what = "scaling['" + key + "']";
    if (val.is_none()) continue;
    if (key == "rope_type" || key == "type") {
      const std::string t = py::str(val).cast<std::string>();
      RopeScaling::Type type;
      if (t == "default")
        type = RopeScaling::Type::kNone;
      else if (t == "linear")
        type = RopeScaling::Type::kLinear;
      else if (t == "llama3")
        type = RopeScaling::Type::kLlama3;
      else if (t == "yarn")
        type = RopeScaling::Type::kYarn;
      else
        raise_value_error(
            fn, what + " = '" + t + "' is not supported; supported: default, linear, llama3, yarn");
      if (has_type && type != s.type)
        raise_value_error(fn, "scaling['rope_type'] and scaling['type'] disagree");
      s.type = type;
      has_type = true;
    } else if (key == "factor") {
      s.factor = checked_float(val, fn, what);
    } else if (key == "low_freq_factor") {
      s.low_freq_factor = checked_float(val, fn, what);
    } else if (key == "high_freq_factor") {
      s.high_freq_factor = checked_float(val, fn, what);
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings = checked_int(val, fn, what);
    } else if (key == "beta_fast") {
      s.beta_fast = checked_float(val, fn, what);
    } else if (key == "beta_slow") {
      s.beta_slow = checked_float(val, fn, what);
    } else if (key == "mscale") {
      s.mscale = checked_float(val, fn, what);
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = checked_float(val, fn, what);
    } else if (key == "attention_factor") {
      s.attention_factor = checked_float(val, fn, what);
    } else if (key == "truncate") {
      // Hugging Face's default; the untruncated YaRN ramp is not implemented.
      if (PyObject_IsTrue(val.ptr()) != 1)
        raise_value_error(fn, "scaling['truncate'] = False is not supported (only True)");
    } else {
      raise_value_error(fn, "scaling has unknown key '" + key +
                                "'; known: rope_type (or type), factor, low_freq_factor, "
                                "high_freq_factor, original_max_position_embeddings, beta_fast, "
                                "beta_slow, mscale, mscale_all_dim, attention_factor, truncate");
    }
  }
  if (!has_type && !d.empty())
    raise_value_error(fn,
                      "scaling['rope_type'] is missing; must be default, linear, llama3 or yarn");
  return s;
}

py::object scaling_to_dict(const RopeScaling& s) {
  if (s.type == RopeScaling::Type::kNone) return py::none();
  py::dict d;
  d["rope_type"] = rope_type_name(s.type);
  d["factor"] = s.factor;
  if (s.type == RopeScaling::Type::kLlama3) {
    d["low_freq_factor"] = s.low_freq_factor;
    d["high_freq_factor"] = s.high_freq_factor;
  }
  if (s.type != RopeScaling::Type::kLinear)
    d["original_max_position_embeddings"] = s.original_max_position_embeddings;
  if (s.type == RopeScaling::Type::kYarn) {
    d["beta_fast"] = s.beta_fast;
    d["beta_slow"] = s.beta_slow;
    d["mscale"] = s.mscale;
    d["mscale_all_dim"] = s.mscale_all_dim;
    d["attention_factor"] = s.attention_factor;
  }
  return d;
}

py::dict rope_config_to_dict(const RopeConfig& c) {
  py::dict d;
  d["head_dim"] = c.head_dim;
  d["rotary_dim"] = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  d["theta"] = c.theta;
  d["interleaved"] = c.pairing == RopePairing::kInterleaved;
  d["scaling"] = scaling_to_dict(c.scaling);
  return d;
}

Rope make_rope(const char* fn, int64_t head_dim, double theta, std::optional<int64_t> rotary_dim,
               bool interleaved, py::handle scaling) {
  RopeConfig c;
  c.head_dim = head_dim;
  if (rotary_dim) {
    // The C++ API reads 0 as "head_dim"; in Python that is spelled None.
    if (*rotary_dim <= 0)
      raise_value_error(
          fn, "rotary_dim = " + std::to_string(*rotary_dim) + " must be > 0 (None = head_dim)");
    c.rotary_dim = *rotary_dim;
  }
  c.theta = theta;
  c.pairing = interleaved ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
  c.scaling = parse_rope_scaling(scaling, fn);
  return value_or_throw(Rope::create(c));
}

// A rotated copy of x [batch, seq, heads, head_dim]; x itself is not touched.
py::array rope_apply(const Rope& rope, const char* fn, py::handle x, py::handle positions) {
  const InputArray xi = f32_input(x, {fn, "x", 4, 4, "[batch, seq, heads, head_dim]"});
  std::vector<int64_t> pos = parse_positions(positions, fn);
  if (positions.is_none())
    for (int64_t t = 0; t < xi.view.shape[1]; ++t) pos.push_back(t);
  py::array out = copy_to_numpy(xi.view);
  TensorView ov = xi.view;
  ov.data = out.mutable_data();
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    ov.strides[i] = stride;
    stride *= ov.shape[i];
  }
  Status st;
  {
    py::gil_scoped_release nogil;
    st = rope.apply(ov, pos);
  }
  throw_if_error(st);
  return out;
}

constexpr const char* kRopeDoc = R"doc(
Rotary position embedding with Hugging Face's frequency formulas.

    Rope(head_dim, theta=10000.0, rotary_dim=None, interleaved=False, scaling=None)

head_dim: features per head; rotary_dim: the first rotary_dim features are
rotated (even, <= head_dim; None = head_dim), the rest pass through.
interleaved=False pairs feature i with i + rotary_dim/2 (GPT-NeoX / HF
rotate_half); True pairs (2i, 2i+1) (GPT-J / Meta / DeepSeek).
scaling: a HF rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0,
"low_freq_factor": 1.0, "high_freq_factor": 4.0,
"original_max_position_embeddings": 8192}; "linear" and "yarn" too.

Attributes: inv_freq (float64 [rotary_dim/2], after scaling),
attention_factor (YaRN's cos/sin multiplier, else 1.0), config (dict).
)doc";

constexpr const char* kRopeApplyDoc = R"doc(
Returns a rotated copy of x; x is not modified.

    x          [batch, seq, heads, head_dim]  (float32; other dtypes converted)
    positions  int [seq] (shared by the batch) or [batch, seq]; None = 0..seq-1
    -> float32 [batch, seq, heads, head_dim]
)doc";

constexpr const char* kApplyRopeDoc = R"doc(
Rotary position embedding of x, returned as a new array (x is not modified).

    x          [batch, seq, heads, head_dim]  (float32; other dtypes converted)
    positions  int [seq] (shared by the batch) or [batch, seq]; None = 0..seq-1
    -> float32 [batch, seq, heads, head_dim]

theta: rope_theta. rotary_dim: rotate only the first rotary_dim features
(None = head_dim). interleaved: pair (2i, 2i+1) instead of (i, i + r/2).
scaling: a Hugging Face rope_scaling dict ("linear", "llama3", "yarn").
See attnkit.Rope for the frequencies themselves.
)doc";

void bind_rope(py::module_& m) {
  py::class_<Rope>(m, "Rope", kRopeDoc)
      .def(py::init([](int64_t head_dim, double theta, std::optional<int64_t> rotary_dim,
                       bool interleaved, py::object scaling) {
             return make_rope("Rope", head_dim, theta, rotary_dim, interleaved, scaling);
           }),
           py::arg("head_dim"), py::arg("theta") = 10000.0, py::arg("rotary_dim") = py::none(),
           py::arg("interleaved") = false, py::arg("scaling") = py::none())
      .def_property_readonly(
          "inv_freq",
          [](const Rope& r) {
            return py::array_t<double>(static_cast<py::ssize_t>(r.inv_freq().size()),
                                       r.inv_freq().data());
          },
          "float64 [rotary_dim / 2]: inverse frequencies after scaling (a copy)")
      .def_property_readonly("attention_factor", &Rope::attention_factor,
                             "cos/sin multiplier: YaRN's mscale ratio, 1.0 otherwise")
      .def_property_readonly("rotary_dim", &Rope::rotary_dim)
      .def_property_readonly(
          "config", [](const Rope& r) { return rope_config_to_dict(r.config()); },
          "dict: head_dim, rotary_dim, theta, interleaved, scaling")
      .def(
          "apply",
          [](const Rope& r, py::object x, py::object positions) {
            return rope_apply(r, "Rope.apply", x, positions);
          },
          py::arg("x"), py::arg("positions") = py::none(), kRopeApplyDoc)
      .def("__repr__", [](const Rope& r) {
        return "Rope(" + py::repr(rope_config_to_dict(r.config())).cast<std::string>() + ")";
      });
  m.def(
      "apply_rope",
      [](py::object x, py::object positions, double theta, std::optional<int64_t> rotary_dim,
         bool interleaved, py::object scaling) {
        const InputArray xi =
            f32_input(x, {"apply_rope", "x", 4, 4, "[batch, seq, heads, head_dim]"});
        const Rope rope =
            make_rope("apply_rope", xi.view.shape[3], theta, rotary_dim, interleaved, scaling);
        return rope_apply(rope, "apply_rope", xi.array, positions);
      },
      py::arg("x"), py::arg("positions") = py::none(), py::arg("theta") = 10000.0,
      py::arg("rotary_dim") = py::none(), py::arg("interleaved") = false,
      py::arg("scaling") = py::none(), kApplyRopeDoc);
}

// ---------------------------------------------------------------- KV cache

// A KVCache shared with Python. Compute runs without the GIL, so two Python
// threads could reach the same cache at once; `mu` serialises every access
// (taken only after the GIL is released, so waiting never blocks Python).
struct PyKVCache {
  explicit PyKVCache(KVCache c) : cache(std::move(c)) {}
  KVCache cache;
  std::mutex mu;
};

// Runs f() holding `mu` with the GIL released.
template <typename F>
auto locked(std::mutex& mu, F&& f) {
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(mu);
  return f();
}

// The held tokens of keys (or values) in position order, oldest first, as
// float32 [batch, stored, num_kv_heads, dim] (bf16 storage widened exactly).
py::array cache_tokens(PyKVCache& c, bool keys) {
  struct Snapshot {
    Result<Tensor> data = Status(StatusCode::kInternal, "unset");
    int64_t stored = 0;
  };
  Snapshot snap = locked(c.mu, [&] {
    Snapshot s;
    const KVCache& kv = c.cache;
    const TensorView& src = keys ? kv.keys() : kv.values();
    s.stored = kv.stored();
    s.data = Tensor::zeros(DType::kF32, {src.shape[0], s.stored, src.shape[2], src.shape[3]});
    if (!s.data.ok()) return s;
    // Token t lives in slot t mod slots (t mod max_seq_len = t without a window).
    const int64_t first = kv.length() - s.stored;
    float* dst = s.data->ptr<float>();
    for (int64_t b = 0; b < src.shape[0]; ++b)
      for (int64_t t = 0; t < s.stored; ++t) {
        const int64_t slot = (first + t) % kv.slots();
        const int64_t base = b * src.strides[0] + slot * src.strides[1];
        for (int64_t h = 0; h < src.shape[2]; ++h)
          for (int64_t d = 0; d < src.shape[3]; ++d) {
            const int64_t i = base + h * src.strides[2] + d * src.strides[3];
            *dst++ = src.dtype == DType::kBF16 ? bf16_to_float(src.ptr<const bf16>()[i])
                                               : src.ptr<const float>()[i];
          }
      }
    return s;
  });
  const Tensor t = value_or_throw(std::move(snap.data));
  return copy_to_numpy(t.view());
}

py::array cache_attend(PyKVCache& c, py::object q, py::object k_new, py::object v_new,
                       std::optional<double> softmax_scale, double softcap, py::object sparse,
                       const std::string& backend, int num_threads) {
  constexpr const char* kFn = "KVCache.attend";
  const InputArray qi = f32_input(q, {kFn, "q", 4, 4, "[batch, T, num_heads, head_dim]"});
  const InputArray ki =
      f32_input(k_new, {kFn, "k_new", 4, 4, "[batch, T, num_kv_heads, head_dim]"});
  const InputArray vi =
      f32_input(v_new, {kFn, "v_new", 4, 4, "[batch, T, num_kv_heads, head_dim_v]"});
  AttentionOptions opt;
  opt.softmax_scale = parse_softmax_scale(softmax_scale, kFn);
  opt.softcap = static_cast<float>(softcap);
  opt.sparse = parse_sparse(sparse, kFn);
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;
  TensorView out;
  py::array out_a = new_array(
      DType::kF32, {qi.view.shape[0], qi.view.shape[1], qi.view.shape[2], vi.view.shape[3]}, &out);
  throw_if_error(locked(c.mu, [&] { return c.cache.attend(qi.view, ki.view, vi.view, out, opt); }));
  return out_a;
}

constexpr const char* kKVCacheDoc = R"doc(
Key/value cache of one MHA/MQA/GQA layer for incremental decoding.

    KVCache(batch_size, max_seq_len, num_kv_heads, head_dim, head_dim_v=None,
            dtype="float32", sliding_window=0)

Stores K [batch, slots, num_kv_heads, head_dim] and V [..., head_dim_v] as
float32 or bfloat16. Without a window slots = max_seq_len; with a sliding
window W (each token sees itself and W-1 before it) slots = min(max_seq_len,
W-1), a ring buffer. All sequences advance together. Usually made by
AttentionLayer.new_cache.
)doc";

constexpr const char* kAttendDoc = R"doc(
Appends T new tokens and attends the T queries as the continuation of a
causal sequence (query t sits at position length + t).

    q      [batch, T, num_heads,    head_dim]
    k_new  [batch, T, num_kv_heads, head_dim]
    v_new  [batch, T, num_kv_heads, head_dim_v]
    -> out [batch, T, num_heads, head_dim_v] float32

On success length grows by T; on any error (including overflowing
max_seq_len) the cache is unchanged.
)doc";

void bind_kv_cache(py::module_& m) {
  py::class_<PyKVCache>(m, "KVCache", kKVCacheDoc)
      .def(py::init([](int64_t batch_size, int64_t max_seq_len, int64_t num_kv_heads,
                       int64_t head_dim, std::optional<int64_t> head_dim_v,
                       const std::string& dtype, int64_t sliding_window) {
             KVCacheSpec spec;
             spec.batch_size = batch_size;
             spec.max_seq_len = max_seq_len;
             spec.num_kv_heads = num_kv_heads;
             spec.head_dim = head_dim;
             spec.head_dim_v = head_dim_v.value_or(head_dim);
             spec.dtype = parse_cache_dtype(dtype, "KVCache");
             spec.sliding_window = sliding_window;
             return std::make_unique<PyKVCache>(value_or_throw(KVCache::create(spec)));
           }),
           py::arg("batch_size"), py::arg("max_seq_len"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("head_dim_v") = py::none(), py::arg("dtype") = "float32",
           py::arg("sliding_window") = 0)
      .def_property_readonly(
          "length", [](PyKVCache& c) { return locked(c.mu, [&] { return c.cache.length(); }); },
          "tokens appended so far (the next token's position)")
      .def_property_readonly(
          "stored", [](PyKVCache& c) { return locked(c.mu, [&] { return c.cache.stored(); }); },
          "tokens currently held: min(length, slots)")
      .def_property_readonly(
          "slots", [](PyKVCache& c) { return c.cache.slots(); }, "tokens the storage holds")
      .def_property_readonly(
          "nbytes", [](PyKVCache& c) { return c.cache.nbytes(); },
          "bytes of the K and V values the cache holds (the KV memory formula)")
      .def_property_readonly(
          "storage_nbytes", [](PyKVCache& c) { return c.cache.storage_nbytes(); },
          "bytes allocated for K and V: nbytes plus one 64-byte line per token row whose "
          "size is a multiple of 2 KiB")
      .def_property_readonly("dtype",
                             [](PyKVCache& c) { return cache_dtype_name(c.cache.spec().dtype); })
      .def_property_readonly("batch_size", [](PyKVCache& c) { return c.cache.spec().batch_size; })
      .def_property_readonly("max_seq_len", [](PyKVCache& c) { return c.cache.spec().max_seq_len; })
      .def_property_readonly("num_kv_heads",
                             [](PyKVCache& c) { return c.cache.spec().num_kv_heads; })
      .def_property_readonly("head_dim", [](PyKVCache& c) { return c.cache.spec().head_dim; })
      .def_property_readonly("head_dim_v",
                             [](PyKVCache& c) {
                               const KVCacheSpec& s = c.cache.spec();
                               return s.head_dim_v == 0 ? s.head_dim : s.head_dim_v;
                             })
      .def_property_readonly("sliding_window",
                             [](PyKVCache& c) { return c.cache.spec().sliding_window; })
      .def(
          "reset", [](PyKVCache& c) { locked(c.mu, [&] { c.cache.reset(); }); },
          "Forgets every token (storage is kept).")
      .def(
          "keys", [](PyKVCache& c) { return cache_tokens(c, true); },
          "Copy of the held keys, oldest first: float32 [batch, stored, num_kv_heads, head_dim].")
      .def(
          "values", [](PyKVCache& c) { return cache_tokens(c, false); },
          "Copy of the held values, oldest first: float32 [batch, stored, num_kv_heads, "
          "head_dim_v].")
      .def("attend", &cache_attend, py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::kw_only(),
           py::arg("softmax_scale") = py::none(), py::arg("softcap") = 0.0,
           py::arg("sparse") = py::none(), py::arg("backend") = "auto", py::arg("num_threads") = 0,
           kAttendDoc)
      .def("__repr__", [](PyKVCache& c) {
        const KVCacheSpec& s = c.cache.spec();
        const int64_t length = locked(c.mu, [&] { return c.cache.length(); });
        return "KVCache(length=" + std::to_string(length) +
               ", batch_size=" + std::to_string(s.batch_size) +
               ", max_seq_len=" + std::to_string(s.max_seq_len) +
               ", num_kv_heads=" + std::to_string(s.num_kv_heads) +
               ", head_dim=" + std::to_string(s.head_dim) + ", dtype='" +
               cache_dtype_name(s.dtype) + "', sliding_window=" + std::to_string(s.sliding_window) +
               ")";
      });
}

// ---------------------------------------------------------------- attention layer

// An AttentionLayer shared with Python; `mu` as in PyKVCache. Lock order,
// wherever both are held: the layer's, then the cache's.
struct PyAttentionLayer {
  explicit PyAttentionLayer(AttentionLayer l) : layer(std::move(l)) {}
  AttentionLayer layer;
  std::mutex mu;
};

py::dict config_to_dict(const AttentionConfig& c) {
  py::dict d;
  d["model_type"] = c.model_type;
  d["hidden_size"] = c.hidden_size;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["qkv_bias"] = c.qkv_bias;
  d["o_bias"] = c.o_bias;
  d["qk_norm"] = c.qk_norm;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["use_rope"] = c.use_rope;
  d["rope"] = c.use_rope ? py::object(rope_config_to_dict(c.rope)) : py::object(py::none());
  d["sliding_window"] = c.sliding_window;
  d["softcap"] = c.softcap;
  d["softmax_scale"] =
      c.softmax_scale == 0.0f ? py::object(py::none()) : py::object(py::float_(c.softmax_scale));
  d["causal"] = c.causal;
  return d;
}

// The inverse of config_to_dict, strict about keys. Missing keys take the
// C++ defaults; num_kv_heads defaults to num_heads, head_dim to
// hidden_size / num_heads, rope to a default RoPE over head_dim.
AttentionConfig config_from_dict(py::handle obj) {
  constexpr const char* kFn = "AttentionLayer";
  if (!py::isinstance<py::dict>(obj))
    raise_value_error(kFn, "config must be a dict (see AttentionLayer.config), got " +
                               py::repr(py::type::handle_of(obj)).cast<std::string>());
  const py::dict d = py::reinterpret_borrow<py::dict>(obj);
  AttentionConfig c;
  auto flag = [](py::handle v) { return PyObject_IsTrue(v.ptr()) == 1; };
  py::handle rope;
  bool has_kv = false, has_head_dim = false;
  for (auto item : d) {
    const std::string key = py::str(item.first).cast<std::string>();
    const py::handle v = item.second;
    const std::string what = "config['" + key + "']";
    if (key == "model_type") {
      c.model_type = py::str(v).cast<std::string>();
    } else if (key == "hidden_size") {
      c.hidden_size = checked_int(v, kFn, what);
    } else if (key == "num_heads") {
      c.num_heads = checked_int(v, kFn, what);
    } else if (key == "num_kv_heads") {
      has_kv = !v.is_none();
      if (has_kv) c.num_kv_heads = checked_int(v, kFn, what);
    } else if (key == "head_dim") {
      has_head_dim = !v.is_none();
      if (has_head_dim) c.head_dim = checked_int(v, kFn, what);
    } else if (key == "qkv_bias") {
      c.qkv_bias = flag(v);
    } else if (key == "o_bias") {
      c.o_bias = flag(v);
    } else if (key == "qk_norm") {
      c.qk_norm = flag(v);
    } else if (key == "rms_norm_eps") {
      c.rms_norm_eps = checked_float(v, kFn, what);
    } else if (key == "use_rope") {
      c.use_rope = flag(v);
    } else if (key == "rope") {
      rope = v;
    } else if (key == "sliding_window") {
      c.sliding_window = v.is_none() ? 0 : checked_int(v, kFn, what);
    } else if (key == "softcap") {
      c.softcap = static_cast<float>(checked_float(v, kFn, what));
    } else if (key == "softmax_scale") {
      c.softmax_scale = parse_softmax_scale(
          v.is_none() ? std::nullopt : std::optional<double>(checked_float(v, kFn, what)), kFn);
    } else if (key == "causal") {
      c.causal = flag(v);
    } else {
      raise_value_error(kFn, "config has unknown key '" + key +
                                 "'; known: model_type, hidden_size, num_heads, num_kv_heads, "
                                 "head_dim, qkv_bias, o_bias, qk_norm, rms_norm_eps, use_rope, "
                                 "rope, sliding_window, softcap, softmax_scale, causal");
    }
  }
  if (!has_kv) c.num_kv_heads = c.num_heads;
  if (!has_head_dim && c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  c.rope.head_dim = c.head_dim;
  if (c.use_rope && rope && !rope.is_none()) {
    if (!py::isinstance<py::dict>(rope))
      raise_value_error(kFn,
                        "config['rope'] must be a dict (head_dim, rotary_dim, theta, "
                        "interleaved, scaling) or None");
    for (auto item : py::reinterpret_borrow<py::dict>(rope)) {
      const std::string key = py::str(item.first).cast<std::string>();
      const py::handle v = item.second;
      const std::string what = "config['rope']['" + key + "']";
      if (key == "head_dim")
        c.rope.head_dim = checked_int(v, kFn, what);
      else if (key == "rotary_dim")
        c.rope.rotary_dim = v.is_none() ? 0 : checked_int(v, kFn, what);
      else if (key == "theta")
        c.rope.theta = checked_float(v, kFn, what);
      else if (key == "interleaved")
        c.rope.pairing = flag(v) ? RopePairing::kInterleaved : RopePairing::kHalfSplit;
      else if (key == "scaling")
        c.rope.scaling = parse_rope_scaling(v, kFn);
      else
        raise_value_error(kFn, "config['rope'] has unknown key '" + key +
                                   "'; known: head_dim, rotary_dim, theta, interleaved, scaling");
    }
  }
  return c;
}

std::unique_ptr<PyAttentionLayer> make_layer(const AttentionConfig& config) {
  return std::make_unique<PyAttentionLayer>(value_or_throw(AttentionLayer::create(config)));
}

PyKVCache* cache_arg(py::handle cache, const char* fn) {
  if (cache.is_none()) return nullptr;
  if (!py::isinstance<PyKVCache>(cache))
    raise_value_error(fn, "cache must be a KVCache (from new_cache) or None, got " +
                              py::repr(py::type::handle_of(cache)).cast<std::string>());
  return cache.cast<PyKVCache*>();
}

py::array layer_forward(PyAttentionLayer& s, py::object x, py::object positions, py::object cache,
                        const std::string& backend, int num_threads) {
  constexpr const char* kFn = "AttentionLayer.forward";
  const InputArray xi = f32_input(x, {kFn, "x", 3, 3, "[batch, seq, hidden]", true});
  const std::vector<int64_t> pos = parse_positions(positions, kFn);
  PyKVCache* c = cache_arg(cache, kFn);
  RunOptions run;
  run.backend = parse_backend(backend, kFn);
  run.num_threads = num_threads;
  TensorView out;
  py::array out_a = new_array(
      DType::kF32, {xi.view.shape[0], xi.view.shape[1], s.layer.config().hidden_size}, &out);
  Status st;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> layer_lock(s.mu);
    if (c) {
      std::lock_guard<std::mutex> cache_lock(c->mu);
      st = s.layer.forward(xi.view, out, pos, &c->cache, run);
    } else {
      st = s.layer.forward(xi.view, out, pos, nullptr, run);
    }
  }
  throw_if_error(st);
  return out_a;
}

// forward_qkv's mask: the user's mask (any broadcastable shape) combined
// with key_padding_mask [batch, seqlen_k] (True = a real token). Without a
// user mask the padding mask is viewed in place as [batch, 1, 1, seqlen_k];
// with one, the two are combined into a new array of the mask's dtype
// (bool: and; float: -inf where padded), broadcast over batch and keys.
InputArray qkv_mask(py::handle mask, py::handle key_padding_mask, int64_t batch, int64_t num_heads,
                    int64_t seqlen_q, int64_t seqlen_k, const char* fn) {
  InputArray m;
  if (!mask.is_none()) m = mask_input(mask, fn);
  if (key_padding_mask.is_none()) return m;
  InputArray pad = typed_input(
      key_padding_mask, {fn, "key_padding_mask", 2, 2, "[batch, seqlen_k]"}, DType::kBool, "b");
  const TensorView& p = pad.view;
  if (p.shape[0] != batch || p.shape[1] != seqlen_k)
    raise_value_error(fn, "key_padding_mask has shape " + shape_str(pad.array) +
                              ", must be [batch, seqlen_k] = (" + std::to_string(batch) + ", " +
                              std::to_string(seqlen_k) + ")");
  if (mask.is_none()) {
    pad.view.rank = 4;
    pad.view.shape = {batch, 1, 1, seqlen_k};
    pad.view.strides = {p.strides[0], 0, 0, p.strides[1]};
    return pad;
  }
  const int64_t full[4] = {batch, num_heads, seqlen_q, seqlen_k};
  const char* names[4] = {"batch", "num_heads", "seqlen_q", "seqlen_k"};
  for (int i = 0; i < 4; ++i)
    if (m.view.shape[i] != 1 && m.view.shape[i] != full[i])
      raise_value_error(fn, "mask.shape[" + std::to_string(i) +
                                "] = " + std::to_string(m.view.shape[i]) + " must be 1 or " +
                                names[i] + " = " + std::to_string(full[i]));
  const TensorView& mv = m.view;
  InputArray both;
  both.copied = true;
  both.array = new_array(mv.dtype, {batch, mv.shape[1], mv.shape[2], seqlen_k}, &both.view);
  const uint8_t* pp = p.ptr<const uint8_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < mv.shape[1]; ++h)
      for (int64_t i = 0; i < mv.shape[2]; ++i)
        for (int64_t j = 0; j < seqlen_k; ++j) {
          // Size-1 mask axes have stride 0 (mask_input), so this broadcasts.
          const int64_t src =
              b * mv.strides[0] + h * mv.strides[1] + i * mv.strides[2] + j * mv.strides[3];
          const bool real = pp[b * p.strides[0] + j * p.strides[1]] != 0;
          const int64_t dst = ((b * mv.shape[1] + h) * mv.shape[2] + i) * seqlen_k + j;
          if (mv.dtype == DType::kBool)
            both.view.ptr<uint8_t>()[dst] = real && mv.ptr<const uint8_t>()[src] != 0;
          else
            both.view.ptr<float>()[dst] =
                real ? mv.ptr<const float>()[src] : -std::numeric_limits<float>::infinity();
        }
  return both;
}

py::object layer_forward_qkv(PyAttentionLayer& s, py::object query, py::object key,
                             py::object value, bool causal, py::object mask,
                             py::object key_padding_mask, bool need_weights, py::object window_size,
                             py::object sparse, const std::string& backend, int num_threads) {
  constexpr const char* kFn = "AttentionLayer.forward_qkv";
  const InputArray qi = f32_input(query, {kFn, "query", 3, 3, "[batch, seqlen_q, hidden]", true});
  const InputArray ki = f32_input(key, {kFn, "key", 3, 3, "[batch, seqlen_k, hidden]", true});
  const InputArray vi = f32_input(value, {kFn, "value", 3, 3, "[batch, seqlen_k, hidden]", true});
  const AttentionConfig& cfg = s.layer.config();
  const int64_t batch = qi.view.shape[0], seqlen_q = qi.view.shape[1], seqlen_k = ki.view.shape[1];
  AttentionOptions opt;
  opt.causal = causal;
  opt.window_size = parse_window_size(window_size, kFn);
  opt.sparse = parse_sparse(sparse, kFn);
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;
  const InputArray mi =
      qkv_mask(mask, key_padding_mask, batch, cfg.num_heads, seqlen_q, seqlen_k, kFn);
  opt.mask = mi.view;
  TensorView out, probs;
  py::array out_a = new_array(DType::kF32, {batch, seqlen_q, cfg.hidden_size}, &out);
  py::array probs_a;
  if (need_weights)
    probs_a = new_array(DType::kF32, {batch, cfg.num_heads, seqlen_q, seqlen_k}, &probs);
  Status st;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(s.mu);
    st = s.layer.forward_qkv(qi.view, ki.view, vi.view, out, opt, probs);
  }
  throw_if_error(st);
  if (need_weights) return py::make_tuple(out_a, probs_a);
  return out_a;
}

void layer_load(PyAttentionLayer& s, py::object state_dict, const std::string& prefix) {
  std::vector<InputArray> keep;
  const WeightMap map =
      weights_from_dict(state_dict, "AttentionLayer.load_state_dict", prefix, &keep);
  throw_if_error(locked(s.mu, [&] { return s.layer.load_weights(map, prefix); }));
}

py::dict layer_state_dict(PyAttentionLayer& s, const std::string& prefix) {
  // Snapshot under the lock (without the GIL), then hand numpy the copies.
  struct Entry {
    std::string name;
    Result<TensorView> view = Status(StatusCode::kInternal, "unset");
    Result<Tensor> copy = Status(StatusCode::kInternal, "unset");
  };
  std::vector<Entry> entries = locked(s.mu, [&] {
    std::vector<Entry> out;
    for (const std::string& name : s.layer.weight_names()) {
      Entry e;
      e.name = name;
      e.view = s.layer.weight(name);
      if (e.view.ok()) {
        const TensorView& v = *e.view;
        e.copy = Tensor::zeros(DType::kF32, v.shape.data(), v.rank);
        // The layer's weights are contiguous f32 Tensors.
        if (e.copy.ok()) std::memcpy(e.copy->data(), v.data, e.copy->nbytes());
      }
      out.push_back(std::move(e));
    }
    return out;
  });
  py::dict d;
  for (Entry& e : entries) {
    if (!e.view.ok()) throw_if_error(e.view.status());
    d[py::str(prefix + e.name)] = copy_to_numpy(value_or_throw(std::move(e.copy)).view());
  }
  return d;
}

constexpr const char* kLayerDoc = R"doc(
The MHA / MQA / GQA attention layer (Hugging Face weight names, nn.Linear
layout): q_proj, k_proj, v_proj, o_proj (+ biases where configured),
optional Qwen3 q_norm/k_norm (per-head RMSNorm before RoPE), RoPE, sdpa.

Make one with attnkit.from_config(hf_config_dict),
attnkit.attention_from_variant("mha"|"mqa"|"gqa-N", d_model, num_heads), or
AttentionLayer(config_dict) with the keys of AttentionLayer.config. Load
the weights with load_state_dict before calling forward (until then
forward raises ValueError).
)doc";

constexpr const char* kForwardDoc = R"doc(
Self-attention of x.

    x          [batch, seq, hidden]  (float32; other dtypes converted)
    positions  int [seq] or [batch, seq] for RoPE; None = cache.length + 0..seq-1
    cache      a KVCache from new_cache, or None. With a cache the new tokens
               are appended and attend to everything before them (the layer
               must be causal); on error the cache is unchanged.
    -> float32 [batch, seq, hidden]
)doc";

constexpr const char* kForwardQkvDoc = R"doc(
Attention with separate inputs (the seeds' / nn.MultiheadAttention form;
self- or cross-attention). RoPE, if configured, uses positions 0..seqlen-1
on each side.

    query  [batch, seqlen_q, hidden]
    key    [batch, seqlen_k, hidden]
    value  [batch, seqlen_k, hidden]
    -> out [batch, seqlen_q, hidden]; with need_weights=True
       (out, weights [batch, num_heads, seqlen_q, seqlen_k]) per head, as
       nn.MultiheadAttention's average_attn_weights=False.

causal: bottom-right aligned causal mask. mask: bool (True = attend) or float
(added to the scores), broadcastable to [batch, num_heads, seqlen_q,
seqlen_k] (note: torch's bool attn_mask means the opposite, True = masked).
key_padding_mask: bool [batch, seqlen_k], True = a real token (torch's is
the opposite). window_size and sparse as in attnkit.sdpa. A query row that
sees no key outputs the o_proj bias (its attention is 0), never NaN.
)doc";

void bind_attention_layer(py::module_& m) {
  py::class_<PyAttentionLayer>(m, "AttentionLayer", kLayerDoc)
      .def(py::init([](py::object config) { return make_layer(config_from_dict(config)); }),
           py::arg("config"))
      .def_static(
          "from_config_json",
          [](const std::string& text, int64_t layer_index) {
            return make_layer(value_or_throw(attention_config_from_json(text, layer_index)));
          },
          py::arg("text"), py::arg("layer_index") = 0,
          "A layer for the attention fields of a Hugging Face config.json string; layer_index "
          "picks per-layer settings (sliding-window layers).")
      .def_static(
          "from_variant",
          [](const std::string& variant, int64_t d_model, int64_t num_heads, bool bias) {
            return make_layer(
                value_or_throw(attention_config_from_variant(variant, d_model, num_heads, bias)));
          },
          py::arg("variant"), py::arg("d_model"), py::arg("num_heads"), py::arg("bias") = true,
          "The seeds' unified constructor: 'mha', 'mqa' or 'gqa-N'; no RoPE, not causal.")
      .def_property_readonly(
          "config", [](PyAttentionLayer& s) { return config_to_dict(s.layer.config()); },
          "dict: model_type, hidden_size, num_heads, num_kv_heads, head_dim, qkv_bias, o_bias, "
          "qk_norm, rms_norm_eps, use_rope, rope, sliding_window, softcap, softmax_scale, causal")
      .def(
          "weight_names", [](PyAttentionLayer& s) { return s.layer.weight_names(); },
          "The weight names this layer expects, without prefix.")
      .def("load_state_dict", &layer_load, py::arg("state_dict"), py::arg("prefix") = "",
           "Copies every expected weight prefix + name from a {name: array} dict (float16/32/64 "
           "numpy arrays or CPU torch tensors; bf16 tensors: pass .float()). Strict: a missing, "
           "misshaped or unexpected name under prefix raises ValueError and changes nothing; "
           "the RoPE buffers older exports carry (rotary_emb.inv_freq, .cos_cached, "
           ".sin_cached) are not weights and are skipped. Names outside prefix are ignored.")
      .def("state_dict", &layer_state_dict, py::arg("prefix") = "",
           "Copies of the layer's float32 weights as {prefix + name: array}.")
      .def("forward", &layer_forward, py::arg("x"), py::arg("positions") = py::none(),
           py::arg("cache") = py::none(), py::kw_only(), py::arg("backend") = "auto",
           py::arg("num_threads") = 0, kForwardDoc)
      .def("__call__", &layer_forward, py::arg("x"), py::arg("positions") = py::none(),
           py::arg("cache") = py::none(), py::kw_only(), py::arg("backend") = "auto",
           py::arg("num_threads") = 0, "Same as forward.")
      .def("forward_qkv", &layer_forward_qkv, py::arg("query"), py::arg("key"), py::arg("value"),
           py::kw_only(), py::arg("causal") = false, py::arg("mask") = py::none(),
           py::arg("key_padding_mask") = py::none(), py::arg("need_weights") = false,
           py::arg("window_size") = py::make_tuple(-1, -1), py::arg("sparse") = py::none(),
           py::arg("backend") = "auto", py::arg("num_threads") = 0, kForwardQkvDoc)
      .def(
          "new_cache",
          [](PyAttentionLayer& s, int64_t batch_size, int64_t max_seq_len,
             const std::string& dtype) {
            const DType dt = parse_cache_dtype(dtype, "AttentionLayer.new_cache");
            return std::make_unique<PyKVCache>(
                value_or_throw(s.layer.new_cache(batch_size, max_seq_len, dt)));
          },
          py::arg("batch_size"), py::arg("max_seq_len"), py::arg("dtype") = "float32",
          "A KVCache sized for this layer (its kv heads, head dim and sliding window); dtype "
          "'float32' or 'bfloat16'.")
      .def("__repr__", [](PyAttentionLayer& s) {
        return "AttentionLayer(" + py::repr(config_to_dict(s.layer.config())).cast<std::string>() +
               ")";
      });
}

// ---------------------------------------------------------------- safetensors

std::string fspath(py::handle path, const char* fn) {
  try {
    return py::module_::import("os").attr("fspath")(path).cast<std::string>();
  } catch (const py::error_already_set&) {
    raise_value_error(
        fn, "path must be a str or os.PathLike, got " + py::repr(path).cast<std::string>());
  }
}

py::object load_safetensors_py(py::object path, bool return_metadata) {
  const std::string p = fspath(path, "load_safetensors");
  Result<SafetensorsFile> file = Status(StatusCode::kInternal, "unset");
  {
    py::gil_scoped_release nogil;
    file = SafetensorsFile::open(p);
  }
  const SafetensorsFile f = value_or_throw(std::move(file));
  py::dict tensors;
  for (const auto& [name, view] : f.tensors()) tensors[py::str(name)] = copy_to_numpy(view);
  if (!return_metadata) return tensors;
  py::dict metadata;
  for (const auto& [key, value] : f.metadata()) metadata[py::str(key)] = value;
  return py::make_tuple(tensors, metadata);
}

void save_safetensors_py(py::object path, py::object tensors, py::object metadata) {
  constexpr const char* kFn = "save_safetensors";
  const std::string p = fspath(path, kFn);
  if (!py::isinstance<py::dict>(tensors))
    raise_value_error(kFn, "tensors must be a dict {name: array}, got " +
                               py::repr(py::type::handle_of(tensors)).cast<std::string>());
  std::vector<InputArray> keep;
  keep.reserve(py::len(tensors));
  WeightMap map;
  for (auto item : py::reinterpret_borrow<py::dict>(tensors)) {
    if (!py::isinstance<py::str>(item.first))
      raise_value_error(
          kFn, "tensors keys must be str, got " + py::repr(item.first).cast<std::string>());
    const std::string name = item.first.cast<std::string>();
    const std::string label = "tensors['" + name + "']";
    py::array probe = py::array::ensure(item.second);
    if (!probe)
      raise_value_error(kFn, label + " must be a numpy array, got " +
                                 py::repr(py::type::handle_of(item.second)).cast<std::string>());
    // Each dtype is written as itself; there is no numpy bfloat16 to write.
    DType dtype;
    const char kind = probe.dtype().kind();
    const auto size = probe.itemsize();
    if (kind == 'f' && size == 4)
      dtype = DType::kF32;
    else if (kind == 'f' && size == 8)
      dtype = DType::kF64;
    else if (kind == 'f' && size == 2)
      dtype = DType::kF16;
    else if (kind == 'i' && size == 4)
      dtype = DType::kI32;
    else if (kind == 'i' && size == 8)
      dtype = DType::kI64;
    else if (kind == 'b')
      dtype = DType::kBool;
    else
      raise_value_error(kFn,
                        label + " has dtype " +
                            py::str(static_cast<py::handle>(probe.dtype())).cast<std::string>() +
                            ", must be float16/32/64, int32/64 or bool");
    keep.push_back(typed_input(probe, {kFn, label.c_str(), 0, 4, "(rank 0 to 4)"}, dtype, "fiub"));
    map.emplace(name, keep.back().view);
  }
  std::map<std::string, std::string, std::less<>> meta;
  if (!metadata.is_none()) {
    if (!py::isinstance<py::dict>(metadata))
      raise_value_error(kFn, "metadata must be None or a dict {str: str}");
    for (auto item : py::reinterpret_borrow<py::dict>(metadata)) {
      if (!py::isinstance<py::str>(item.first) || !py::isinstance<py::str>(item.second))
        raise_value_error(kFn, "metadata must map str to str, got " +
                                   py::repr(item.first).cast<std::string>() + ": " +
                                   py::repr(item.second).cast<std::string>());
      meta.emplace(item.first.cast<std::string>(), item.second.cast<std::string>());
    }
  }
  Status st;
  {
    py::gil_scoped_release nogil;
    st = save_safetensors(p, map, meta);
  }
  throw_if_error(st);
}

constexpr const char* kLoadSafetensorsDoc = R"doc(
Reads a .safetensors file into {name: numpy array} (copies; the file is
closed on return). F32 -> float32, BF16 -> float32 (exact), F16 -> float16,
F64, I32, I64, BOOL as themselves; shapes of rank 0..4. Every header field
is validated first: a malformed file raises ValueError, an unreadable one
OSError. With return_metadata=True returns (tensors, metadata dict).
)doc";

constexpr const char* kSaveSafetensorsDoc = R"doc(
Writes {name: array} (float16/32/64, int32/64 or bool; rank 0..4; any
strides) and optional {str: str} metadata to a .safetensors file, replacing
it atomically. The inverse of load_safetensors.
)doc";

void bind_safetensors(py::module_& m) {
  m.def("load_safetensors", &load_safetensors_py, py::arg("path"),
        py::arg("return_metadata") = false, kLoadSafetensorsDoc);
  m.def("save_safetensors", &save_safetensors_py, py::arg("path"), py::arg("tensors"),
        py::arg("metadata") = py::none(), kSaveSafetensorsDoc);
}

}  // namespace

void bind_core(py::module_& m) {
  m.def("sdpa", &sdpa_py, py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(),
        py::arg("softmax_scale") = py::none(), py::arg("causal") = false,
        py::arg("window_size") = py::make_tuple(-1, -1), py::arg("softcap") = 0.0,
        py::arg("seqlens_k") = py::none(), py::arg("return_lse") = false,
        py::arg("mask") = py::none(), py::arg("sparse") = py::none(),
        py::arg("return_probs") = false, py::arg("kv_dtype") = "float32",
        py::arg("backend") = "auto", py::arg("num_threads") = 0, kSdpaDoc);
  m.def("merge_attention_states", &merge_py, py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"),
        py::arg("lse_b"), kMergeDoc);
  bind_rope(m);
  bind_kv_cache(m);
  bind_attention_layer(m);
  bind_safetensors(m);
}

}  // namespace attnkit::python
