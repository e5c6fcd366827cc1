// _attnkit: the pybind11 extension behind the attnkit Python package.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_attnkit, m) { m.doc() = "attnkit native module"; }
