// Bindings for Qwen3-Next's Gated DeltaNet layer: class GatedDeltaNet (from
// a config dict) and its per-sequence state, GatedDeltaNetState. forward()
// runs without the GIL; failures raise ValueError with the C++ message.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "attnkit/gated_deltanet.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

constexpr const char* kCreate = "GatedDeltaNet";

// Our field names, or Hugging Face's qwen3_next config names for the same.
GatedDeltaNetConfig config_from_dict(py::handle obj) {
  if (!py::isinstance<py::dict>(obj))
    raise_value_error(kCreate, "config must be a dict (see GatedDeltaNet.config), got " +
                                   py::repr(py::type::handle_of(obj)).cast<std::string>());
  GatedDeltaNetConfig c;
  for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
    const std::string key = py::str(item.first).cast<std::string>();
    const py::handle v = item.second;
    const std::string what = "config['" + key + "']";
    if (key == "hidden_size") {
      c.hidden_size = checked_int(v, kCreate, what);
    } else if (key == "num_k_heads" || key == "linear_num_key_heads") {
      c.num_k_heads = checked_int(v, kCreate, what);
    } else if (key == "num_v_heads" || key == "linear_num_value_heads") {
      c.num_v_heads = checked_int(v, kCreate, what);
    } else if (key == "key_head_dim" || key == "linear_key_head_dim") {
      c.key_head_dim = checked_int(v, kCreate, what);
    } else if (key == "value_head_dim" || key == "linear_value_head_dim") {
      c.value_head_dim = checked_int(v, kCreate, what);
    } else if (key == "conv_kernel" || key == "linear_conv_kernel_dim") {
      c.conv_kernel = checked_int(v, kCreate, what);
    } else if (key == "rms_norm_eps") {
      c.rms_norm_eps = checked_float(v, kCreate, what);
    } else {
      raise_value_error(kCreate,
                        "config has unknown key '" + key +
                            "'; known: hidden_size, num_k_heads, num_v_heads, key_head_dim, "
                            "value_head_dim, conv_kernel, rms_norm_eps (or the linear_* names of "
                            "a qwen3_next config.json)");
    }
  }
  return c;
}

py::dict config_to_dict(const GatedDeltaNetConfig& c) {
  py::dict d;
  d["hidden_size"] = c.hidden_size;
  d["num_k_heads"] = c.num_k_heads;
  d["num_v_heads"] = c.num_v_heads;
  d["key_head_dim"] = c.key_head_dim;
  d["value_head_dim"] = c.value_head_dim;
  d["conv_kernel"] = c.conv_kernel;
  d["rms_norm_eps"] = c.rms_norm_eps;
  return d;
}

py::array forward_py(const GatedDeltaNet& layer, py::handle x, GatedDeltaNetState* state,
                     int num_threads, const std::string& backend) {
  constexpr const char* kFn = "GatedDeltaNet.forward";
  const InputArray xi = f32_input(x, {kFn, "x", 3, 3, "[batch, seq, hidden_size]"});
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
  const TensorView& xv = xi.view;
  TensorView out;
  py::array out_a = new_array(DType::kF32, {xv.shape[0], xv.shape[1], xv.shape[2]}, &out);
  Status st;
  {
    py::gil_scoped_release release;
    st = layer.forward(xv, out, state, run);
  }
  throw_if_error(st);
  return out_a;
}

}  // namespace

void bind_gated_deltanet(py::module_& m) {
  py::class_<GatedDeltaNetState>(m, "GatedDeltaNetState", R"doc(
Per-sequence state of one GatedDeltaNet layer (GatedDeltaNet.new_state):
the conv's last conv_kernel - 1 inputs and the recurrent state S per value
head. forward(x, state) continues the sequences from it and leaves their end
in it.
)doc")
      .def_property_readonly("batch_size", &GatedDeltaNetState::batch_size)
      .def_property_readonly(
          "conv_state", [](const GatedDeltaNetState& s) { return copy_to_numpy(s.conv_state()); },
          "A copy, float32 [batch, conv_kernel - 1, conv channels], oldest input first.")
      .def_property_readonly(
          "recurrent_state",
          [](const GatedDeltaNetState& s) { return copy_to_numpy(s.recurrent_state()); },
          "A copy, float32 [batch, num_v_heads, key_head_dim, value_head_dim].")
      .def("reset", &GatedDeltaNetState::reset, "Back to the start of every sequence (zeros).");

  py::class_<GatedDeltaNet>(m, "GatedDeltaNet", R"doc(
Qwen3-Next's Gated DeltaNet layer (linear_attn.*): fused projections grouped
per key head, causal depthwise conv with SiLU, L2-normalised q and k, decay
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the gated delta
rule, gated RMSNorm, out_proj. Build it from a dict (our names or a
qwen3_next config's linear_* names), load Hugging Face weights with
load_state_dict, then forward(x, state=None). See docs/LINEAR_ATTENTION.md.
)doc")
      .def(py::init([](py::object config) {
             return std::make_unique<GatedDeltaNet>(
                 value_or_throw(GatedDeltaNet::create(config_from_dict(config))));
           }),
           py::arg("config"))
      .def_property_readonly("config",
                             [](const GatedDeltaNet& l) { return config_to_dict(l.config()); })
      .def("weight_names", &GatedDeltaNet::weight_names,
           "Names load_state_dict reads, relative to its prefix.")
      .def(
          "load_state_dict",
          [](GatedDeltaNet& l, py::handle state_dict, const std::string& prefix) {
            std::vector<InputArray> keep;
            const WeightMap map =
                weights_from_dict(state_dict, "GatedDeltaNet.load_state_dict", prefix, &keep);
            throw_if_error(l.load_weights(map, prefix));
          },
          py::arg("state_dict"), py::arg("prefix") = "",
          "Copies prefix + name for every name in weight_names(). Strict: a missing or "
          "misshapen weight, an unexpected name under the prefix, or a non-finite A_log / "
          "dt_bias raises and leaves the layer unchanged.")
      .def_property_readonly("loaded", &GatedDeltaNet::loaded)
      .def(
          "new_state",
          [](const GatedDeltaNet& l, int64_t batch_size) {
            return std::make_unique<GatedDeltaNetState>(value_or_throw(l.new_state(batch_size)));
          },
          py::arg("batch_size"), "A zero state (the start of every sequence).")
      .def("forward", &forward_py, py::arg("x"), py::arg("state") = nullptr,
           py::arg("num_threads") = 0, py::arg("backend") = "auto",
           "x [batch, seq, hidden_size] -> out float32 [batch, seq, hidden_size]; with a "
           "state, continues its sequences and updates it.")
      .def("__call__", &forward_py, py::arg("x"), py::arg("state") = nullptr,
           py::arg("num_threads") = 0, py::arg("backend") = "auto");
}

}  // namespace attnkit::python
