#include "core/threads.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace attnkit {
namespace {

using TaskFn = std::function<void(int64_t, int)>;

// True on pool threads always, and on a caller thread while it runs a
// region: a nested parallel_for must not wait for workers that are busy
// running its own parent.
thread_local bool tl_in_region = false;

int clamp_threads(int64_t n) {
  return static_cast<int>(n < 1 ? 1 : (n > kMaxThreads ? kMaxThreads : n));
}

// Workers are created on first need and live until process exit; a region
// wakes only as many as it uses. Waiting is a condition variable: a wake-up
// costs microseconds, which the kernels amortise over tasks of 10 us or more.
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // Runs the region on `helpers` pool threads plus the caller; false when
  // another region holds the pool (the caller then runs it alone).
  bool run(int64_t num_tasks, int helpers, const TaskFn& fn) {
    std::unique_lock<std::mutex> region(region_mu_, std::try_to_lock);
    if (!region.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(threads_.size()) < helpers) {
        const int index = static_cast<int>(threads_.size());
        threads_.emplace_back([this, index] { worker_main(index); });
      }
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_.store(0, std::memory_order_relaxed);
      helpers_ = helpers;
      running_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    tl_in_region = true;
    claim_tasks(0);
    tl_in_region = false;
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return running_ == 0; });
    fn_ = nullptr;
    return true;
  }

 private:
  void claim_tasks(int worker) {
    for (;;) {
      const int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
      if (task >= num_tasks_) return;
      (*fn_)(task, worker);
    }
  }

  void worker_main(int index) {
    tl_in_region = true;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= helpers_) continue;
      lock.unlock();
      claim_tasks(index + 1);
      lock.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex region_mu_;  // one region at a time
  std::mutex mu_;         // guards everything below except next_
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  uint64_t generation_ = 0;
  int helpers_ = 0;
  int running_ = 0;
  bool stop_ = false;
  const TaskFn* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_{0};
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int resolve_num_threads(int requested, const char* env_value, unsigned hardware_threads) {
  if (requested > 0) return clamp_threads(requested);
  if (env_value != nullptr && *env_value != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env_value, &end, 10);
    if (*end == '\0' && n > 0) return clamp_threads(n);
  }
  return clamp_threads(hardware_threads);
}

int resolve_num_threads(int requested) {
  static const int by_default = resolve_num_threads(0, std::getenv("ATTNKIT_NUM_THREADS"),
                                                    std::thread::hardware_concurrency());
  return requested > 0 ? clamp_threads(requested) : by_default;
}

void parallel_for(int64_t num_tasks, int num_threads, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  const int64_t threads = num_threads < num_tasks ? num_threads : num_tasks;
  const int helpers = clamp_threads(threads) - 1;
  if (helpers > 0 && !tl_in_region && pool().run(num_tasks, helpers, fn)) return;
  for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
}

}  // namespace attnkit
