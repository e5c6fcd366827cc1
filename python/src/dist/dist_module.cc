// _attnkit_dist: the native half of attnkit.dist (python/attnkit/dist.py),
// a module of its own, linked to MPI and attnkit::dist, so that `import
// attnkit` needs no MPI. Communicators arrive as Fortran handles
// (mpi4py's comm.py2f()) and become MPI_Comm through MPI_Comm_f2c: both
// sides use the same MPI library, and no mpi4py header is needed to build.
//
// Every entry point is collective. Converting the Python arguments can
// raise on one rank (a wrong rank of array, a bad option string); that
// must not leave the other ranks waiting in the collective that follows,
// so the conversion runs inside on_every_rank(), which agrees on its
// outcome first: a bad argument on any rank raises ValueError on all, with
// that rank's message. Collectives run without the GIL; a mutex per layer
// and per cache keeps two Python threads of one rank from using either at
// once (they would also break the collective order, which is the caller's
// to keep).
#include <mpi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/dist.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

MPI_Comm comm_of(int64_t fortran_handle) {
  return MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
}

// Runs `convert` (argument conversion that may raise), then agrees on its
// outcome across the ranks of `comm`; raises ValueError on every rank if it
// failed on any.
template <typename F>
void on_every_rank(MPI_Comm comm, F&& convert) {
  Status local;
  try {
    convert();
  } catch (py::error_already_set& e) {
    local = invalid_argument(py::str(e.value()).cast<std::string>());
  } catch (const std::exception& e) {
    local = invalid_argument(e.what());
  }
  Status st;
  {
    py::gil_scoped_release nogil;
    st = dist::agree(comm, local);
  }
  throw_if_error(st);
}

// Runs a collective without the GIL, holding `locks`, then raises its error.
template <typename F>
void collective(std::initializer_list<std::mutex*> locks, F&& call) {
  Status st;
  {
    py::gil_scoped_release nogil;
    std::vector<std::unique_lock<std::mutex>> held;
    for (std::mutex* m : locks)
      if (m) held.emplace_back(*m);
    st = call();
  }
  throw_if_error(st);
}

float softmax_scale_of(py::handle obj, const char* fn) {
  if (obj.is_none()) return 0.0f;  // 1/sqrt(head_dim)
  const auto s = static_cast<float>(checked_float(obj, fn, "softmax_scale"));
  if (!(std::isfinite(s) && s > 0.0f))
    raise_value_error(fn, "softmax_scale = " + py::repr(obj).cast<std::string>() +
                              " must be finite and > 0 (None = 1/sqrt(head_dim))");
  return s;
}

std::string str_of(py::handle obj, const char* fn, const char* what) {
  if (!py::isinstance<py::str>(obj))
    raise_value_error(
        fn, std::string(what) + " must be a str, got " + py::repr(obj).cast<std::string>());
  return obj.cast<std::string>();
}

int threads_of(py::handle obj, const char* fn) {
  const int64_t n = checked_int(obj, fn, "num_threads");
  if (n < 0 || n > 1 << 20)
    raise_value_error(fn,
                      "num_threads = " + std::to_string(n) + " must be in [0, 2^20] (0 = default)");
  return static_cast<int>(n);
}

py::dict share_dict(const HeadShare& s) {
  py::dict d;
  d["q_heads"] = py::make_tuple(s.q_begin, s.q_end);
  d["kv_heads"] = py::make_tuple(s.kv_begin, s.kv_end);
  return d;
}

// ---------------------------------------------------------------- caches

struct LocalKVCache {
  explicit LocalKVCache(KVCache c) : cache(std::move(c)) {}
  KVCache cache;
  std::mutex mu;
};

struct LocalLatentCache {
  explicit LocalLatentCache(LatentCache c) : cache(std::move(c)) {}
  LatentCache cache;
  std::mutex mu;
};

// ---------------------------------------------------------------- layers

struct GqaLayer {
  GqaLayer(dist::HeadParallelAttention l, MPI_Comm c) : layer(std::move(l)), comm(c) {}
  dist::HeadParallelAttention layer;
  MPI_Comm comm;  // the caller's, for argument agreement
  std::mutex mu;
};

