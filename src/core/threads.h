// A small persistent thread pool for the kernels.
//
// Kernels cut their work into a task list that depends only on the problem
// (shapes, masks, tile policy), never on the number of threads, and every
// task writes its own outputs or its own scratch slot. parallel_for() then
// hands tasks out in increasing order from a shared counter; which thread
// runs which task varies from run to run, but no result depends on it, so
// a kernel's output is the same bits for 1, 2 or 64 threads.
#pragma once

#include <cstdint>
#include <functional>

namespace attnkit {

// The most threads one parallel region uses (the caller included); larger
// requests are clamped to it.
inline constexpr int kMaxThreads = 256;

// The thread count for a call: `requested` when > 0; else the environment
// variable ATTNKIT_NUM_THREADS when it holds a positive integer; else the
// number of hardware threads (at least 1). Clamped to [1, kMaxThreads].
// The environment is read once per process.
int resolve_num_threads(int requested);

// The same rule with the environment value and hardware count passed in
// (env_value may be nullptr), so that tests can exercise it.
int resolve_num_threads(int requested, const char* env_value, unsigned hardware_threads);

// Runs fn(task, worker) once for every task in [0, num_tasks) on up to
// `num_threads` threads (already resolved, >= 1; the calling thread takes
// part as worker 0). `worker` is in [0, num_threads) and only says which
// per-thread scratch slot the task may use; at most one task runs on a
// worker at a time. Tasks start in increasing order, so callers put their
// most expensive tasks first to balance the tail. Returns when every task
// has finished. fn must not throw.
//
// A call made from inside a task, or while another thread's region is
// running, runs all its tasks on the calling thread as worker 0 — it never
// waits for the pool, so it cannot deadlock.
void parallel_for(int64_t num_tasks, int num_threads,
                  const std::function<void(int64_t task, int worker)>& fn);

// A hint before a parallel_for on num_threads that follows within ~200 us
// after serial work: wakes the pool's sleeping workers now, so that their
// wake-up (20-60 us on a VM) overlaps that work instead of the region's
// start. Changes no result; does nothing inside a region or before the
// pool's first region.
void parallel_prewake(int num_threads);

}  // namespace attnkit
