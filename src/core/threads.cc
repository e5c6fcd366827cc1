#include "core/threads.h"

#include <atomic>
#include <chrono>
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

// Polls done() for about `micros` microseconds; returns done(). Between
// batches of polls (~3 us of the CPU's pause hint) it yields the CPU, so
// that a thread that is ready to run on it (another pool's worker, the
// caller's next work) is not held up by the wait.
template <class Done>
bool spin_until(const Done& done, int64_t micros) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::yield();
  }
}

// How long a thread polls before it sleeps on a condition variable, in
// microseconds. Waking a sleeping thread took 20-60 us on a 2-vCPU VM
// (Intel Xeon, family 6, model 167), ~5 % of a 1.2 ms indexer pass each
// way. A worker polls for the next region briefly after its own (regions
// that follow at once: a decode step's indexer then its attention), so
// as not to hold a CPU that other work wants; after a prewake, whose
// caller promised a region soon, and in the caller waiting for the
// workers' last tasks (it would only sleep), longer.
constexpr int64_t kPollAfterRegion = 50, kPollAfterPrewake = 200, kPollForWorkers = 200;

// Workers are created on first need and live until process exit; a region
// wakes only as many as it uses. Waiting is a short spin, then a condition
// variable.
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // Wakes the sleeping workers (creating none) to poll for the next region.
  void prewake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (threads_.empty()) return;
      ++poke_;
    }
    wake_.notify_all();
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
      running_.store(helpers, std::memory_order_relaxed);
      // Release: a spinning worker that sees the new generation sees the
      // region's fields.
      generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    wake_.notify_all();
    tl_in_region = true;
    claim_tasks(0);
    tl_in_region = false;
    // Acquire: the workers' tasks' writes are visible once running_ is 0.
    const auto finished = [this] { return running_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(finished, kPollForWorkers)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, finished);
    }
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
    uint64_t seen = 0, poked = 0;
    bool prewoken = false;
    for (;;) {
      const auto news = [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      };
      if (!spin_until(news, prewoken ? kPollAfterPrewake : kPollAfterRegion)) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return news() || poke_ != poked; });
        poked = poke_;
        prewoken = !news();
        if (prewoken) continue;  // woken ahead of a region: poll for it
      }
      prewoken = false;
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = generation_.load(std::memory_order_relaxed);
      const bool in_region = index < helpers_;
      lock.unlock();
      if (!in_region) continue;
      claim_tasks(index + 1);
      // The last one out wakes the caller if it sleeps: under mu_, so the
      // wake cannot fall between the caller's test of running_ and its
      // wait.
      if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> guard(mu_);
        done_.notify_one();
      }
    }
  }

  std::mutex region_mu_;  // one region at a time
  std::mutex mu_;         // guards what follows (the atomics' stores; a worker's
                          // spin reads generation_ and stop_ without it)
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> generation_{0};
  int helpers_ = 0;
  uint64_t poke_ = 0;            // prewake() calls
  std::atomic<int> running_{0};  // workers of the region not yet done
  std::atomic<bool> stop_{false};
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

void parallel_prewake(int num_threads) {
  if (num_threads > 1 && !tl_in_region) pool().prewake();
}

void parallel_for(int64_t num_tasks, int num_threads, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  const int64_t threads = num_threads < num_tasks ? num_threads : num_tasks;
  const int helpers = clamp_threads(threads) - 1;
  if (helpers > 0 && !tl_in_region && pool().run(num_tasks, helpers, fn)) return;
  for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
}

}  // namespace attnkit