struct MlaLayer {
  MlaLayer(dist::HeadParallelLatentAttention l, MPI_Comm c) : layer(std::move(l)), comm(c) {}
  dist::HeadParallelLatentAttention layer;
  MPI_Comm comm;
  std::mutex mu;
};

template <typename Layer>
void load_state_dict(Layer& s, py::object state_dict, py::object prefix, const char* fn) {
  std::vector<InputArray> keep;
  WeightMap map;
  std::string p;
  on_every_rank(s.comm, [&] {
    p = str_of(prefix, fn, "prefix");
    map = weights_from_dict(state_dict, fn, p, &keep);
  });
  collective({&s.mu}, [&] { return s.layer.load_weights(map, p); });
}

// forward's argument conversion, shared by both layers; `cache_ok` checks
// the cache's Python type.
struct ForwardArgs {
  InputArray x;
  std::vector<int64_t> positions;
  RunOptions run;
  TensorView out;
  py::array out_array;
};

void convert_forward(const char* fn, py::object x, py::object positions, py::object backend,
                     py::object num_threads, int64_t hidden, ForwardArgs* a) {
  a->x = f32_input(x, {fn, "x", 3, 3, "[batch, seq, hidden]", ArgSpec::Strides::kContiguous});
  a->positions = parse_positions(positions, fn);
  const std::string backend_text = str_of(backend, fn, "backend");
  a->run = parse_run_options(backend_text, threads_of(num_threads, fn), fn);
  a->out_array = new_array(DType::kF32, {a->x.view.shape[0], a->x.view.shape[1], hidden}, &a->out);
}

template <typename CacheType>
CacheType* cache_of(py::object cache, const char* fn) {
  if (cache.is_none()) return nullptr;
  if (!py::isinstance<CacheType>(cache))
    raise_value_error(fn, "cache must be None or a cache from this layer's new_cache(), got " +
                              py::repr(py::type::of(cache)).cast<std::string>());
  return cache.cast<CacheType*>();
}

py::array gqa_forward(GqaLayer& s, py::object x, py::object positions, py::object cache,
                      py::object backend, py::object num_threads) {
  constexpr const char* kFn = "HeadParallelAttention.forward";
  ForwardArgs a;
  LocalKVCache* c = nullptr;
  on_every_rank(s.comm, [&] {
    convert_forward(kFn, x, positions, backend, num_threads, s.layer.config().hidden_size, &a);
    c = cache_of<LocalKVCache>(cache, kFn);
  });
  collective({&s.mu, c ? &c->mu : nullptr}, [&] {
    return s.layer.forward(a.x.view, a.out, a.positions, c ? &c->cache : nullptr, a.run);
  });
  return a.out_array;
}

py::array mla_forward(MlaLayer& s, py::object x, py::object positions, py::object cache,
                      py::object form, py::object backend, py::object num_threads) {
  constexpr const char* kFn = "HeadParallelAttention.forward";
  ForwardArgs a;
  LocalLatentCache* c = nullptr;
  MlaForm f = MlaForm::kAuto;
  on_every_rank(s.comm, [&] {
    convert_forward(kFn, x, positions, backend, num_threads, s.layer.config().hidden_size, &a);
    c = cache_of<LocalLatentCache>(cache, kFn);
    const std::string text = str_of(form, kFn, "form");
    if (text == "naive")
      f = MlaForm::kNaive;
    else if (text == "absorbed")
      f = MlaForm::kAbsorbed;
    else if (text != "auto")
      raise_value_error(kFn, "form = '" + text + "' must be 'auto', 'naive' or 'absorbed'");
  });
  collective({&s.mu, c ? &c->mu : nullptr}, [&] {
    return s.layer.forward(a.x.view, a.out, a.positions, c ? &c->cache : nullptr, a.run, f);
  });
  return a.out_array;
}

