#include "core/threads.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace attnkit {
namespace {

TEST(Threads, ResolveNumThreads) {
  EXPECT_EQ(resolve_num_threads(3, "5", 8), 3);      // the call wins
  EXPECT_EQ(resolve_num_threads(0, "5", 8), 5);      // then the environment
  EXPECT_EQ(resolve_num_threads(0, nullptr, 8), 8);  // then the hardware
  EXPECT_EQ(resolve_num_threads(0, "", 8), 8);
  EXPECT_EQ(resolve_num_threads(0, "0", 8), 8);  // not positive: ignored
  EXPECT_EQ(resolve_num_threads(0, "-2", 8), 8);
  EXPECT_EQ(resolve_num_threads(0, "4x", 8), 8);     // not an integer: ignored
  EXPECT_EQ(resolve_num_threads(0, nullptr, 0), 1);  // unknown hardware: 1
  EXPECT_EQ(resolve_num_threads(100000, nullptr, 8), kMaxThreads);
  EXPECT_EQ(resolve_num_threads(0, "100000", 8), kMaxThreads);
  EXPECT_GE(resolve_num_threads(0), 1);
  EXPECT_EQ(resolve_num_threads(2), 2);
}

// Every task runs exactly once, on a worker index below the thread count,
// and a worker never runs two tasks at once (its scratch would be shared).
TEST(Threads, ParallelForRunsEveryTaskOnce) {
  for (int threads : {1, 2, 3, 7}) {
    for (int64_t tasks : {0, 1, 2, 5, 100, 1000}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
      std::vector<std::atomic<int>> busy(static_cast<size_t>(threads));
      std::atomic<int> bad_worker{0}, overlap{0};
      parallel_for(tasks, threads, [&](int64_t t, int w) {
        if (w < 0 || w >= threads) {
          ++bad_worker;
          return;
        }
        if (busy[w].fetch_add(1) != 0) ++overlap;
        runs[t].fetch_add(1);
        busy[w].fetch_sub(1);
      });
      EXPECT_EQ(bad_worker.load(), 0);
      EXPECT_EQ(overlap.load(), 0);
      for (int64_t t = 0; t < tasks; ++t)
        ASSERT_EQ(runs[t].load(), 1)
            << "task " << t << " of " << tasks << ", " << threads << " threads";
    }
  }
}

// With two threads, two tasks that each wait for the other to start can
// only finish if they really run at the same time. (The wait is bounded so
// that a broken pool fails instead of hanging.)
TEST(Threads, ParallelForRunsTasksConcurrently) {
  std::atomic<int> started{0};
  std::atomic<int> met{0};
  parallel_for(2, 2, [&](int64_t, int) {
    started.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (started.load() < 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    if (started.load() == 2) met.fetch_add(1);
  });
  EXPECT_EQ(met.load(), 2);
}

TEST(Threads, NestedParallelForRunsInline) {
  std::vector<std::atomic<int>> runs(8 * 16);
  parallel_for(8, 3, [&](int64_t outer, int) {
    parallel_for(16, 3, [&](int64_t inner, int w) {
      EXPECT_EQ(w, 0);
      runs[outer * 16 + inner].fetch_add(1);
    });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

TEST(Threads, ConcurrentCallersEachCompleteTheirTasks) {
  constexpr int kCallers = 4, kTasks = 200;
  std::vector<std::vector<std::atomic<int>>> runs(kCallers);
  for (auto& r : runs) r = std::vector<std::atomic<int>>(kTasks);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 20; ++rep)
        parallel_for(kTasks / 20, 3, [&](int64_t t, int) { runs[c][rep * 10 + t].fetch_add(1); });
    });
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c)
    for (int t = 0; t < kTasks; ++t) ASSERT_EQ(runs[c][t].load(), 1) << c << " " << t;
}

// Workers wait by polling for a while, then sleeping, and a prewake
// wakes sleeping ones to poll again: regions that follow each other at
// once (workers polling), after a pause longer than the poll (asleep),
// after a prewake and after a prewake that no region followed, each with
// every task run once and its plain (non-atomic) writes seen by the caller
// when parallel_for returns.
TEST(Threads, RegionsAfterPollingSleepingAndPrewokenWorkersSeeEveryTask) {
  parallel_prewake(3);  // before the pool's first region: does nothing
  std::vector<int64_t> out(64);
  for (int round = 0; round < 40; ++round) {
    const int kind = round % 4;
    if (kind == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (kind == 2) parallel_prewake(3);
    if (kind == 3) {
      parallel_prewake(3);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::fill(out.begin(), out.end(), -1);
    parallel_for(64, 3, [&](int64_t t, int) { out[static_cast<size_t>(t)] = t * round; });
    for (int64_t t = 0; t < 64; ++t) ASSERT_EQ(out[static_cast<size_t>(t)], t * round) << round;
  }
}

}  // namespace
}  // namespace attnkit
