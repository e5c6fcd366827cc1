#include "kernels/dispatch.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/gated_delta_rule_cpu.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/ref/attention_ref.h"
#include "kernels/ref/gated_delta_rule_ref.h"
#include "kernels/scratch.h"

namespace attnkit::kernels {
namespace {

// set_kernels_for_testing(): the table, and the target it stands for.
std::atomic<const cpu::KernelTable*> g_testing_kernels{nullptr};
std::atomic<SimdTarget> g_testing_target{SimdTarget::kScalar};

}  // namespace

void set_kernels_for_testing(SimdTarget target, const cpu::KernelTable* kernels) {
  g_testing_target.store(target);
  g_testing_kernels.store(kernels);
}

Backend resolve_backend(Backend requested) {
  static const Backend from_env = [] {
    const char* env = std::getenv("ATTNKIT_BACKEND");
    if (env != nullptr && std::strcmp(env, "reference") == 0) return Backend::kReference;
    return Backend::kAuto;
  }();
  return requested == Backend::kAuto ? from_env : requested;
}

// kAuto and kFast run the fast CPU kernel (kernels/cpu) at the active SIMD
// target (core/cpu_features.h) on params.num_threads threads (0 = default,
// core/threads.h). They fall back to the reference for the only cases the
// fast kernel does not cover (cpu::supports):
//   - probabilities requested (params.probs): the fast kernel never forms
//     the seqlen_q x seqlen_k matrix;
//   - K or V rows not contiguous along the head dimension (dim stride != 1).
// kReference always runs the reference.
Status run_attention(std::span<const AttentionParams> calls, Backend backend) {
  const bool reference = resolve_backend(backend) == Backend::kReference;
  const cpu::KernelTable* testing = g_testing_kernels.load();
  const SimdTarget target = testing ? g_testing_target.load() : simd_target();
  // Plans are a function of each call's params; make them once (a plan of
  // 0 threads marks a call for the reference), size the scratch for the
  // largest, then run.
  thread_local std::vector<cpu::Plan> plans;
  thread_local Scratch<char> scratch;
  thread_local Scratch<double> ref_scratch;
  plans.resize(calls.size());
  size_t bytes = 0, doubles = 0;
  for (size_t c = 0; c < calls.size(); ++c) {
    if (reference || !cpu::supports(calls[c])) {
      plans[c].num_threads = 0;
      doubles = std::max(doubles, attention_ref_scratch(calls[c]));
      continue;
    }
    plans[c] = cpu::make_plan(calls[c], target, resolve_num_threads(calls[c].num_threads));
    plans[c].kernels = testing;
    bytes = std::max(bytes, cpu::scratch_bytes(calls[c], plans[c]));
  }
  ATTNKIT_RETURN_IF_ERROR(scratch.reserve(bytes, "sdpa", "bytes of attention scratch"));
  ATTNKIT_RETURN_IF_ERROR(ref_scratch.reserve(doubles, "sdpa", "doubles of reference scratch"));
  for (size_t c = 0; c < calls.size(); ++c) {
    if (plans[c].num_threads > 0)
      cpu::attention(calls[c], plans[c], scratch.data.get());
    else
      attention_ref(calls[c], ref_scratch.data.get());
  }
  return Status::Ok();
}

Status run_attention(const AttentionParams& params, Backend backend) {
  return run_attention(std::span<const AttentionParams>(&params, 1), backend);
}

namespace {

// The gated delta rule's scratch, this thread's: the reference's doubles,
// the chunked form's floats (threads * per worker).
Scratch<double>& gdr_ref_scratch() {
  thread_local Scratch<double> s;
  return s;
}
Scratch<float>& gdr_chunk_scratch() {
  thread_local Scratch<float> s;
  return s;
}

}  // namespace

Status reserve_gated_delta_rule(const GatedDeltaRuleParams& params, Backend backend) {
  if (resolve_backend(backend) == Backend::kReference)
    return gdr_ref_scratch().reserve(gated_delta_rule_ref_scratch(params), "gated delta rule",
                                     "doubles of gated delta rule scratch");
  const int threads = resolve_num_threads(params.num_threads);
  return gdr_chunk_scratch().reserve(
      cpu::gated_delta_rule_chunked_scratch(params) * static_cast<size_t>(threads),
      "gated delta rule", "floats of gated delta rule scratch");
}

Status run_gated_delta_rule(const GatedDeltaRuleParams& params, Backend backend) {
  if (params.batch == 0 || params.seq == 0) return Status::Ok();
  const bool reference = resolve_backend(backend) == Backend::kReference;
  const bool recurrent = params.form == GdrForm::kRecurrent ||
                         (params.form == GdrForm::kAuto && params.seq <= kGdrRecurrentMaxSeq);
  if (reference || !recurrent) ATTNKIT_RETURN_IF_ERROR(reserve_gated_delta_rule(params, backend));
  if (reference) {
    gated_delta_rule_ref(params, gdr_ref_scratch().get());
    return Status::Ok();
  }
  const int threads = resolve_num_threads(params.num_threads);
  if (recurrent) {
    cpu::gated_delta_rule_recurrent(params, threads, simd_target());
    return Status::Ok();
  }
  cpu::gated_delta_rule_chunked(params, threads, simd_target(), gdr_chunk_scratch().get());
  return Status::Ok();
}

}  // namespace attnkit::kernels