template <typename Layer, typename Cache>
std::unique_ptr<Cache> new_cache(Layer& s, py::object batch_size, py::object max_seq_len,
                                 py::object dtype) {
  constexpr const char* kFn = "HeadParallelAttention.new_cache";
  int64_t batch = 0, max_len = 0;
  DType dt = DType::kF32;
  on_every_rank(s.comm, [&] {
    batch = checked_int(batch_size, kFn, "batch_size");
    max_len = checked_int(max_seq_len, kFn, "max_seq_len");
    dt = parse_cache_dtype(str_of(dtype, kFn, "dtype"), kFn);
  });
  std::unique_ptr<Cache> out;
  collective({&s.mu}, [&]() -> Status {
    auto c = s.layer.new_cache(batch, max_len, dt);
    if (!c.ok()) return c.status();
    out = std::make_unique<Cache>(std::move(c).value());
    return Status::Ok();
  });
  return out;
}

// A layer made by make(comm) (collective, without the GIL).
template <typename Wrapper, typename Make>
std::unique_ptr<Wrapper> make_layer(int64_t comm_f, Make make) {
  const MPI_Comm comm = comm_of(comm_f);
  auto made = [&] {
    py::gil_scoped_release nogil;
    return make(comm);
  }();
  throw_if_error(made.status());
  return std::make_unique<Wrapper>(std::move(made).value(), comm);
}

// What both layer classes bind alike.
template <typename Layer>
void bind_layer_common(py::class_<Layer>& c) {
  c.def("load_state_dict",
        [](Layer& s, py::object sd, py::object prefix) {
          load_state_dict(s, sd, prefix, "HeadParallelAttention.load_state_dict");
        })
      .def_property_readonly("share", [](Layer& s) { return share_dict(s.layer.share()); })
      .def_property_readonly("rank", [](Layer& s) { return s.layer.rank(); })
      .def_property_readonly("world_size", [](Layer& s) { return s.layer.ranks(); })
      .def_property_readonly("hidden_size", [](Layer& s) { return s.layer.config().hidden_size; });
}

// ---------------------------------------------------------------- free functions

// The arrays and options both attention functions take, converted.
struct AttentionCall {
  InputArray q, k, v;
  TensorView out, lse;
  py::array out_array, lse_array;
  bool want_lse = false;
  float softmax_scale = 0.0f, softcap = 0.0f;
  Backend backend = Backend::kAuto;
  int num_threads = 0;

  py::object result() const {
    if (want_lse) return py::make_tuple(out_array, lse_array);
    return out_array;
  }
};

// `names`: the three inputs' argument names and their shapes in messages.
void convert_attention(const char* fn, py::object q, py::object k, py::object v,
                       const char* const (&names)[3], const char* const (&shapes)[3],
                       py::object softmax_scale, py::object softcap, py::object return_lse,
                       py::object backend, py::object num_threads, AttentionCall* c) {
  c->q = f32_input(q, {fn, names[0], 4, 4, shapes[0]});
  c->k = f32_input(k, {fn, names[1], 4, 4, shapes[1]});
  c->v = f32_input(v, {fn, names[2], 4, 4, shapes[2]});
  c->softmax_scale = softmax_scale_of(softmax_scale, fn);
  c->softcap = static_cast<float>(checked_float(softcap, fn, "softcap"));
  c->backend = parse_backend(str_of(backend, fn, "backend"), fn);
  c->num_threads = threads_of(num_threads, fn);
  c->want_lse = py::bool_(return_lse);
  const TensorView& qv = c->q.view;
  c->out_array =
      new_array(DType::kF32, {qv.shape[0], qv.shape[1], qv.shape[2], c->v.view.shape[3]}, &c->out);
  if (c->want_lse)
    c->lse_array = new_array(DType::kF32, {qv.shape[0], qv.shape[2], qv.shape[1]}, &c->lse);
}

dist::MergeMethod merge_of(py::handle obj, const char* fn) {
  const std::string m = str_of(obj, fn, "merge");
  if (m == "allreduce") return dist::MergeMethod::kAllreduce;
  if (m != "allgather")
    raise_value_error(fn, "merge = '" + m + "' must be 'allgather' or 'allreduce'");
  return dist::MergeMethod::kAllgather;
}

