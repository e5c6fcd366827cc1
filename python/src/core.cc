#include "bindings.h"

namespace attnkit::python {

void bind_core(pybind11::module_& m) {}

}  // namespace attnkit::python
