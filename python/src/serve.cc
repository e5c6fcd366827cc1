// Bindings for the serving engine (attnkit/serve.h): StepModel, the base
// any servable model binds under (SyntheticModel here; attnkit.Model binds
// as py::class_<Model, StepModel>), and Engine. A step runs without the
// GIL, taking it back only for a Python sample callback.
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "attnkit/analysis.h"
#include "attnkit/serve.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

// A byte count: an int, or a string "256MiB", "1.5GiB", "4096", "64KiB", "2GB".
int64_t parse_memory(py::handle obj, const char* fn) {
  if (!py::isinstance<py::str>(obj)) {
    const int64_t v = checked_int(obj, fn, "kv_memory");
    if (v < 1) raise_value_error(fn, "kv_memory = " + std::to_string(v) + " must be >= 1 byte");
    return v;
  }
  const std::string text = obj.cast<std::string>();
  size_t end = 0;
  while (end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[end])) || text[end] == '.'))
    ++end;
  std::string unit = text.substr(end);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  static const std::map<std::string, double> kUnits = {
      {"", 1},          {"B", 1},    {"KiB", 1024.0}, {"MiB", 1048576.0},
      {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6},     {"GB", 1e9}};
  const auto u = kUnits.find(unit);
  double value = 0;
  try {
    value = end > 0 ? std::stod(text.substr(0, end)) : -1;
  } catch (const std::exception&) {
    value = -1;
  }
  if (u == kUnits.end() || !(value > 0) || !std::isfinite(value * u->second) ||
      value * u->second >= 9.2e18)
    raise_value_error(fn, "kv_memory = '" + text +
                              "' must be a positive size: a number of bytes, or one with a unit "
                              "B, KiB, MiB, GiB, KB, MB, GB (e.g. '256MiB')");
  return static_cast<int64_t>(value * u->second);
}

// A config: a dict (a config.json's contents), a JSON string, the path of
// a config.json, or a preset name (attnkit presets).
std::string config_text(py::handle config, const char* fn) {
  if (py::isinstance<py::dict>(config))
    return py::module_::import("json").attr("dumps")(config).cast<std::string>();
  if (!py::isinstance<py::str>(config))
    raise_value_error(fn,
                      "config must be a dict, a JSON string, a config.json path or a preset "
                      "name, got " +
                          std::string(py::str(py::type::of(config).attr("__name__"))));
  const std::string text = config.cast<std::string>();
  if (text.find('{') != std::string::npos) return text;
  std::ifstream in(text, std::ios::binary);
  if (in) {
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }
  auto preset = preset_config_json(text);
  if (!preset.ok())
    raise_value_error(fn, "config = '" + text + "' is neither a readable file nor a preset (" +
                              preset.status().message() + ")");
  return *preset;
}

std::unique_ptr<serve::SyntheticModel> make_synthetic(py::handle config, int64_t layers,
                                                      int64_t seed, const std::string& weights,
                                                      int64_t vocab_size, bool mlp) {
  constexpr const char* kFn = "SyntheticModel";
  const std::string json = config_text(config, kFn);
  serve::ModelSpec spec = value_or_throw(serve::synthetic_spec_from_json(json, layers));
  spec.weight_dtype = parse_cache_dtype(weights, kFn, "weights", false);
  if (seed < 0) raise_value_error(kFn, "seed = " + std::to_string(seed) + " must be >= 0");
  spec.seed = static_cast<uint64_t>(seed);
  spec.vocab_size = vocab_size;
  if (mlp) {
    auto moe = moe_config_from_json(json);
    if (!moe.ok())
      raise_value_error(kFn, "mlp=True needs the config's feed-forward: " + moe.status().message());
    spec.ffn = true;
    spec.moe = *moe;
  }
  return std::make_unique<serve::SyntheticModel>(
      value_or_throw(serve::SyntheticModel::create(spec)));
}

// The engine and what Python sees of it beside: each failed request's
// error message.
struct PyEngine {
  std::unique_ptr<Engine> engine;
  std::map<int64_t, std::string> errors;
  py::object sample;  // kept alive while the engine may call it
};

