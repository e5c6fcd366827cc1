#include "kernels/dispatch.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kernels/ref/attention_ref.h"

namespace attnkit::kernels {

Backend resolve_backend(Backend requested) {
  static const Backend from_env = [] {
    const char* env = std::getenv("ATTNKIT_BACKEND");
    if (env != nullptr && std::strcmp(env, "reference") == 0) return Backend::kReference;
    return Backend::kAuto;
  }();
  return requested == Backend::kAuto ? from_env : requested;
}

Status run_attention(const AttentionParams& params, Backend backend) {
  (void)resolve_backend(backend);  // only the reference exists so far
  std::vector<double> scratch;
  try {
    scratch.resize(attention_ref_scratch(params));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("sdpa: cannot allocate reference scratch of " +
                              std::to_string(attention_ref_scratch(params)) + " doubles");
  }
  attention_ref(params, scratch.data());
  return Status::Ok();
}

}  // namespace attnkit::kernels
