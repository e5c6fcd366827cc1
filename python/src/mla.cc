#include "bindings.h"

namespace attnkit::python {

void bind_mla(pybind11::module_& m) {}

}  // namespace attnkit::python