std::unique_ptr<PyEngine> make_engine(StepModel& model, py::handle kv_memory, int64_t page_size,
                                      const std::string& kv_dtype, bool prefix_caching,
                                      bool batch_invariant, int64_t max_tokens_per_step,
                                      int64_t max_seqs, py::object sample, int num_threads,
                                      const std::string& backend) {
  constexpr const char* kFn = "Engine";
  EngineOptions o;
  o.kv_memory = parse_memory(kv_memory, kFn);
  o.page_size = page_size;
  o.kv_dtype = parse_cache_dtype(kv_dtype, kFn, "kv_dtype");
  o.prefix_caching = prefix_caching;
  o.batch_invariant = batch_invariant;
  o.max_tokens_per_step = max_tokens_per_step;
  o.max_seqs = max_seqs;
  o.run.num_threads = num_threads;
  o.run.backend = parse_backend(backend, kFn);
  auto out = std::make_unique<PyEngine>();
  if (!sample.is_none()) {
    if (!PyCallable_Check(sample.ptr())) raise_value_error(kFn, "sample must be callable or None");
    out->sample = sample;
    // Called without the GIL (step releases it): takes it, hands the
    // logits over as a float32 array (a copy), and maps any Python
    // exception or non-integer result to an out-of-vocabulary token, which
    // ends that request with an error.
    PyEngine* self = out.get();
    o.sample = [self](std::span<const float> logits) -> int32_t {
      py::gil_scoped_acquire gil;
      try {
        TensorView v;
        py::array a = new_array(DType::kF32, {static_cast<int64_t>(logits.size())}, &v);
        std::copy(logits.begin(), logits.end(), v.ptr<float>());
        const py::object r = self->sample(a);
        const int64_t t = py::int_(r).cast<int64_t>();
        return t < 0 || t > INT32_MAX ? -1 : static_cast<int32_t>(t);
      } catch (const std::exception&) {  // py::error_already_set, cast_error
        return -1;
      }
    };
  }
  out->engine = std::make_unique<Engine>(value_or_throw(Engine::create(model, o)));
  return out;
}

int64_t add_request_py(PyEngine& self, py::handle prompt_token_ids, int64_t max_tokens) {
  constexpr const char* kFn = "Engine.add_request";
  const std::vector<int64_t> ids =
      int64_values(prompt_token_ids, {kFn, "prompt_token_ids", 1, 1, "[num_tokens]"});
  std::vector<int32_t> tokens(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < INT32_MIN || ids[i] > INT32_MAX)
      raise_value_error(kFn, "prompt_token_ids[" + std::to_string(i) + "] = " +
                                 std::to_string(ids[i]) + " does not fit a token id (int32)");
    tokens[i] = static_cast<int32_t>(ids[i]);
  }
  return value_or_throw(self.engine->add_request(tokens, max_tokens));
}

py::list step_py(PyEngine& self) {
  Result<std::vector<StepOutput>> out = std::vector<StepOutput>{};
  {
    py::gil_scoped_release release;
    out = self.engine->step();
  }
  throw_if_error(out.status());
  py::list result;
  for (const StepOutput& s : *out) {
    if (!s.status.ok()) self.errors[s.request_id] = python_message(s.status.message());
    result.append(py::make_tuple(s.request_id, py::cast(s.new_token_ids), s.finished));
  }
  return result;
}

py::dict metrics_py(const PyEngine& self, int64_t request_id) {
  const RequestMetrics m = value_or_throw(self.engine->metrics(request_id));
  const auto opt = [](double t) { return t < 0 ? py::object(py::none()) : py::float_(t); };
  py::dict d;
  d["arrival_s"] = m.arrival_s;
  d["admitted_s"] = opt(m.admitted_s);
  d["first_token_s"] = opt(m.first_token_s);
  d["finish_s"] = opt(m.finish_s);
  d["prompt_tokens"] = m.prompt_tokens;
  d["output_tokens"] = m.output_tokens;
  d["preemptions"] = m.preemptions;
  d["cached_tokens"] = m.cached_tokens;
  const auto e = self.errors.find(request_id);
  d["error"] = e == self.errors.end() ? py::object(py::none()) : py::str(e->second);
  return d;
}

py::dict stats_py(const PyEngine& self) {
  const EngineStats& s = self.engine->stats();
  py::dict d;
  d["steps"] = s.steps;
  d["preemptions"] = s.preemptions;
  d["tokens_computed"] = s.tokens_computed;
  d["prompt_tokens_computed"] = s.prompt_tokens_computed;
  d["prompt_tokens_admitted"] = s.prompt_tokens_admitted;
  d["prompt_tokens_cached"] = s.prompt_tokens_cached;
  d["peak_running"] = s.peak_running;
  d["busy_s"] = s.busy_s;
  d["forward_s"] = s.forward_s;
  d["wall_s"] = s.wall_s;
  d["clock_s"] = self.engine->clock_s();
  d["pool_pages"] = self.engine->budget().pages;
  d["kv_bytes_per_token"] = self.engine->budget().bytes_per_token;
  const PrefixCacheStats p = self.engine->prefix_cache_stats();
  d["prefix_cache"] =
      py::dict(py::arg("hit_tokens") = p.hit_tokens, py::arg("query_tokens") = p.query_tokens,
               py::arg("evictions") = p.evictions, py::arg("cached_pages") = p.cached_pages);
  return d;
}

}  // namespace

