// Bindings for the KV cache of an MHA/MQA/GQA layer: class KVCache
// (append-and-attend, keys/values copies, sliding-window ring buffers).
#include "kv_cache.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/tensor.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

// The held tokens of keys (or values) in position order, oldest first, as
// float32 [batch, stored, num_kv_heads, dim] (bf16 storage widened exactly,
// 8-bit codes times their scales, exactly).
py::array cache_tokens(PyKVCache& c, bool keys) {
  struct Snapshot {
    Result<Tensor> data = Status(StatusCode::kInternal, "unset");
    int64_t stored = 0;
  };
  Snapshot snap = locked(c.mu, [&] {
    Snapshot s;
    const KVCache& kv = c.cache;
    const TensorView& src = keys ? kv.keys() : kv.values();
    const TensorView& scales = keys ? kv.key_scales() : kv.value_scales();
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
            if (src.dtype == DType::kBF16) {
              *dst++ = bf16_to_float(src.ptr<const bf16>()[i]);
            } else if (scales.present()) {
              const uint8_t code = src.ptr<const uint8_t>()[i];
              const float value =
                  src.dtype == DType::kI8 ? static_cast<int8_t>(code) : fp8_e4m3_to_float(code);
              *dst++ = value *
                       scales.ptr<const float>()[b * scales.strides[0] + slot * scales.strides[1] +
                                                 h * scales.strides[2]];
            } else {
              *dst++ = src.ptr<const float>()[i];
            }
          }
      }
    return s;
  });
  const Tensor t = value_or_throw(std::move(snap.data));
  return copy_to_numpy(t.view());
}

py::array cache_attend(PyKVCache& c, py::object q, py::object k_new, py::object v_new,
                       std::optional<double> softmax_scale, double softcap, py::object sparse,
                       const std::string& backend, int num_threads, py::object sinks,
                       int64_t chunk_size) {
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
  InputArray si;
  parse_sinks_and_chunk(sinks, chunk_size, kFn, &opt, &si);
  TensorView out;
  py::array out_a = new_array(
      DType::kF32, {qi.view.shape[0], qi.view.shape[1], qi.view.shape[2], vi.view.shape[3]}, &out);
  throw_if_error(locked(c.mu, [&] { return c.cache.attend(qi.view, ki.view, vi.view, out, opt); }));
  return out_a;
}

constexpr const char* kKVCacheDoc = R"doc(
Key/value cache of one MHA/MQA/GQA layer for incremental decoding.

    KVCache(batch_size, max_seq_len, num_kv_heads, head_dim, head_dim_v=None,
            dtype="float32", sliding_window=0, chunk_size=0)

Stores K [batch, slots, num_kv_heads, head_dim] and V [..., head_dim_v] as
float32, bfloat16, int8 or fp8_e4m3. The 8-bit types quantize each token's
row of each kv head once, when it is written, with one float32 scale
(max |x| / 127 or / 448): a quarter of float32's bytes, plus 4 per row.
keys() and values() return the values they hold (code * scale), as float32.
Without a window slots = max_seq_len; with a sliding
window W (each token sees itself and W-1 before it) slots = min(max_seq_len,
W-1), a ring buffer; with chunks of C (chunked local attention, Llama 4:
a token sees only its own chunk's tokens) slots = min(max_seq_len, C),
token t in slot t mod C. All sequences advance together. Usually made by
AttentionLayer.new_cache.
)doc";

constexpr const char* kAttendDoc = R"doc(
Appends T new tokens and attends the T queries as the continuation of a
causal sequence (query t sits at position length + t).

    q      [batch, T, num_heads,    head_dim]
    k_new  [batch, T, num_kv_heads, head_dim]
    v_new  [batch, T, num_kv_heads, head_dim_v]
    -> out [batch, T, num_heads, head_dim_v] float32

Keyword arguments: softmax_scale, softcap, sparse, backend, num_threads as
in sdpa; sinks (float [num_heads], as in sdpa); chunk_size (0 or the
cache's own; the chunk is the cache's).

On success length grows by T; on any error (including overflowing
max_seq_len) the cache is unchanged.
)doc";

}  // namespace

void bind_kv_cache(py::module_& m) {
  py::class_<PyKVCache>(m, "KVCache", kKVCacheDoc)
      .def(py::init([](int64_t batch_size, int64_t max_seq_len, int64_t num_kv_heads,
                       int64_t head_dim, std::optional<int64_t> head_dim_v,
                       const std::string& dtype, int64_t sliding_window, int64_t chunk_size) {
             KVCacheSpec spec;
             spec.batch_size = batch_size;
             spec.max_seq_len = max_seq_len;
             spec.num_kv_heads = num_kv_heads;
             spec.head_dim = head_dim;
             spec.head_dim_v = head_dim_v.value_or(head_dim);
             spec.dtype = parse_cache_dtype(dtype, "KVCache");
             spec.sliding_window = sliding_window;
             spec.chunk_size = chunk_size;
             return std::make_unique<PyKVCache>(value_or_throw(KVCache::create(spec)));
           }),
           py::arg("batch_size"), py::arg("max_seq_len"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("head_dim_v") = py::none(), py::arg("dtype") = "float32",
           py::arg("sliding_window") = 0, py::arg("chunk_size") = 0)
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
          "bytes of the K and V values the cache holds (the KV memory formula; 8-bit types "
          "with their float32 scales)")
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
      .def_property_readonly("chunk_size", [](PyKVCache& c) { return c.cache.spec().chunk_size; })
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
           py::arg("sinks") = py::none(), py::arg("chunk_size") = 0, kAttendDoc)
      .def("__repr__", [](PyKVCache& c) {
        const KVCacheSpec& s = c.cache.spec();
        const int64_t length = locked(c.mu, [&] { return c.cache.length(); });
        return "KVCache(length=" + std::to_string(length) +
               ", batch_size=" + std::to_string(s.batch_size) +
               ", max_seq_len=" + std::to_string(s.max_seq_len) +
               ", num_kv_heads=" + std::to_string(s.num_kv_heads) +
               ", head_dim=" + std::to_string(s.head_dim) + ", dtype='" +
               cache_dtype_name(s.dtype) + "', sliding_window=" + std::to_string(s.sliding_window) +
               (s.chunk_size > 0 ? ", chunk_size=" + std::to_string(s.chunk_size) : "") + ")";
      });
}

}  // namespace attnkit::python