py::object context_parallel_decode_py(int64_t comm_f, py::object q, py::object k_local,
                                      py::object v_local, py::object softmax_scale,
                                      py::object softcap, py::object return_lse,
                                      py::object seqlens_k, py::object merge, py::object backend,
                                      py::object num_threads) {
  constexpr const char* kFn = "context_parallel_decode";
  const MPI_Comm comm = comm_of(comm_f);
  AttentionCall c;
  std::vector<int32_t> lens;
  dist::ContextParallelOptions opt;
  on_every_rank(comm, [&] {
    convert_attention(
        kFn, q, k_local, v_local, {"q", "k_local", "v_local"},
        {"[batch, seqlen_q, num_heads, head_dim]", "[batch, seqlen_k, num_kv_heads, head_dim]",
         "[batch, seqlen_k, num_kv_heads, head_dim_v]"},
        softmax_scale, softcap, return_lse, backend, num_threads, &c);
    lens = parse_seqlens_k(seqlens_k, kFn);
    opt.merge = merge_of(merge, kFn);
  });
  opt.softmax_scale = c.softmax_scale;
  opt.softcap = c.softcap;
  opt.seqlens_k = lens;
  opt.backend = c.backend;
  opt.num_threads = c.num_threads;
  collective({}, [&] {
    return dist::context_parallel_decode(comm, c.q.view, c.k.view, c.v.view, c.out, opt, c.lse);
  });
  return c.result();
}

py::object merge_partial_attention_py(int64_t comm_f, py::object out_local, py::object lse_local,
                                      py::object return_lse, py::object merge) {
  constexpr const char* kFn = "merge_partial_attention";
  const MPI_Comm comm = comm_of(comm_f);
  InputArray oi, li;
  dist::MergeMethod method = dist::MergeMethod::kAllgather;
  bool want_lse = false;
  on_every_rank(comm, [&] {
    oi = f32_input(out_local, {kFn, "out_local", 4, 4, "[batch, seqlen_q, num_heads, head_dim_v]"});
    li = f32_input(lse_local, {kFn, "lse_local", 3, 3, "[batch, num_heads, seqlen_q]"});
    method = merge_of(merge, kFn);
    want_lse = py::bool_(return_lse);
  });
  const TensorView& o = oi.view;
  TensorView out, lse;
  py::array out_a = new_array(DType::kF32, {o.shape[0], o.shape[1], o.shape[2], o.shape[3]}, &out);
  py::array lse_a;
  if (want_lse) lse_a = new_array(DType::kF32, {o.shape[0], o.shape[2], o.shape[1]}, &lse);
  collective(
      {}, [&] { return dist::merge_partial_attention(comm, oi.view, li.view, out, lse, method); });
  if (!want_lse) return out_a;
  return py::make_tuple(out_a, lse_a);
}

py::object ring_attention_py(int64_t comm_f, py::object q_local, py::object k_local,
                             py::object v_local, py::object causal, py::object softmax_scale,
                             py::object softcap, py::object return_lse, py::object backend,
                             py::object num_threads) {
  constexpr const char* kFn = "ring_attention";
  const MPI_Comm comm = comm_of(comm_f);
  AttentionCall c;
  dist::RingOptions opt;
  on_every_rank(comm, [&] {
    convert_attention(kFn, q_local, k_local, v_local, {"q_local", "k_local", "v_local"},
                      {"[batch, n, num_heads, head_dim]", "[batch, n, num_kv_heads, head_dim]",
                       "[batch, n, num_kv_heads, head_dim_v]"},
                      softmax_scale, softcap, return_lse, backend, num_threads, &c);
    opt.causal = py::bool_(causal);
  });
  opt.softmax_scale = c.softmax_scale;
  opt.softcap = c.softcap;
  opt.backend = c.backend;
  opt.num_threads = c.num_threads;
  collective({}, [&] {
    return dist::ring_attention(comm, c.q.view, c.k.view, c.v.view, c.out, opt, c.lse);
  });
  return c.result();
}

void agree_py(int64_t comm_f, std::optional<std::string> error) {
  const Status local = error ? invalid_argument(*error) : Status::Ok();
  collective({}, [&] { return dist::agree(comm_of(comm_f), local); });
}

}  // namespace
}  // namespace attnkit::python

