// RoPE configurations as Python dicts, shared by the Rope bindings
// (rope.cc) and the attention layer's config dict (attention_layer.cc).
#pragma once

#include <pybind11/pybind11.h>

#include "attnkit/rope.h"

namespace attnkit::python {

// A Hugging Face rope_scaling dict: {"rope_type" (or "type"): "default" |
// "linear" | "llama3" | "yarn", "factor", "low_freq_factor",
// "high_freq_factor", "original_max_position_embeddings", "beta_fast",
// "beta_slow", "mscale", "mscale_all_dim", "attention_factor"}; None values
// count as absent. Unknown keys are errors (a typo would otherwise be
// silently ignored); range checks are Rope::create's. `fn` names the caller
// in messages.
RopeScaling parse_rope_scaling(pybind11::handle obj, const char* fn);

// Hugging Face's rope_type of a scaling: "default" (none), "linear",
// "llama3", "yarn". One vocabulary for every dict the bindings return.
const char* rope_type_name(RopeScaling::Type t);

// {head_dim, rotary_dim, theta, interleaved, scaling}: Rope.config and the
// "rope" entry of AttentionLayer.config.
pybind11::dict rope_config_to_dict(const RopeConfig& c);

}  // namespace attnkit::python
