// gated_delta_rule_chunked_timed: the chunked form of
// gated_delta_rule_chunked.inc with a clock between its phases, in a
// translation unit of its own (see the .inc).
#include <algorithm>

#include "kernels/cpu/gated_delta_rule_chunked.inc"
#include "kernels/cpu/gated_delta_rule_cpu.h"

namespace attnkit::kernels::cpu {

void gated_delta_rule_chunked_timed(const GatedDeltaRuleParams& p, SimdTarget target,
                                    float* scratch, double* seconds) {
  auto run = avx512(target)                ? chunked_task_avx512<PhaseClock>
             : target == SimdTarget::kAvx2 ? chunked_task_avx2<PhaseClock>
                                           : chunked_task_scalar<PhaseClock>;
  ChunkScratch s;
  chunk_floats(p, &s, line_start(scratch));
  std::fill_n(seconds, kGdrNumPhases, 0.0);
  const int64_t per_task = task_groups(p);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t kh0 = 0; kh0 < p.num_k_heads; kh0 += per_task) {
      PhaseClock clock{.seconds = seconds};
      run(p, b, kh0, std::min(kh0 + per_task, p.num_k_heads), s, clock);
    }
}

const char* gdr_phase_name(GdrPhase phase) {
  static constexpr const char* kNames[kGdrNumPhases] = {"pack (keys transposed, states in/out)",
                                                        "K K^T and Q K^T",
                                                        "decays (D, -L, D*QK^T)",
                                                        "K S0 and the right-hand side",
                                                        "triangular solve (U)",
                                                        "outputs (Q S0 + A U)",
                                                        "state update (K^T U)"};
  return kNames[phase];
}

}  // namespace attnkit::kernels::cpu
