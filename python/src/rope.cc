// Bindings for RoPE: class Rope (a rotary embedding built once, applied to
// arrays) and apply_rope, with Hugging Face's rope_scaling dicts.
#include "rope.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "attnkit/rope.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {

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

namespace {

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
    d["truncate"] = s.truncate;
  }
  return d;
}

}  // namespace

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
      // YaRN: False keeps the ramp's boundaries fractional (gpt-oss).
      s.truncate = PyObject_IsTrue(val.ptr()) == 1;
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

py::dict rope_config_to_dict(const RopeConfig& c) {
  py::dict d;
  d["head_dim"] = c.head_dim;
  d["rotary_dim"] = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  d["theta"] = c.theta;
  d["interleaved"] = c.pairing == RopePairing::kInterleaved;
  d["scaling"] = scaling_to_dict(c.scaling);
  return d;
}

namespace {

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

}  // namespace

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

}  // namespace attnkit::python
