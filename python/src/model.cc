// Bindings for attnkit::Model: attnkit.Model.from_pretrained(dir) and
// model.forward(token_ids). forward() runs without the GIL; failures raise
// ValueError with the C++ Status message.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/model.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

// token_ids [batch, seq] or [seq], any integer dtype -> float32 logits
// [batch, seq, vocab] or [seq, vocab].
py::array forward(Model& model, py::handle token_ids) {
  constexpr const char* fn = "Model.forward";
  py::array arr = py::array::ensure(token_ids);
  if (!arr || (arr.ndim() != 1 && arr.ndim() != 2))
    raise_value_error(fn, "token_ids must be an integer array [batch, seq] or [seq]" +
                              (arr ? ", got shape " + shape_str(arr) : std::string()));
  const ArgSpec spec{fn, "token_ids", 1, 2, "[batch, seq] or [seq]"};
  std::vector<int64_t> ids = int64_values(token_ids, spec);
  const bool one = arr.ndim() == 1;
  const int64_t B = one ? 1 : arr.shape(0), S = one ? arr.shape(0) : arr.shape(1);
  const TensorView view = make_view(ids.data(), DType::kI64, {B, S});
  Result<Tensor> logits = internal_error("unset");
  {
    py::gil_scoped_release release;
    logits = model.forward(view);
  }
  Tensor t = value_or_throw(std::move(logits));
  const int64_t V = model.vocab_size();
  TensorView out;
  py::array result =
      one ? new_array(DType::kF32, {S, V}, &out) : new_array(DType::kF32, {B, S, V}, &out);
  std::memcpy(out.data, t.data(), t.nbytes());
  return result;
}

}  // namespace

void bind_model(py::module_& m) {
  py::class_<Model, StepModel>(
      m, "Model",
      "A whole decoder loaded from a Hugging Face checkpoint directory "
      "(config.json + model.safetensors or a sharded index); see docs/MODEL.md.")
      .def_static(
          "from_pretrained",
          [](const std::string& dir, const std::string& backend, int num_threads) {
            ModelLoadOptions o;
            o.run.backend = parse_backend(backend, "Model.from_pretrained");
            o.run.num_threads = num_threads;
            Result<Model> r = internal_error("unset");
            {
              py::gil_scoped_release release;
              r = Model::from_pretrained(dir, o);
            }
            return value_or_throw(std::move(r));
          },
          py::arg("dir"), py::arg("backend") = "auto", py::arg("num_threads") = 0,
          "Loads config.json and the weights (kept in their stored dtype: bf16 stays bf16).")
      .def("forward", &forward, py::arg("token_ids"),
           "token_ids [batch, seq] or [seq] (integers in [0, vocab_size)) -> float32 logits "
           "[batch, seq, vocab_size] or [seq, vocab_size], causal within each row.")
      .def_property_readonly("vocab_size", &Model::vocab_size)
      .def_property_readonly("num_layers", &Model::num_layers)
      .def_property_readonly("hidden_size", &Model::hidden_size)
      .def_property_readonly("model_type",
                             [](const Model& model) { return model.spec().model_type; })
      .def_property_readonly("weight_bytes", &Model::weight_bytes);
}

}  // namespace attnkit::python
