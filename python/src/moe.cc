#include "bindings.h"

namespace attnkit::python {

void bind_moe(pybind11::module_& m) {}

}  // namespace attnkit::python
