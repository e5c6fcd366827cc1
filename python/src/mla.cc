// Bindings for MLA: class LatentAttention (from a config.json string;
// attnkit.from_config routes deepseek_v2 / deepseek_v3 / kimi_k2 dicts
// here) and its LatentCache. forward() runs without the GIL; a layer is
// shared-locked while it computes and exclusively locked while it loads, and
// a cache is locked while a forward appends to it.
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "attnkit/kv_cache.h"
#include "attnkit/latent_attention.h"
#include "bindings.h"
#include "numpy_util.h"
#include "paged.h"

namespace attnkit::python {
namespace {

struct PyLatentAttention {
  LatentAttention layer;
  std::shared_mutex mu;
};

struct PyLatentCache {
  explicit PyLatentCache(LatentCache c) : cache(std::move(c)) {}
  LatentCache cache;
  std::mutex mu;
};

MlaForm parse_form(const std::string& text) {
  if (text == "auto") return MlaForm::kAuto;
  if (text == "naive") return MlaForm::kNaive;
  if (text == "absorbed") return MlaForm::kAbsorbed;
  raise_value_error("LatentAttention.forward",
                    "form = '" + text + "' must be 'auto', 'naive' or 'absorbed'");
}

py::dict config_dict(const MlaConfig& c) {
  py::dict d;
  d["model_type"] = c.model_type;
  d["hidden_size"] = c.hidden_size;
  d["num_attention_heads"] = c.num_attention_heads;
  d["q_lora_rank"] = c.q_lora_rank > 0 ? py::object(py::int_(c.q_lora_rank)) : py::none();
  d["kv_lora_rank"] = c.kv_lora_rank;
  d["qk_nope_head_dim"] = c.qk_nope_head_dim;
  d["qk_rope_head_dim"] = c.qk_rope_head_dim;
  d["v_head_dim"] = c.v_head_dim;
  d["rope_theta"] = c.rope_theta;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["rope_interleave"] = c.rope_interleave;
  if (c.rope_scaling.type == RopeScaling::Type::kYarn) {
    const RopeScaling& y = c.rope_scaling;
    py::dict rs;
    rs["type"] = "yarn";
    rs["factor"] = y.factor;
    rs["original_max_position_embeddings"] = y.original_max_position_embeddings;
    rs["beta_fast"] = y.beta_fast;
    rs["beta_slow"] = y.beta_slow;
    rs["mscale"] = y.mscale;
    rs["mscale_all_dim"] = y.mscale_all_dim;
    d["rope_scaling"] = rs;
  } else {
    d["rope_scaling"] = py::none();
  }
  return d;
}

void load_py(PyLatentAttention& self, py::handle state_dict, const std::string& prefix) {
  std::vector<InputArray> keep;
  const WeightMap map =
      weights_from_dict(state_dict, "LatentAttention.load_state_dict", prefix, &keep);
  Status st;
  {
    py::gil_scoped_release release;
    std::unique_lock lock(self.mu);
    st = self.layer.load_weights(map, prefix);
  }
  throw_if_error(st);
}

py::array forward_batch_py(PyLatentAttention& self, py::object x, py::object cu_seqlens_q,
                           py::object seq_ids, py::object cache, int64_t layer_index,
                           const std::string& backend, int num_threads) {
  constexpr const char* kFn = "LatentAttention.forward_batch";
  // The layer reads x as one dense block.
  const InputArray xi =
      f32_input(x, {kFn, "x", 2, 2, "[total_tokens, hidden_size]", ArgSpec::Strides::kContiguous});
  const std::vector<int32_t> cu = offsets_arg(cu_seqlens_q, kFn, "cu_seqlens_q");
  const std::vector<int64_t> ids = int64_list(seq_ids, kFn, "seq_ids");
  PyPagedKVCache& c = paged_cache_arg(cache, kFn);
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
  TensorView out;
  py::array out_a =
      new_array(DType::kF32, {xi.view.shape[0], self.layer.config().hidden_size}, &out);
  Status st;
  {
    py::gil_scoped_release release;
    std::shared_lock lock(self.mu);
    std::lock_guard<std::mutex> cache_lock(c.mu);
    st = self.layer.forward_batch(xi.view, cu, ids, c.pool, layer_index, out, run);
  }
  throw_if_error(st);
  return out_a;
}

py::array forward_py(PyLatentAttention& self, py::handle x, py::handle positions,
                     PyLatentCache* cache, const std::string& form, int num_threads,
                     const std::string& backend) {
  constexpr const char* kFn = "LatentAttention.forward";
  // The layer reads x as one dense block.
  const InputArray xi =
      f32_input(x, {kFn, "x", 3, 3, "[batch, seq, hidden_size]", ArgSpec::Strides::kContiguous});
  const std::vector<int64_t> pos = parse_positions(positions, kFn);
  const MlaForm f = parse_form(form);
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
  const TensorView& xv = xi.view;
  TensorView out;
  py::array out_a = new_array(DType::kF32, {xv.shape[0], xv.shape[1], xv.shape[2]}, &out);
  PyLatentCache* c = cache;
  Status st;
  {
    py::gil_scoped_release release;
    std::shared_lock lock(self.mu);
    std::unique_lock<std::mutex> cache_lock;
    if (c) cache_lock = std::unique_lock(c->mu);
    st = self.layer.forward(xv, out, pos, c ? &c->cache : nullptr, run, f);
  }
  throw_if_error(st);
  return out_a;
}

constexpr const char* kClassDoc = R"doc(
DeepSeek's multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).

Build it with LatentAttention.from_config_json(text) (attnkit.from_config
does this for deepseek_v2 / deepseek_v3 / kimi_k2 dicts), load the layer's
Hugging Face weights with load_state_dict, then forward(x). Decoding goes
through new_cache(batch_size, max_seq_len), which stores only the normed
latent and the rotated shared rope key (kv_lora_rank + qk_rope_head_dim
values per token). See docs/MLA.md.
)doc";

constexpr const char* kForwardDoc = R"doc(
Causal MLA over x [batch, seq, hidden_size] -> float32 [batch, seq, hidden_size].

