// Bindings for the MHA/MQA/GQA attention layer: class AttentionLayer
// (from a Hugging Face config, a variant name or a config dict; weights
// from a state dict; forward with or without a KVCache; forward_qkv).
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/config.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"
#include "bindings.h"
#include "kv_cache.h"
#include "numpy_util.h"
#include "paged.h"
#include "rope.h"

namespace attnkit::python {
namespace {

// An AttentionLayer shared with Python; `mu` as in PyKVCache. Lock order,
// wherever both are held: the layer's, then the cache's.
struct PyAttentionLayer {
  explicit PyAttentionLayer(AttentionLayer l) : layer(std::move(l)) {}
  AttentionLayer layer;
  std::mutex mu;
};

// The Python spelling of a QkNorm: None, "rms", "rms_one_plus", "l2".
py::object qk_norm_name(attnkit::QkNorm n) {
  switch (n) {
    case attnkit::QkNorm::kRms:
      return py::str("rms");
    case attnkit::QkNorm::kRmsOnePlus:
      return py::str("rms_one_plus");
    case attnkit::QkNorm::kL2:
      return py::str("l2");
    case attnkit::QkNorm::kNone:
      break;
  }
  return py::none();
}

// config['qk_norm']: None / False, True (= "rms", as before the kinds),
// "rms", "rms_one_plus" or "l2".
attnkit::QkNorm parse_qk_norm(py::handle v, const char* fn) {
  if (v.is_none()) return attnkit::QkNorm::kNone;
  if (py::isinstance<py::bool_>(v))
    return v.cast<bool>() ? attnkit::QkNorm::kRms : attnkit::QkNorm::kNone;
  if (py::isinstance<py::str>(v)) {
    const std::string s = v.cast<std::string>();
    if (s == "rms") return attnkit::QkNorm::kRms;
    if (s == "rms_one_plus") return attnkit::QkNorm::kRmsOnePlus;
    if (s == "l2") return attnkit::QkNorm::kL2;
  }
  raise_value_error(fn, "config['qk_norm'] = " + py::repr(v).cast<std::string>() +
                            " must be None, \"rms\" (Qwen3; True means it too), "
                            "\"rms_one_plus\" (Gemma 3, Qwen3-Next) or \"l2\" (Llama 4)");
}

py::dict config_to_dict(const AttentionConfig& c) {
  py::dict d;
  d["model_type"] = c.model_type;
  d["hidden_size"] = c.hidden_size;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["qkv_bias"] = c.qkv_bias;
  d["o_bias"] = c.o_bias;
  d["qk_norm"] = qk_norm_name(c.qk_norm);
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["use_rope"] = c.use_rope;
  d["rope"] = c.use_rope ? py::object(rope_config_to_dict(c.rope)) : py::object(py::none());
  d["sliding_window"] = c.sliding_window;
  d["softcap"] = c.softcap;
  d["softmax_scale"] =
      c.softmax_scale == 0.0f ? py::object(py::none()) : py::object(py::float_(c.softmax_scale));
  d["causal"] = c.causal;
  d["chunk_size"] = c.chunk_size == 0 ? py::object(py::none()) : py::object(py::int_(c.chunk_size));
  d["sinks"] = c.sinks;
  d["output_gate"] = c.output_gate;
  d["temperature_tuning"] = c.temperature_tuning;
  d["floor_scale"] = c.floor_scale;
  d["attn_scale"] = c.attn_scale;
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
      c.qk_norm = parse_qk_norm(v, kFn);
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
    } else if (key == "chunk_size") {
      // Hugging Face's attention_chunk_size: null or a positive size.
      if (!v.is_none()) {
        c.chunk_size = checked_int(v, kFn, what);
        if (c.chunk_size <= 0)
          raise_value_error(kFn, what + " = " + std::to_string(c.chunk_size) +
                                     " must be > 0, or None for no chunked attention");
      }
    } else if (key == "sinks") {
      c.sinks = flag(v);
    } else if (key == "output_gate") {
      c.output_gate = flag(v);
    } else if (key == "temperature_tuning") {
      c.temperature_tuning = flag(v);
    } else if (key == "floor_scale") {
      c.floor_scale = checked_float(v, kFn, what);
    } else if (key == "attn_scale") {
      c.attn_scale = checked_float(v, kFn, what);
    } else {
      raise_value_error(kFn, "config has unknown key '" + key +
                                 "'; known: model_type, hidden_size, num_heads, num_kv_heads, "
                                 "head_dim, qkv_bias, o_bias, qk_norm, rms_norm_eps, use_rope, "
                                 "rope, sliding_window, softcap, softmax_scale, causal, "
                                 "chunk_size, sinks, output_gate, temperature_tuning, "
                                 "floor_scale, attn_scale");
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
  const InputArray xi =
      f32_input(x, {kFn, "x", 3, 3, "[batch, seq, hidden]", ArgSpec::Strides::kUnitLast});
  const std::vector<int64_t> pos = parse_positions(positions, kFn);
  PyKVCache* c = cache_arg(cache, kFn);
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
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

py::array layer_forward_batch(PyAttentionLayer& s, py::object x, py::object cu_seqlens_q,
                              py::object seq_ids, py::object cache, int64_t layer_index,
                              const std::string& backend, int num_threads) {
  constexpr const char* kFn = "AttentionLayer.forward_batch";
  const InputArray xi =
      f32_input(x, {kFn, "x", 2, 2, "[total_tokens, hidden]", ArgSpec::Strides::kUnitLast});
  const std::vector<int32_t> cu = offsets_arg(cu_seqlens_q, kFn, "cu_seqlens_q");
  const std::vector<int64_t> ids = int64_list(seq_ids, kFn, "seq_ids");
  PyPagedKVCache& c = paged_cache_arg(cache, kFn);
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
  TensorView out;
  py::array out_a = new_array(DType::kF32, {xi.view.shape[0], s.layer.config().hidden_size}, &out);
  Status st;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> layer_lock(s.mu);
    std::lock_guard<std::mutex> cache_lock(c.mu);
    st = s.layer.forward_batch(xi.view, cu, ids, c.pool, layer_index, out, run);
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
  const InputArray qi = f32_input(
      query, {kFn, "query", 3, 3, "[batch, seqlen_q, hidden]", ArgSpec::Strides::kUnitLast});
  const InputArray ki =
      f32_input(key, {kFn, "key", 3, 3, "[batch, seqlen_k, hidden]", ArgSpec::Strides::kUnitLast});
  const InputArray vi = f32_input(
      value, {kFn, "value", 3, 3, "[batch, seqlen_k, hidden]", ArgSpec::Strides::kUnitLast});
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
        // The layer's weights are contiguous f32 or bf16 Tensors; numpy
        // has no bf16, so those widen (exactly).
        if (e.copy.ok() && v.dtype == DType::kBF16)
          for (int64_t i = 0; i < v.numel(); ++i)
            e.copy->ptr<float>()[i] = bf16_to_float(v.ptr<const bf16>()[i]);
        else if (e.copy.ok())
          std::memcpy(e.copy->data(), v.data, e.copy->nbytes());
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

}  // namespace

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
          "qk_norm (None, 'rms', 'rms_one_plus' or 'l2'), rms_norm_eps, use_rope, rope, "
          "sliding_window, softcap, softmax_scale, causal, chunk_size (None or > 0), sinks, "
          "output_gate, temperature_tuning, floor_scale, attn_scale")
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
          "'float32', 'bfloat16', 'int8' or 'fp8_e4m3'.")
      .def(
          "new_paged_cache",
          [](PyAttentionLayer& s, int64_t num_pages, int64_t page_size, int64_t num_layers,
             const std::string& kv_dtype) {
            const DType dt =
                parse_cache_dtype(kv_dtype, "AttentionLayer.new_paged_cache", "kv_dtype");
            return std::make_unique<PyPagedKVCache>(
                value_or_throw(s.layer.new_paged_cache(num_pages, page_size, num_layers, dt)));
          },
          py::arg("num_pages"), py::arg("page_size") = 16, py::arg("num_layers") = 1,
          py::arg("kv_dtype") = "float32",
          "A PagedKVCache shaped for this layer (its kv heads, head dim and sliding window) with "
          "num_layers layers.")
      .def(
          "forward_batch", &layer_forward_batch, py::arg("x"), py::arg("cu_seqlens_q"),
          py::arg("seq_ids"), py::arg("cache"), py::arg("layer_index") = 0, py::kw_only(),
          py::arg("backend") = "auto", py::arg("num_threads") = 0,
          R"doc(One continuous-batching step over a PagedKVCache: x [total_tokens, hidden] holds the new tokens of
the sequences seq_ids packed in order (sequence s owns rows cu_seqlens_q[s] ... cu_seqlens_q[s + 1]
- 1: the tokens it reserved with cache.append() that layer layer_index of the pool has not written
yet, at positions written + i). Returns [total_tokens, hidden] float32. Each projection is one GEMM
over all rows; a sequence's output does not depend on what else shares the step (where the GEMM's
rows are independent: AVX-512 machines).)doc")
      .def("__repr__", [](PyAttentionLayer& s) {
        return "AttentionLayer(" + py::repr(config_to_dict(s.layer.config())).cast<std::string>() +
               ")";
      });
}

}  // namespace attnkit::python
