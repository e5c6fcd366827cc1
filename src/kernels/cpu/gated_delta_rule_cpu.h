// Fast CPU forms of the gated delta rule (kernels/gated_delta_rule_params.h
// has the contract; ref/gated_delta_rule_ref.h is the reference twin).
//
// Work is one task per (sequence, value head) in the recurrent form and
// per (sequence, run of key heads) in the chunked form (a key head's value
// heads share its K K^T and Q K^T; a task runs its key heads chunk by
// chunk, so that a chunk's rows are read while they are in the TLB and
// caches; how many key heads a task takes depends on the shape alone);
// a task's results do not depend on the thread count (each task owns its
// states, outputs and scratch slot), so the output is the same bits for 1
// or N threads.
//
// recurrent  The state's value columns are independent (column j of S only
//            meets column j of delta), so a head's state is walked in groups
//            of up to 8 blocks of kGdrColumns columns (a whole 128-wide row),
//            rows in address order: one pass gives S^T k and S^T q, a second
//            updates the group while it is still in L1/L2, and every token of
//            the call runs on a group before the next. A decode step thus
//            reads and writes each state byte once from memory.
// chunked    Per chunk of n <= kGdrChunk tokens, with G the cumulative sum
//            of g within the chunk, D[i][j] = exp(G_i - G_j) for j <= i
//            (formed as products of the factors exp(g_t) <= 1 in double),
//            S0 the state at the chunk's start:
//              L  = strictly lower (beta_i D[i][j] k_i.k_j)       [n, n]
//              U  = (I + L)^-1 (beta * (V - exp(G) * (K S0)))     [n, dv]
//                   (forward substitution, blocked: no inverse formed)
//              O  = exp(G) * (Q S0) + (lower-incl (D * Q K^T)) U  [n, dv]
//              S  = exp(G_n-1) S0 + K^T (exp(G_n-1 - G) * U)      [dk, dv]
//            U holds the deltas of the recurrent form. Q and K are packed
//            per chunk into scratch (their rows lie a token's width apart).
//            The products run on
//            register tiles written in the .cc (R rows x NV vectors of 16
//            columns per target), which apply the steps around them (row
//            scales, the solve, the state update) while the sums are in
//            registers; at 64 x 128 x 128 a oneDNN call's fixed cost was a
//            third of the time. Row i of every triangular product stops at
//            column i, so a later token's NaN or Inf never reaches an
//            earlier token's output.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "kernels/gated_delta_rule_params.h"

namespace attnkit::kernels::cpu {

// Value columns of one recurrent block: one AVX-512 vector of f32.
inline constexpr int64_t kGdrColumns = 16;

// Floats of scratch one worker of the chunked form needs (the recurrent
// form needs none).
size_t gated_delta_rule_chunked_scratch(const GatedDeltaRuleParams& p);

// `threads` resolved (>= 1); `target` the SIMD target to run (the same
// source compiled per target with function attributes, see the .cc).
void gated_delta_rule_recurrent(const GatedDeltaRuleParams& p, int threads, SimdTarget target);
// `scratch` holds threads * gated_delta_rule_chunked_scratch(p) floats.
void gated_delta_rule_chunked(const GatedDeltaRuleParams& p, int threads, SimdTarget target,
                              float* scratch);

// The chunked form's phases, in the order a chunk runs them (a key head's
// keys once, then per value head the rest).
enum GdrPhase : int {
  kGdrPhasePack,         // the keys transposed into scratch; states into / out of scratch
  kGdrPhaseKeyProducts,  // K K^T and Q K^T
  kGdrPhaseDecays,       // D, -L and D * Q K^T (and the next chunk's prefetches)
  kGdrPhaseKS0,          // K S0 and the solve's right-hand side
  kGdrPhaseSolve,        // the forward substitution for U
  kGdrPhaseOutput,       // exp(G) * (Q S0) + lower-incl(D * Q K^T) U
  kGdrPhaseState,        // the state update K^T (D[n-1][:] * U)
  kGdrNumPhases
};
const char* gdr_phase_name(GdrPhase phase);

// The chunked form on the calling thread alone, with a clock read between
// phases: `seconds` [kGdrNumPhases] gets each phase's wall time summed over
// every task (bench/gated_delta_rule_bench.cc prints the split). The
// results are those of gated_delta_rule_chunked. `scratch` holds one
// worker's gated_delta_rule_chunked_scratch(p) floats.
void gated_delta_rule_chunked_timed(const GatedDeltaRuleParams& p, SimdTarget target,
                                    float* scratch, double* seconds);

}  // namespace attnkit::kernels::cpu
