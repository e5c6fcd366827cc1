// The fast CPU attention kernel's entry points (attention_cpu.h): the
// call's plan (task_plan.h), its tasks run over the threads (task_runner.h,
// one file per stage of a tile), then the merge of split partials. This
// code is portable C++; everything per tile that is arithmetic goes
// through the active target's KernelTable.
#include "kernels/cpu/attention_cpu.h"

#include <algorithm>

#include "core/threads.h"
#include "kernels/cpu/task_plan.h"
#include "kernels/cpu/task_runner.h"
#include "kernels/cpu/tile_policy.h"

namespace attnkit::kernels::cpu {

const KernelTable* kernel_table(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar:
      return scalar_kernel_table();
    case SimdTarget::kAvx2:
      return avx2_kernel_table();
    case SimdTarget::kAvx512:
      return avx512_kernel_table();
    case SimdTarget::kAvx512Bf16:
      return avx512bf16_kernel_table();
  }
  return nullptr;
}

bool supports(const AttentionParams& p) {
  if (p.probs != nullptr || p.k_stride.dim != 1 || p.v_stride.dim != 1) return false;
  switch (p.kv_dtype) {
    case DType::kF32:
    case DType::kBF16:
      return true;
    case DType::kI8:
    case DType::kFp8E4M3:
      // Block scales: a vector of codes shares one scale, blocks adjacent.
      return p.scale_block == 0 ||
             (p.scale_block % 16 == 0 && p.k_scale_stride.dim == 1 && p.v_scale_stride.dim == 1);
    default:
      return false;
  }
}

size_t scratch_bytes(const AttentionParams& params, const Plan& plan) {
  return make_geometry(params, plan).total;
}

void attention(const AttentionParams& p, const Plan& plan, void* scratch) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
  const Geometry g = make_geometry(p, plan);
  char* base_ptr = static_cast<char*>(scratch);
  base_ptr += (kAlign - reinterpret_cast<uintptr_t>(base_ptr) % kAlign) % kAlign;
  Task* tasks = reinterpret_cast<Task*>(base_ptr + g.tasks_at);
  Base* bases = reinterpret_cast<Base*>(base_ptr + g.bases_at);
  float* parts = reinterpret_cast<float*>(base_ptr + g.parts_at);
  float* workers = reinterpret_cast<float*>(base_ptr + g.workers_at);

  // Task list: a function of the shapes only.
  int64_t num_parts = 0;
  const int64_t num_tasks = plan_tasks(p, plan, g, bases, tasks, &num_parts);

  const Call call{p, g, bases, parts};
  const int threads = static_cast<int>(std::min<int64_t>(g.workers, num_tasks));
  parallel_for(num_tasks, threads, [&](int64_t t, int worker) {
    TaskRunner(call, workers + worker * g.worker_floats).run(tasks[t]);
  });
  if (num_parts == 0) return;
  // Merge items: (base, kv head, block of rows), so that a call with one
  // split base (absorbed MLA: 128 rows of one kv head) merges on all
  // threads; merging there took 5 % of a 2-thread call on one thread.
  const int64_t row_blocks = ceil_div(g.m_max, kMergeRows);
  const int64_t items = g.bases * g.heads * row_blocks;
  parallel_for(
      items, static_cast<int>(std::min<int64_t>(g.workers, items)), [&](int64_t item, int worker) {
        const Base& base = bases[item / (g.heads * row_blocks)];
        const int64_t hh = item / row_blocks % g.heads;
        const int64_t m0 = item % row_blocks * kMergeRows;
        const int64_t m_count = std::min(g.bq, p.rows_of(base.b) - base.qb * g.bq) * g.group;
        if (base.parts < 2 || hh >= std::min(g.heads, p.num_kv_heads - base.g) || m0 >= m_count)
          return;
        merge(call, base, hh, m0, std::min(m0 + kMergeRows, m_count),
              workers + worker * g.worker_floats);
      });
}

}  // namespace attnkit::kernels::cpu
