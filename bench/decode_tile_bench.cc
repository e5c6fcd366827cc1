// What one decode tile costs, stage by stage: the time split behind
// docs/PERFORMANCE.md ("What limits decode"). One kv head's tile of 64 keys
// (kKeysPerTile), and for 4 rows also of the short tile AVX2 decode uses
// (kShortTileKeysF32 / kShortTileKeysBf16, names with /k12 or /k24), is
// run through the active SIMD target's
// microkernels, as the tile loop (src/kernels/cpu/task_runner.h) runs
// them, on one thread with K and V resident in cache:
//   qk       S = K Q^T (qk_rows_* for 1-4 packed rows, else qk_f32/qk_bf16;
//            bf16 keys without vdpbf16ps: qk_rows_widen, or a widened copy)
//   softmax  the online-softmax step (softmax_rows4 on packed scores, else softmax)
//   pv       O = alpha O + P V (pv_f32, or pv_bf16 with vdpbf16ps, else pv_widen
//            or a widened copy)
//   tile     the three in sequence
// for 4 packed rows (1-token GQA 32/8 decode) and 16 (4 tokens), fp32 and
// bf16 K/V (fp32 also a prefill tile of 256 rows: GQA 32/8's 64 query rows
// of 4 heads), and three row strides: `compact` (a kv head's rows adjacent),
// `cache` (a dense [token, 8 kv heads, 128] cache: rows 4 KiB apart in
// fp32, 2 KiB in bf16, which fold a tile onto a few L1 sets) and `padded`
// (the same cache as KVCache stores it, kv_token_stride() apart).
//
// Each stage reports `frac_fma_peak` (its multiply-adds against the
// one-thread fp32 FMA peak measured in-process) and `read_to_compute`: the
// time one thread needs to stream the stage's K and/or V bytes from DRAM at
// the measured one-thread read rate, divided by the stage's time (above 1:
// the arithmetic outruns the memory). A decode step
// from DRAM can take no less than the larger of the arithmetic and the read;
// the summary puts both side by side per tile.
//
//   build/bench/decode_tile_bench
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attnkit/kv_cache.h"
#include "attnkit/machine.h"
#include "attnkit/tensor.h"
#include "core/cpu_features.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/task_plan.h"
#include "kernels/cpu/tile_policy.h"

