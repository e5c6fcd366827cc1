// The single place that decides which attention implementation runs.
// Callers (sdpa, caches, layers) hand over validated params and never name a
// kernel themselves, so a new fast path slots in here without touching them.
#pragma once

#include <span>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "core/cpu_features.h"
#include "kernels/attention_params.h"
#include "kernels/gated_delta_rule_params.h"

namespace attnkit::kernels {

namespace cpu {
struct KernelTable;
}  // namespace cpu

// Resolves kAuto against ATTNKIT_BACKEND (read once per process).
Backend resolve_backend(Backend requested);

// Runs attention for validated params. Fails only when scratch memory
// cannot be allocated (before anything is written).
Status run_attention(const AttentionParams& params, Backend backend);

// Runs several calls in order, with scratch for the largest allocated
// before the first: it fails, if at all, before any call has written.
Status run_attention(std::span<const AttentionParams> calls, Backend backend);

// Runs the gated delta rule (kernels/gated_delta_rule_params.h) for
// validated params. kAuto/kFast: the fast CPU forms (params.form, or with
// kAuto the recurrent form for calls of at most kGdrRecurrentMaxSeq tokens
// per sequence and the chunked form beyond); kReference: the recurrent
// reference in double, whatever params.form says. Fails only when scratch
// cannot be allocated, before anything is written.
Status run_gated_delta_rule(const GatedDeltaRuleParams& params, Backend backend);

// Allocates, on the calling thread, the scratch that any later
// run_gated_delta_rule call there with the same head shapes, thread count
// and backend needs (it depends on neither batch nor seq), so that a
// caller running several calls in a row can fail before the first.
Status reserve_gated_delta_rule(const GatedDeltaRuleParams& params, Backend backend);

// Tests and fuzzers only. While `kernels` is set, fast calls run it under
// `target`'s name and tiling (cpu::Plan::kernels) instead of the active
// target's table: this is how a whole-API harness runs the AVX-512 kernels
// built on emulated intrinsics (cmake/attnkit_avx512_emulation.cmake) on a
// CPU without AVX-512, which set_simd_target() rightly refuses. nullptr
// returns to the active target. Set it between calls, not while one runs.
void set_kernels_for_testing(SimdTarget target, const cpu::KernelTable* kernels);

}  // namespace attnkit::kernels