void bind_serve(py::module_& m) {
  py::class_<StepModel>(m, "StepModel", R"doc(
What the serving engine asks of a model: token ids in, each sequence's
last-token logits out, over a paged KV pool. Not constructed directly:
SyntheticModel (and attnkit.Model) are StepModels, and Engine serves any.)doc")
      .def_property_readonly("vocab_size", &StepModel::vocab_size)
      .def_property_readonly("state_bytes_per_sequence", &StepModel::state_bytes_per_sequence);

  py::class_<serve::SyntheticModel, StepModel>(m, "SyntheticModel", R"doc(
The serving benchmark's model: a config's first `layers` layers, each of
its own kind (softmax attention of any window/chunk/sinks/gate, MLA, Gated
DeltaNet), with seeded random weights, a seeded embedding table and LM head
of `vocab_size` tokens (so that the layers' work dominates), greedy
next token = argmax of its logits. `mlp=True` adds the config's MoE
feed-forward after each layer.

    model = attnkit.SyntheticModel("llama-3-8b", layers=1)
    model = attnkit.SyntheticModel(json.load(open("config.json")), layers=2, seed=3))doc")
      .def(py::init(&make_synthetic), py::arg("config"), py::arg("layers") = 1, py::arg("seed") = 1,
           py::arg("weights") = "bfloat16", py::arg("vocab_size") = 512, py::arg("mlp") = false)
      .def_property_readonly("hidden_size", &serve::SyntheticModel::hidden_size)
      .def_property_readonly("weight_bytes", &serve::SyntheticModel::weight_bytes);

  py::class_<PyEngine>(m, "Engine", R"doc(
Continuous batching over a paged KV pool, in the manner of vLLM: chunked
prefill within max_tokens_per_step, one decode token per running sequence,
recompute preemption, first come first served (docs/SERVING.md).

    engine = attnkit.Engine(model, kv_memory="256MiB", page_size=16, kv_dtype="bf16")
    rid = engine.add_request([1, 2, 3], max_tokens=16)
    while engine.has_unfinished():
        for request_id, new_token_ids, finished in engine.step():
            ...

model: any StepModel (SyntheticModel, attnkit.Model); kept alive by the
engine. kv_memory: bytes (int) or a size string ("256MiB"), for KV pages and
linear-attention states. sample: None (greedy) or a callable taking a
float32 logits array [vocab_size] and returning a token id; a token outside
the vocabulary, or an exception, ends that request with an error
(metrics(request_id)["error"]). batch_invariant: True (default) makes a
request's tokens independent of what else runs, its prompt's chunking and
the prefix cache; False lets decode attention split keys (faster, equal to
rounding only). Bad requests raise ValueError and leave the
engine serving the others.)doc")
      .def(py::init(&make_engine), py::arg("model"), py::arg("kv_memory") = "256MiB",
           py::arg("page_size") = 16, py::arg("kv_dtype") = "bf16",
           py::arg("prefix_caching") = false, py::arg("batch_invariant") = true,
           py::arg("max_tokens_per_step") = 512, py::arg("max_seqs") = 256,
           py::arg("sample") = py::none(), py::arg("num_threads") = 0, py::arg("backend") = "auto",
           py::keep_alive<1, 2>())
      .def("add_request", &add_request_py, py::arg("prompt_token_ids"), py::arg("max_tokens"),
           "Queues a request; returns its id (0, 1, ...).")
      .def("step", &step_py,
           "One scheduling step and forward pass: [(request_id, new_token_ids, finished)] for "
           "the requests that advanced.")
      .def("has_unfinished", [](const PyEngine& e) { return e.engine->has_unfinished(); })
      .def("metrics", &metrics_py, py::arg("request_id"),
           "A request's times on the engine clock (None = not yet), token counts, preemptions "
           "and error.")
      .def_property_readonly("stats", &stats_py)
      .def_property_readonly("num_running",
                             [](const PyEngine& e) { return e.engine->num_running(); })
      .def_property_readonly("num_waiting",
                             [](const PyEngine& e) { return e.engine->num_waiting(); });
}

}  // namespace attnkit::python
