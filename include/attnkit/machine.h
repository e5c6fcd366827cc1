// attnkit/machine.h — what this machine can do, measured, not looked up.
//
// Every speed figure attnkit reports is given as a fraction of these
// numbers, measured in the same process (the machines we run on are shared
// and noisy, so absolute times alone mean little).
#pragma once

#include <string>

namespace attnkit {

struct MachineProfile {
  std::string simd;                 // widest SIMD target in use: "avx512", "avx2" or "scalar"
  bool has_avx512_bf16 = false;     // vdpbf16ps available
  int threads = 1;                  // threads the figures were measured with
  double fp32_peak_gflops = 0;      // FMA throughput, all threads (1 FMA = 2 FLOPs)
  double bf16_dot_peak_gflops = 0;  // vdpbf16ps throughput, all threads; 0 if absent
  double dram_read_gbps = 0;        // streaming read bandwidth, all threads, buffer >> LLC
  double seconds_spent = 0;         // how long the measurement took
};

// Measures with `threads` threads (0 = all cores). `quick` shortens each
// probe (about 0.3 s in all instead of about 1 s) for interactive tools.
MachineProfile measure_machine(int threads = 0, bool quick = false);

// The GEMM behind the layers' projections and the instruction set it runs,
// for reports next to the profile, e.g. "oneDNN 2.6.3 matmul
// (avx512_core_bf16)" (docs/GEMM.md). ATTNKIT_BACKEND=reference replaces it
// with a plain loop; this name does not change with that setting.
const char* gemm_backend_name();

}  // namespace attnkit
