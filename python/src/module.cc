// _attnkit: the pybind11 extension behind the attnkit Python package. Each
// area binds itself in its own file; this file only assembles them.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_attnkit, m) {
  m.doc() = "attnkit native module (use the attnkit package, not this module)";
  attnkit::python::bind_core(m);
  attnkit::python::bind_mla(m);
  attnkit::python::bind_moe(m);
}
