// Reference twin of the gated delta rule kernels: the recurrent form as
// plain loops, in double, single-threaded (kernels/gated_delta_rule_params.h
// has the contract). Both fast forms are tested against it.
#pragma once

#include <cstddef>

#include "kernels/gated_delta_rule_params.h"

namespace attnkit::kernels {

// Doubles of scratch gated_delta_rule_ref needs: one head's state and one
// token's delta.
size_t gated_delta_rule_ref_scratch(const GatedDeltaRuleParams& p);

// Writes out and the state; `scratch` holds gated_delta_rule_ref_scratch(p)
// doubles. p.form and p.num_threads are ignored.
void gated_delta_rule_ref(const GatedDeltaRuleParams& p, double* scratch);

}  // namespace attnkit::kernels
