// Bindings for safetensors files: load_safetensors and save_safetensors
// ({name: numpy array} in and out, with the file's metadata).
#include <pybind11/stl.h>

#include <map>
#include <string>
#include <vector>

#include "attnkit/weights.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

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

}  // namespace

void bind_safetensors(py::module_& m) {
  m.def("load_safetensors", &load_safetensors_py, py::arg("path"),
        py::arg("return_metadata") = false, kLoadSafetensorsDoc);
  m.def("save_safetensors", &save_safetensors_py, py::arg("path"), py::arg("tensors"),
        py::arg("metadata") = py::none(), kSaveSafetensorsDoc);
}

}  // namespace attnkit::python
