// Reference twin of every attention kernel. Single-threaded, double
// accumulation; `scratch` must hold attention_ref_scratch(params) doubles.
#pragma once

#include <cstddef>

#include "kernels/attention_params.h"

namespace attnkit::kernels {

size_t attention_ref_scratch(const AttentionParams& params);
void attention_ref(const AttentionParams& params, double* scratch);

}  // namespace attnkit::kernels
