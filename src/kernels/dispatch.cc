#include "kernels/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "core/cpu_features.h"
#include "core/threads.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/tile_policy.h"
#include "kernels/ref/attention_ref.h"

namespace attnkit::kernels {
namespace {

Status run_reference(const AttentionParams& params) {
  std::unique_ptr<double[]> scratch;
  const size_t count = attention_ref_scratch(params);
  try {
    scratch = std::make_unique<double[]>(count);
  } catch (const std::bad_alloc&) {
    return resource_exhausted("sdpa: cannot allocate reference scratch of " +
                              std::to_string(count) + " doubles");
  }
  attention_ref(params, scratch.get());
  return Status::Ok();
}

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
Status run_attention(const AttentionParams& params, Backend backend) {
  if (resolve_backend(backend) == Backend::kReference || !cpu::supports(params))
    return run_reference(params);
  const cpu::KernelTable* testing = g_testing_kernels.load();
  cpu::Plan plan = cpu::make_plan(params, testing ? g_testing_target.load() : simd_target(),
                                  resolve_num_threads(params.num_threads));
  plan.kernels = testing;
  // Scratch is kept per calling thread and only grows: a decode step's
  // ~1 MiB would otherwise be mapped and faulted in anew on every call.
  struct Scratch {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  thread_local Scratch scratch;
  const size_t bytes = cpu::scratch_bytes(params, plan);
  if (bytes > scratch.bytes) {
    scratch = {};
    try {
      scratch.data.reset(new char[bytes]);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("sdpa: cannot allocate " + std::to_string(bytes) +
                                " bytes of attention scratch");
    }
    scratch.bytes = bytes;
  }
  cpu::attention(params, plan, scratch.data.get());
  return Status::Ok();
}

}  // namespace attnkit::kernels
