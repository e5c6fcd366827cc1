// The single place that decides which attention implementation runs.
// Callers (sdpa, caches, layers) hand over validated params and never name a
// kernel themselves, so a new fast path slots in here without touching them.
#pragma once

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "kernels/attention_params.h"

namespace attnkit::kernels {

// Resolves kAuto against ATTNKIT_BACKEND (read once per process).
Backend resolve_backend(Backend requested);

// Runs attention for validated params. Fails only when scratch memory
// cannot be allocated (before anything is written).
Status run_attention(const AttentionParams& params, Backend backend);

}  // namespace attnkit::kernels