namespace attnkit {
namespace {

using kernels::cpu::KernelTable;

constexpr int64_t kHeadDim = 128, kCacheKvHeads = 8;

enum class Layout { kCompact, kCache, kPadded };
constexpr Layout kLayouts[] = {Layout::kCompact, Layout::kCache, Layout::kPadded};

const char* layout_name(Layout layout) {
  return layout == Layout::kCompact ? "compact" : layout == Layout::kCache ? "cache" : "padded";
}

constexpr DType kDtypes[] = {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3};

std::string kv_name(DType kv) {
  return kv == DType::kBF16 ? "bf16" : kv == DType::kF32 ? "f32" : dtype_name(kv);
}
bool eight_bit(DType kv) { return kv == DType::kI8 || kv == DType::kFp8E4M3; }

// Elements (8-bit types: bytes) between a kv head's consecutive rows; the
// 8-bit cache rows carry their scales (ops/kv_quant.h).
int64_t row_stride(Layout layout, DType kv) {
  switch (layout) {
    case Layout::kCompact:
      return kHeadDim;
    case Layout::kCache:
      return kCacheKvHeads * kHeadDim;
    case Layout::kPadded:
      break;
  }
  return kv_token_stride(kCacheKvHeads, kHeadDim, kv);
}

const MachineProfile& one_thread() {
  static const MachineProfile m = measure_machine(1);
  return m;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One kv head's tile and the scratch the tile loop gives the kernels, laid
// out as the tile loop (task_runner.h) lays them out (see kernel_table.h for each).
struct Tile {
  const KernelTable* kt;
  DType kv;
  bool bf16, q8, dot, rows_qk;
  int64_t keys, rows, m_pad, s_stride, stride, scale_stride;
  std::vector<float> kf, vf, q, o, s, s0, alpha, row_max, row_sum, kw, vw, k_scale, v_scale, qf;
  std::vector<uint16_t> kb, vb, qb, pack;
  std::vector<uint8_t> k8, v8;  // 8-bit codes
  std::vector<int16_t> q16;

  Tile(const KernelTable* table, DType kv_dtype, int64_t tile_keys, int64_t packed_rows,
       int64_t row_stride)
      : kt(table),
        kv(kv_dtype),
        bf16(kv_dtype == DType::kBF16),
        q8(eight_bit(kv_dtype)),
        keys(tile_keys),
        rows(packed_rows),
        stride(row_stride) {
    m_pad = round_up(rows, kt->lanes);
    dot = bf16 && kt->qk_bf16 != nullptr;
    rows_qk = kernels::cpu::takes_rows_qk(*kt, rows, kv, dot, true);
    s_stride = kernels::cpu::score_stride(m_pad, rows_qk);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    const size_t kv_elems = static_cast<size_t>(keys * stride);
    // q: 4 row-major rows (qk_rows_*) or the blocked transposed layout;
    // either way as many elements as the larger of the two.
    const size_t q_elems = static_cast<size_t>(
        std::max(4 * round_up(kHeadDim, 32), kHeadDim * round_up(m_pad, kt->qk_block_cols)));
    auto fill = [&](std::vector<float>& f, std::vector<uint16_t>& b, size_t n, float scale) {
      f.resize(n);
      b.resize(n);
      for (size_t i = 0; i < n; ++i) {
        f[i] = scale * normal(rng);
        b[i] = float_to_bf16(f[i]).bits;
      }
    };
    fill(kf, kb, kv_elems, 1.0f);
    fill(vf, vb, kv_elems, 1.0f);
    fill(q, qb, q_elems, 0.1f);
    // 8-bit: codes of the same values at one scale per row, the scales a
    // row stride apart (as in a cache's rows), q quantized as pack_q does.
    scale_stride = std::max<int64_t>(1, stride / 4);
    k_scale.assign(static_cast<size_t>(keys * scale_stride), 4.0f / 127);
    v_scale = k_scale;
    for (const auto& [from, to] : {std::pair{&kf, &k8}, std::pair{&vf, &v8}})
      for (float x : *from)
        to->push_back(kv == DType::kI8 ? static_cast<uint8_t>(static_cast<int8_t>(
                                             std::clamp(std::lround(x * 127 / 4), -127L, 127L)))
                                       : float_to_fp8_e4m3(x * 448 / 4));
    q16.resize(q_elems);
    for (size_t i = 0; i < q_elems; ++i)
      q16[i] = static_cast<int16_t>(std::clamp(std::lround(q[i] * 32767 / 0.5), -32767L, 32767L));
    qf.assign(4, 0.5f / 32767);
    s.assign(static_cast<size_t>(round_up(keys * s_stride, 16)), 0.0f);
    // Scores for the softmax and weights for P V, as a real step leaves them.
    s0.resize(s.size());
    for (auto& x : s0) x = normal(rng);
    alpha.assign(static_cast<size_t>(m_pad), 0.5f);  // keeps O bounded over repeats
    row_max.assign(static_cast<size_t>(m_pad), 0.0f);
    row_sum.assign(static_cast<size_t>(m_pad), 0.0f);
    o.assign(static_cast<size_t>(rows * kHeadDim), 0.0f);
    pack.resize(
        static_cast<size_t>(std::max(kernels::cpu::pv_bf16_pack_elems(keys, s_stride, kHeadDim),
                                     kernels::cpu::pv_8bit_pack_elems(keys, s_stride))));
    kw.resize(static_cast<size_t>(keys * kHeadDim));
    vw.resize(kw.size());
  }

  // Without vdpbf16ps, bf16 rows are widened in registers where the target
  // has the kernel for it, else (as the tile loop does) into a copy.
  void qk() {
    const int64_t qs = round_up(kHeadDim, 32);
    if (q8) {
      if (rows_qk && kv == DType::kI8)
        kt->qk_rows_i8(reinterpret_cast<const int8_t*>(k8.data()), stride, keys, kHeadDim,
                       q16.data(), qs, qf.data(), k_scale.data(), scale_stride, s.data(), 0);
      else if (rows_qk)
        kt->qk_rows_fp8(k8.data(), stride, keys, kHeadDim, q.data(), qs, k_scale.data(),
                        scale_stride, s.data(), 0);
      if (rows_qk) return;
      kt->dequant_f32(k8.data(), stride, keys, kHeadDim, k_scale.data(), scale_stride, 0,
                      kv == DType::kFp8E4M3, kw.data(), kHeadDim, 0);
      kt->qk_f32(kw.data(), kHeadDim, keys, kHeadDim, q.data(), m_pad, s.data(), s_stride, 0,
                 nullptr);
      return;
    }
    if (rows_qk && dot) {
      kt->qk_rows_bf16(kb.data(), stride, keys, kHeadDim, qb.data(), qs, s.data(), 0);
    } else if (rows_qk && bf16 && kt->qk_rows_widen != nullptr) {
      kt->qk_rows_widen(kb.data(), stride, keys, kHeadDim, q.data(), qs, s.data(), 0);
    } else if (dot) {
      kt->qk_bf16(kb.data(), stride, keys, kHeadDim, qb.data(), m_pad, s.data(), s_stride, 0);
    } else {
      const float* k = kf.data();
      int64_t ks = stride;
      if (bf16) {
        kt->widen_bf16(kb.data(), stride, keys, kHeadDim, kw.data(), kHeadDim, 0);
        k = kw.data();
        ks = kHeadDim;
      }
      if (rows_qk)
        kt->qk_rows_f32(k, ks, keys, kHeadDim, q.data(), qs, s.data(), 0);
      else
        kt->qk_f32(k, ks, keys, kHeadDim, q.data(), m_pad, s.data(), s_stride, 0, nullptr);
    }
  }

  // Repeated on its own output the step stays finite: weights in (0, 1].
  void softmax() {
    if (rows_qk)
      kt->softmax_rows4(s.data(), keys, row_max.data(), row_sum.data(), alpha.data());
    else
      kt->softmax(s.data(), keys, m_pad, s_stride, row_max.data(), row_sum.data(), alpha.data());
  }
  void pv() {
    if (q8) {
      if (kv == DType::kI8)
        kt->pv_i8(s.data(), keys, s_stride, rows, reinterpret_cast<const int8_t*>(v8.data()),
                  stride, v_scale.data(), scale_stride, kHeadDim, o.data(), kHeadDim, alpha.data(),
                  pack.data(), 0, nullptr);
      else
        kt->pv_fp8(s.data(), keys, s_stride, rows, v8.data(), stride, v_scale.data(), scale_stride,
                   kHeadDim, o.data(), kHeadDim, alpha.data(), pack.data(), 0, nullptr);
      return;
    }
    if (dot) {
      kt->pv_bf16(s.data(), keys, m_pad, s_stride, rows, vb.data(), stride, kHeadDim, o.data(),
                  kHeadDim, alpha.data(), pack.data(), 0);
    } else if (bf16 && kt->pv_widen != nullptr) {
      kt->pv_widen(s.data(), keys, s_stride, rows, vb.data(), stride, kHeadDim, o.data(), kHeadDim,
                   alpha.data(), 0, nullptr);
    } else if (bf16) {
      kt->widen_bf16(vb.data(), stride, keys, kHeadDim, vw.data(), kHeadDim, 0);
      kt->pv_f32(s.data(), keys, s_stride, rows, vw.data(), kHeadDim, kHeadDim, o.data(), kHeadDim,
                 alpha.data(), 0, nullptr);
    } else {
      kt->pv_f32(s.data(), keys, s_stride, rows, vf.data(), stride, kHeadDim, o.data(), kHeadDim,
                 alpha.data(), 0, nullptr);
    }
  }
};

enum class Stage { kQk, kSoftmax, kPv, kTile };
const char* stage_name(Stage s) {
  switch (s) {
    case Stage::kQk:
      return "qk";
    case Stage::kSoftmax:
      return "softmax";
    case Stage::kPv:
      return "pv";
    case Stage::kTile:
      return "tile";
  }
  return "";
}

std::map<std::string, double>& seconds() {  // best time per tile, by benchmark name
  static std::map<std::string, double> m;
  return m;
}

// Multiply-adds and K/V bytes of a stage.
double stage_macs(Stage stage, int64_t keys, int64_t rows) {
  const double one = static_cast<double>(keys * rows * kHeadDim);
  return stage == Stage::kTile ? 2 * one : stage == Stage::kSoftmax ? 0 : one;
}
double stage_bytes(Stage stage, int64_t keys, DType kv) {
  const double row = eight_bit(kv) ? kHeadDim + 4 : kHeadDim * static_cast<double>(dtype_size(kv));
  const double one = static_cast<double>(keys) * row;
  return stage == Stage::kTile ? 2 * one : stage == Stage::kSoftmax ? 0 : one;
}

void run(benchmark::State& state, const std::string& name, DType kv, int64_t keys, int64_t rows,
         Layout layout, Stage stage) {
  const KernelTable* kt = kernels::cpu::kernel_table(simd_target());
  Tile t(kt, kv, keys, rows, row_stride(layout, kv));
  t.s = t.s0;
  if (stage == Stage::kPv) {  // weights in (0, 1], as P V sees them; alpha < 1 bounds O
    t.softmax();
    std::fill(t.alpha.begin(), t.alpha.end(), 0.5f);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    switch (stage) {
      case Stage::kQk:
        t.qk();
        break;
      case Stage::kSoftmax:
        t.softmax();
        break;
      case Stage::kPv:
        t.pv();
        break;
      case Stage::kTile:
        t.qk();
        t.softmax();
        t.pv();
        break;
    }
    benchmark::ClobberMemory();
  }
  const double per_tile =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  double& best = seconds().emplace(name, 1e300).first->second;
  best = std::min(best, per_tile);
  const MachineProfile& m = one_thread();
  state.counters["frac_fma_peak"] =
      2 * stage_macs(stage, keys, rows) / per_tile / 1e9 / m.fp32_peak_gflops;
  state.counters["read_to_compute"] =
      stage_bytes(stage, keys, kv) / (m.dram_read_gbps * 1e9) / per_tile;
}

std::string bench_name(DType kv, int64_t keys, int64_t rows, Layout layout, Stage stage) {
  return std::string("tile/") + kv_name(kv) + "/rows" + std::to_string(rows) +
         (keys == kernels::cpu::kKeysPerTile ? "" : "/k" + std::to_string(keys)) + "/" +
         layout_name(layout) + "/" + stage_name(stage);
}

// The (keys, rows) tiles measured: 64 keys at 4 and 16 rows, and the short
// tile at 4 rows (fp32 and bf16); for fp32 also the prefill tile of
// kTargetRows packed rows (GQA 32/8: 64 query rows of 4 heads), whose q
// tile and accumulators live in L2 as in the kernel.
std::vector<std::pair<int64_t, int64_t>> tiles(DType kv) {
  const int64_t full = kernels::cpu::kKeysPerTile;
  if (eight_bit(kv)) return {{full, 4}, {full, 16}};
  std::vector<std::pair<int64_t, int64_t>> t = {
      {full, 4},
      {kv == DType::kBF16 ? kernels::cpu::kShortTileKeysBf16 : kernels::cpu::kShortTileKeysF32, 4},
      {full, 16}};
  if (kv == DType::kF32) t.push_back({full, kernels::cpu::kTargetRows});
  return t;
}

void register_all() {
  for (DType kv : kDtypes)
    for (auto [keys, rows] : tiles(kv))
      for (Layout layout : kLayouts)
        for (Stage stage : {Stage::kQk, Stage::kSoftmax, Stage::kPv, Stage::kTile}) {
          const std::string name = bench_name(kv, keys, rows, layout, stage);
          benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) {
            run(st, name, kv, keys, rows, layout, stage);
          })->Unit(benchmark::kNanosecond);
        }
}

// Per tile: each stage's best time, their sum and the whole tile, against
// the time one thread takes to read the tile's K and V from DRAM.
void summary() {
  const MachineProfile& m = one_thread();
  std::printf(
      "\nsummary: ns per tile of one kv head, 1 thread, best repetition;\n"
      "read = the tile's K and V at the measured 1-thread DRAM read rate (%.1f GB/s);\n"
      "fp32 FMA peak %.1f GFLOP/s\n",
      m.dram_read_gbps, m.fp32_peak_gflops);
  std::printf("  %-28s %8s %8s %8s %8s %8s %8s %13s\n", "tile", "qk", "softmax", "pv", "sum",
              "tile", "read", "of fp32 peak");
  for (DType kv : kDtypes)
    for (auto [keys, rows] : tiles(kv))
      for (Layout layout : kLayouts) {
        double ns[4];
        bool all = true;
        for (Stage stage : {Stage::kQk, Stage::kSoftmax, Stage::kPv, Stage::kTile}) {
          auto it = seconds().find(bench_name(kv, keys, rows, layout, stage));
          all = all && it != seconds().end();
          ns[static_cast<int>(stage)] = all ? it->second * 1e9 : 0;
        }
        if (!all) continue;
        const double read_ns = stage_bytes(Stage::kTile, keys, kv) / m.dram_read_gbps;
        const double peak = 2 * stage_macs(Stage::kTile, keys, rows) / ns[3] / m.fp32_peak_gflops;
        const std::string label = kv_name(kv) + " rows" + std::to_string(rows) + " keys" +
                                  std::to_string(keys) + " " + layout_name(layout);
        std::printf("  %-28s %8.0f %8.0f %8.0f %8.0f %8.0f %8.0f %13.3f\n", label.c_str(), ns[0],
                    ns[1], ns[2], ns[0] + ns[1] + ns[2], ns[3], read_ns, peak);
      }
}

}  // namespace
}  // namespace attnkit

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  attnkit::register_all();
  const attnkit::MachineProfile& m = attnkit::one_thread();
  std::printf("kernels %s; 1 thread: fp32 FMA peak %.1f GFLOP/s, DRAM read %.1f GB/s\n",
              attnkit::simd_target_name(attnkit::simd_target()), m.fp32_peak_gflops,
              m.dram_read_gbps);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  attnkit::summary();
  return 0;
}
