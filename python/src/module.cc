// _attnkit: the pybind11 extension behind the attnkit Python package. Each
// area binds itself in its own file; this file only assembles them.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_attnkit, m) {
  m.doc() = "attnkit native module (use the attnkit package, not this module)";
  attnkit::python::bind_sdpa(m);
  attnkit::python::bind_rope(m);
  attnkit::python::bind_kv_cache(m);
  attnkit::python::bind_paged(m);
  attnkit::python::bind_attention_layer(m);
  attnkit::python::bind_safetensors(m);
  attnkit::python::bind_mla(m);
  attnkit::python::bind_moe(m);
  attnkit::python::bind_gated_deltanet(m);
  attnkit::python::bind_model_spec(m);
  attnkit::python::bind_sparse_attention(m);
  // serve before model: Model derives from serve's StepModel.
  attnkit::python::bind_serve(m);
  attnkit::python::bind_model(m);
}
