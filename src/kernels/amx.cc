// AMX permission (kernels/amx.h).
#include "kernels/amx.h"

#include <atomic>

#if defined(ATTNKIT_AMX_BUILD)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnkit::kernels {

namespace {
std::atomic<bool> allowed{true};
}  // namespace

void set_amx_allowed(bool allow) { allowed.store(allow, std::memory_order_relaxed); }

#if defined(ATTNKIT_AMX_BUILD)

namespace {

bool has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && ((d >> 25) & 1u) != 0;
}

bool request_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
  // The tile kernels decode 8-bit codes by AVX512-VBMI byte lookups
  // (cpu/fp8_bf16.h), which every CPU with AMX has; checked all the same.
  const bool vbmi = (c >> 1) & 1u;
  if (!tile || !bf16 || !vbmi) return false;
  // Linux hands out the 8 KiB of tile state per process, on request
  // (XFEATURE_XTILEDATA).
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0) return false;
  return (granted >> kXtileData) & 1ul;
}

}  // namespace

bool amx_bf16_available() {
  static const bool available = request_amx();
  return available && allowed.load(std::memory_order_relaxed);
}

bool amx_int8_available() {
  static const bool int8 = has_amx_int8();
  return int8 && amx_bf16_available();
}

#else

bool amx_bf16_available() { return false; }
bool amx_int8_available() { return false; }

#endif

}  // namespace attnkit::kernels
