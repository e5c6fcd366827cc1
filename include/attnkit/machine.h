// attnkit/machine.h — what this machine can do, measured, not looked up.
//
// Every speed figure attnkit reports is given as a fraction of these
// numbers, measured in the same process (the machines we run on are shared
// and noisy, so absolute times alone mean little).
#pragma once

#include <string>

#include "attnkit/tensor.h"

namespace attnkit {

struct MachineProfile {
  // The widest vectors the active SIMD target uses (ATTNKIT_SIMD=avx2 on an
  // AVX-512 CPU: "avx2"), which the peak is measured on: "avx512", "avx2"
  // or "scalar".
  std::string simd;
  bool has_avx512_bf16 = false;     // vdpbf16ps available
  int threads = 1;                  // threads the figures were measured with
  double fp32_peak_gflops = 0;      // FMA throughput, all threads (1 FMA = 2 FLOPs)
  double bf16_dot_peak_gflops = 0;  // vdpbf16ps throughput, all threads; 0 if absent
  double dram_read_gbps = 0;        // streaming read bandwidth, all threads, buffer >> LLC
  double seconds_spent = 0;         // how long the measurement took
  // Whether every probe settled: its fastest run was matched within 5 % by
  // another before the probe's run limit. A probe that does not settle
  // (the machine is busy) still reports its fastest run.
  bool stable = false;
};

// Measures with `threads` threads (0 = all cores). Each probe (FMA peak,
// bf16 dot peak, read bandwidth) is repeated until its fastest run is
// matched within 5 % by another and keeps the fastest: at least 3 and at
// most 20 runs (quick: 2 and 8, with shorter runs, for interactive tools).
MachineProfile measure_machine(int threads = 0, bool quick = false);

// The fp32 FMA peak of `threads` threads (0 = all cores) on vectors of
// `bits` bits, whatever the active SIMD target: 512 (AVX-512F), 256 (AVX2
// with FMA; what AVX2 kernels are to be judged against on an AVX-512 CPU)
// or anything else for scalar code; GFLOP/s, 2 per FMA, measured as
// measure_machine measures its peak. 0 where the CPU lacks that width.
double measure_fp32_peak(int threads, int bits, bool quick = false);

// Two measurements of the same machine, typically before and after the
// work they are the yardstick for: a machine that was busy during one of
// them shows as a disagreement, which a single measurement cannot see.
struct MachineCheck {
  MachineProfile before, after;
  MachineProfile best;  // each figure the larger of the two; the others from `before`
  bool agree = true;    // fp32 peak, bf16 dot peak and read bandwidth within `tolerance`
  // Empty when they agree; else which figures moved, e.g. "fp32 peak 114
  // then 231 GFLOP/s; read bandwidth 21.0 then 20.6 GB/s".
  std::string disagreement;
};
MachineCheck compare_machine_profiles(const MachineProfile& before, const MachineProfile& after,
                                      double tolerance = 0.15);

// The GEMM behind the layers' projections and the instruction set it runs,
// for reports next to the profile, e.g. "oneDNN 2.6.3 matmul
// (avx512_core_bf16)" (docs/GEMM.md). ATTNKIT_BACKEND=reference replaces it
// with a plain loop; this name does not change with that setting.
const char* gemm_backend_name();

// What runs the projections of layers whose weights are kept in
// `weight_dtype` (kF32 or kBF16) on this machine now, for reports that
// say which weights they used, e.g. for bf16 on an AVX2 CPU "attnkit bf16
// stream (avx2) for 1-64 rows, above: oneDNN 2.6.3 matmul gemm:jit (avx2)
// on W widened to f32".
std::string gemm_backend_name(DType weight_dtype);

}  // namespace attnkit