    positions: None = cache.length + t (0 + t without a cache); int [seq]
        shared by the batch, or [batch, seq]. Used by RoPE only.
    cache: a LatentCache from new_cache(); the new tokens are appended and
        see every cached token. Overflowing max_seq_len raises ValueError
        and leaves the cache unchanged.
    form: "auto" (naive for prefill-like calls, absorbed for decode),
        "naive" or "absorbed"; all give the same result.
)doc";

}  // namespace

void bind_mla(py::module_& m) {
  py::class_<PyLatentCache>(m, "LatentCache", R"doc(
The latent KV cache of one MLA layer: per token the RMS-normed latent
(kv_lora_rank values) and the rotated shared rope key (qk_rope_head_dim
values), nothing else. Made by LatentAttention.new_cache.
)doc")
      .def_property_readonly(
          "length",
          [](PyLatentCache& c) {
            std::lock_guard lock(c.mu);
            return c.cache.length();
          },
          "tokens appended so far (the next token's position)")
      .def_property_readonly(
          "nbytes", [](PyLatentCache& c) { return c.cache.nbytes(); },
          "bytes of storage: batch * max_seq_len * values_per_token * itemsize (8-bit types: "
          "plus a float32 scale per 64 values)")
      .def_property_readonly(
          "values_per_token", [](PyLatentCache& c) { return c.cache.values_per_token(); },
          "kv_lora_rank + qk_rope_head_dim")
      .def_property_readonly("kv_lora_rank",
                             [](PyLatentCache& c) { return c.cache.kv_lora_rank(); })
      .def_property_readonly("qk_rope_head_dim",
                             [](PyLatentCache& c) { return c.cache.qk_rope_head_dim(); })
      .def_property_readonly("batch_size", [](PyLatentCache& c) { return c.cache.batch_size(); })
      .def_property_readonly("max_seq_len", [](PyLatentCache& c) { return c.cache.max_seq_len(); })
      .def_property_readonly("dtype",
                             [](PyLatentCache& c) { return cache_dtype_name(c.cache.dtype()); })
      .def(
          "reset",
          [](PyLatentCache& c) {
            std::lock_guard lock(c.mu);
            c.cache.reset();
          },
          "Forgets every token (storage is kept).")
      .def(
          "append",
          [](PyLatentCache& c, py::handle rows) {
            const InputArray r = f32_input(rows, {"LatentCache.append", "rows", 3, 3,
                                                  "[batch, T, kv_lora_rank + qk_rope_head_dim]"});
            Status st;
            {
              py::gil_scoped_release release;
              std::lock_guard lock(c.mu);
              st = c.cache.append(r.view);
            }
            throw_if_error(st);
          },
          py::arg("rows"),
          "Appends rows as forward() caches them ([normed latent ; rotated rope key] per "
          "token), e.g. a saved latent(). Overflow raises ValueError and changes nothing.")
      .def(
          "latent",
          [](PyLatentCache& c) {
            std::lock_guard lock(c.mu);
            TensorView v = c.cache.storage(), s = c.cache.scales();
            v.shape[1] = c.cache.length();
            if (!s.present()) return copy_to_numpy(v);
            s.shape[1] = c.cache.length();
            return dequantize_to_numpy(v, s, kLatentScaleBlock);
          },
          "Copy of the cached rows, float32 [batch, length, kv_lora_rank + qk_rope_head_dim]: "
          "[normed latent ; rotated rope key] per token (8-bit caches: the values they hold, "
          "code * scale).")
      .def("__repr__", [](PyLatentCache& c) {
        int64_t length = 0;
        {
          std::lock_guard lock(c.mu);
          length = c.cache.length();
        }
        return "LatentCache(length=" + std::to_string(length) +
               ", batch_size=" + std::to_string(c.cache.batch_size()) +
               ", max_seq_len=" + std::to_string(c.cache.max_seq_len()) +
               ", values_per_token=" + std::to_string(c.cache.values_per_token()) + ", dtype='" +
               cache_dtype_name(c.cache.dtype()) + "')";
      });

  py::class_<PyLatentAttention>(m, "LatentAttention", kClassDoc)
      .def_static(
          "from_config_json",
          [](const std::string& text) {
            auto config = value_or_throw(mla_config_from_json(text));
            auto p = std::make_unique<PyLatentAttention>();
            p->layer = value_or_throw(LatentAttention::create(config));
            return p;
          },
          py::arg("text"), "A layer for the MLA fields of a Hugging Face config.json string.")
      .def_property_readonly(
          "config", [](PyLatentAttention& s) { return config_dict(s.layer.config()); },
          "The parsed config, with Hugging Face field names.")
      .def_property_readonly(
          "softmax_scale", [](PyLatentAttention& s) { return s.layer.softmax_scale(); },
          "(qk_nope_head_dim + qk_rope_head_dim)^-1/2, times YaRN's mscale(mscale_all_dim)^2")
      .def_property_readonly("loaded",
                             [](PyLatentAttention& s) {
                               std::shared_lock lock(s.mu);
                               return s.layer.has_weights();
                             })
      .def(
          "weight_names", [](PyLatentAttention& s) { return s.layer.weight_names(); },
          "Names load_state_dict reads, relative to its prefix.")
      .def("load_state_dict", &load_py, py::arg("state_dict"), py::arg("prefix") = "",
           "Copies prefix + name for every name in weight_names() from a dict of arrays "
           "(numpy or float torch tensors). Strict: a missing or misshapen weight, or an "
           "unexpected name under the prefix, raises ValueError and changes nothing; the RoPE "
           "buffers older exports carry (rotary_emb.inv_freq, .cos_cached, .sin_cached) are "
           "skipped.")
      .def("load_weights", &load_py, py::arg("weights"), py::arg("prefix") = "",
           "Same as load_state_dict.")
      .def(
          "weight",
          [](PyLatentAttention& s, const std::string& name) {
            std::shared_lock lock(s.mu);
            return copy_to_numpy(value_or_throw(s.layer.weight(name)));
          },
          py::arg("name"), "A copy of one loaded weight, by a name from weight_names().")
      .def(
          "new_cache",
          [](PyLatentAttention& s, int64_t batch_size, int64_t max_seq_len,
             const std::string& dtype) {
            const DType dt = parse_cache_dtype(dtype, "LatentAttention.new_cache");
            return std::make_unique<PyLatentCache>(
                value_or_throw(s.layer.new_cache(batch_size, max_seq_len, dt)));
          },
          py::arg("batch_size"), py::arg("max_seq_len"), py::arg("dtype") = "float32",
          "A latent cache for this layer (dtype 'float32', 'bfloat16', 'int8' or 'fp8_e4m3'; "
          "the 8-bit types keep one float32 scale per 64 channels of a row).")
      .def(
          "new_paged_cache",
          [](PyLatentAttention& s, int64_t num_pages, int64_t page_size, int64_t num_layers,
             const std::string& kv_dtype) {
            const DType dt =
                parse_cache_dtype(kv_dtype, "LatentAttention.new_paged_cache", "kv_dtype");
            return std::make_unique<PyPagedKVCache>(
                value_or_throw(s.layer.new_paged_cache(num_pages, page_size, num_layers, dt)));
          },
          py::arg("num_pages"), py::arg("page_size") = 16, py::arg("num_layers") = 1,
          py::arg("kv_dtype") = "float32",
          "A PagedKVCache in the latent layout (kv_lora_rank + qk_rope_head_dim values per "
          "token) with num_layers layers.")
      .def("forward_batch", &forward_batch_py, py::arg("x"), py::arg("cu_seqlens_q"),
           py::arg("seq_ids"), py::arg("cache"), py::arg("layer_index") = 0, py::kw_only(),
           py::arg("backend") = "auto", py::arg("num_threads") = 0,
           "As AttentionLayer.forward_batch, over a latent pool, in the absorbed form.")
      .def(
          "choose_form",
          [](PyLatentAttention& s, int64_t new_tokens, int64_t cached_tokens) {
            return std::string(mla_form_name(s.layer.choose_form(new_tokens, cached_tokens)));
          },
          py::arg("new_tokens"), py::arg("cached_tokens"),
          "The form 'auto' runs for new_tokens queries over cached_tokens earlier tokens.")
      .def("forward", &forward_py, py::arg("x"), py::arg("positions") = py::none(),
           py::arg("cache") = py::none(), py::arg("form") = "auto", py::kw_only(),
           py::arg("num_threads") = 0, py::arg("backend") = "auto", kForwardDoc)
      .def("__call__", &forward_py, py::arg("x"), py::arg("positions") = py::none(),
           py::arg("cache") = py::none(), py::arg("form") = "auto", py::kw_only(),
           py::arg("num_threads") = 0, py::arg("backend") = "auto")
      .def("__repr__", [](PyLatentAttention& s) {
        const MlaConfig& c = s.layer.config();
        return "LatentAttention(hidden_size=" + std::to_string(c.hidden_size) +
               ", num_attention_heads=" + std::to_string(c.num_attention_heads) +
               ", q_lora_rank=" + std::to_string(c.q_lora_rank) +
               ", kv_lora_rank=" + std::to_string(c.kv_lora_rank) +
               ", qk_head_dim=" + std::to_string(c.qk_head_dim()) +
               ", v_head_dim=" + std::to_string(c.v_head_dim) + ")";
      });
}

}  // namespace attnkit::python