PYBIND11_MODULE(_attnkit_dist, m) {
  namespace py = pybind11;
  using namespace attnkit;
  using namespace attnkit::python;
  m.doc() = "attnkit.dist native module (use attnkit.dist, not this module)";

  py::class_<LocalKVCache>(m, "KVCache",
                           "One rank's KV cache of a head-parallel layer: its kv heads only.")
      .def_property_readonly("length", [](LocalKVCache& c) { return c.cache.length(); })
      .def_property_readonly("stored", [](LocalKVCache& c) { return c.cache.stored(); })
      .def_property_readonly("nbytes", [](LocalKVCache& c) { return c.cache.nbytes(); })
      .def_property_readonly("batch_size",
                             [](LocalKVCache& c) { return c.cache.spec().batch_size; })
      .def_property_readonly("max_seq_len",
                             [](LocalKVCache& c) { return c.cache.spec().max_seq_len; })
      .def_property_readonly("num_kv_heads",
                             [](LocalKVCache& c) { return c.cache.spec().num_kv_heads; })
      .def_property_readonly("dtype",
                             [](LocalKVCache& c) { return cache_dtype_name(c.cache.spec().dtype); })
      .def(
          "reset",
          [](LocalKVCache& c) {
            std::lock_guard<std::mutex> lock(c.mu);
            c.cache.reset();
          },
          "Forgets every token; call it on every rank.");

  py::class_<LocalLatentCache>(m, "LatentCache",
                               "One rank's latent cache of a head-parallel MLA layer: every "
                               "token's latent row (replicated on every rank).")
      .def_property_readonly("length", [](LocalLatentCache& c) { return c.cache.length(); })
      .def_property_readonly("nbytes", [](LocalLatentCache& c) { return c.cache.nbytes(); })
      .def_property_readonly("batch_size", [](LocalLatentCache& c) { return c.cache.batch_size(); })
      .def_property_readonly("max_seq_len",
                             [](LocalLatentCache& c) { return c.cache.max_seq_len(); })
      .def_property_readonly("values_per_token",
                             [](LocalLatentCache& c) { return c.cache.values_per_token(); })
      .def_property_readonly("dtype",
                             [](LocalLatentCache& c) { return cache_dtype_name(c.cache.dtype()); })
      .def(
          "reset",
          [](LocalLatentCache& c) {
            std::lock_guard<std::mutex> lock(c.mu);
            c.cache.reset();
          },
          "Forgets every token; call it on every rank.");

  py::class_<GqaLayer> gqa(m, "HeadParallelAttention");
  gqa.def(py::init([](int64_t comm_f, const std::string& json, int64_t layer_index) {
            return make_layer<GqaLayer>(comm_f, [&](MPI_Comm comm) {
              return dist::HeadParallelAttention::from_config_json(comm, json, layer_index);
            });
          }),
          py::arg("comm_f"), py::arg("config_json"), py::arg("layer_index"))
      .def("forward", &gqa_forward)
      .def("new_cache", &new_cache<GqaLayer, LocalKVCache>);
  bind_layer_common(gqa);

  py::class_<MlaLayer> mla(m, "HeadParallelLatentAttention");
  mla.def(py::init([](int64_t comm_f, const std::string& json) {
            return make_layer<MlaLayer>(comm_f, [&](MPI_Comm comm) {
              return dist::HeadParallelLatentAttention::from_config_json(comm, json);
            });
          }),
          py::arg("comm_f"), py::arg("config_json"))
      .def("forward", &mla_forward)
      .def("new_cache", &new_cache<MlaLayer, LocalLatentCache>);
  bind_layer_common(mla);

  m.def("context_parallel_decode", &context_parallel_decode_py);
  m.def("ring_attention", &ring_attention_py);
  m.def("merge_partial_attention", &merge_partial_attention_py);
  m.def("agree", &agree_py, py::arg("comm_f"), py::arg("error"));
  m.def("ring_chunks", [](int64_t seqlen, int64_t ranks, int64_t rank) {
    const RingChunks c = value_or_throw(attnkit::ring_chunks(seqlen, ranks, rank));
    return py::make_tuple(py::make_tuple(c.first.begin, c.first.end),
                          py::make_tuple(c.second.begin, c.second.end));
  });
  m.def("head_share", [](int64_t num_heads, int64_t num_kv_heads, int64_t ranks, int64_t rank) {
    return share_dict(value_or_throw(attnkit::head_share(num_heads, num_kv_heads, ranks, rank)));
  });
}
