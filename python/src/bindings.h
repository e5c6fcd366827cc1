// One function per binding file; module.cc calls them in order.
#pragma once

#include <pybind11/pybind11.h>

namespace attnkit::python {

void bind_core(pybind11::module_& m);  // core.cc: sdpa, RoPE, attention layer, caches, safetensors
void bind_mla(pybind11::module_& m);   // mla.cc: LatentAttention and its cache
void bind_moe(pybind11::module_& m);   // moe.cc: the MoE feed-forward

}  // namespace attnkit::python
