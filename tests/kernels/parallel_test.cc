// WorkerPool (kernels/common/parallel.h): every item runs exactly once, worker indices stay below
// the call's `threads` and never overlap, concurrent and nested callers each get the workers
// they ask for, threads are named and the destructor joins them.
#include "common/parallel.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace laprox::kernels {
namespace {

// Runs every body on a thread of its own, all at once, and joins them.
void RunConcurrently(int callers, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  threads.reserve(callers);
  for (int c = 0; c < callers; ++c) threads.emplace_back(body, c);
  for (std::thread& t : threads) t.join();
}

TEST(WorkerPoolTest, ConcurrentCallersRunEveryItemOnceOnWorkersInRange) {
  WorkerPool pool("laprox-test");
  constexpr int kCallers = 4, kRounds = 50;
  constexpr int64_t kItems = 257;
  std::atomic<int> failures{0};
  RunConcurrently(kCallers, [&](int caller) {
    const int threads = 1 + caller;  // 1..4 workers: differently sized teams at once
    for (int round = 0; round < kRounds; ++round) {
      std::vector<std::atomic<int>> runs(kItems);
      std::vector<std::atomic<bool>> busy(threads);
      pool.ParallelFor(kItems, threads, [&](int64_t item, int worker) {
        if (worker < 0 || worker >= threads) {
          failures.fetch_add(1);
          return;
        }
        // Two items on the same worker index at once would share its scratch.
        if (busy[worker].exchange(true)) failures.fetch_add(1);
        runs[item].fetch_add(1);
        busy[worker].store(false);
      });
      // Read right after the return: every item is done, none twice.
      for (int64_t item = 0; item < kItems; ++item) {
        if (runs[item].load() != 1) failures.fetch_add(1);
      }
    }
  });
  EXPECT_EQ(failures.load(), 0);
}

// Every worker of every call waits, inside fn, until the workers of all the calls have arrived:
// it finishes only if the concurrent calls together really have callers * threads workers
// running at once. A pool whose calls shared a fixed set of threads would time out here (a
// failure after 5 s, not a hang).
TEST(WorkerPoolTest, ConcurrentCallsEachGetTheirWorkersAtOnce) {
  WorkerPool pool("laprox-test");
  constexpr int kCallers = 3, kThreads = 3;
  std::mutex mu;
  std::condition_variable arrived;
  int present = 0, timeouts = 0;
  RunConcurrently(kCallers, [&](int) {
    pool.ParallelFor(kThreads, kThreads, [&](int64_t, int) {
      std::unique_lock<std::mutex> lock(mu);
      ++present;
      arrived.notify_all();
      if (!arrived.wait_for(lock, std::chrono::seconds(5),
                            [&] { return present == kCallers * kThreads; })) {
        ++timeouts;
      }
    });
  });
  EXPECT_EQ(timeouts, 0);
  EXPECT_EQ(pool.threads_started(), kCallers * (kThreads - 1));
}

TEST(WorkerPoolTest, NestedCallsComplete) {
  WorkerPool pool("laprox-test");
  std::atomic<int64_t> inner_items{0};
  pool.ParallelFor(4, 2, [&](int64_t, int) {
    pool.ParallelFor(100, 2, [&](int64_t, int) { inner_items.fetch_add(1); });
  });
  EXPECT_EQ(inner_items.load(), 400);
}

TEST(WorkerPoolTest, SequentialCallsReuseTheThreads) {
  WorkerPool pool("laprox-test");
  for (int call = 0; call < 20; ++call) {
    std::atomic<int64_t> items{0};
    pool.ParallelFor(64, 2, [&](int64_t, int) { items.fetch_add(1); });
    ASSERT_EQ(items.load(), 64);
  }
  EXPECT_EQ(pool.threads_started(), 1);
}

TEST(WorkerPoolTest, OneWorkerOrNoItemsRunOnTheCaller) {
  WorkerPool pool("laprox-test");
  const std::thread::id caller = std::this_thread::get_id();
  int64_t items = 0;
  pool.ParallelFor(10, 1, [&](int64_t, int worker) {
    EXPECT_EQ(worker, 0);
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ++items;
  });
  pool.ParallelFor(0, 4, [&](int64_t, int) { ++items; });
  EXPECT_EQ(items, 10);
  EXPECT_EQ(pool.threads_started(), 0);
}

// A thread_local object is destroyed when its thread exits, so counting those destructions
// tells whether the pool's destructor waited for every thread to end.
std::atomic<int> exited_threads{0};
struct ExitCounter {
  bool armed = false;
  ~ExitCounter() {
    if (armed) exited_threads.fetch_add(1);
  }
};
thread_local ExitCounter exit_counter;

TEST(WorkerPoolTest, ThreadsAreNamedAndTheDestructorJoinsThem) {
  exited_threads = 0;
  auto pool = std::make_unique<WorkerPool>("laprox-test");
  std::mutex mu;
  std::vector<std::string> names;
  std::atomic<int> present{0};
  pool->ParallelFor(3, 3, [&](int64_t, int worker) {
    // Hold every worker until all three have an item, so that both pool threads run one.
    present.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (present.load() < 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    if (worker == 0) return;
    exit_counter.armed = true;
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    std::lock_guard<std::mutex> lock(mu);
    names.emplace_back(name);
  });
  ASSERT_EQ(pool->threads_started(), 2);
  ASSERT_EQ(names.size(), 2u);
  for (const std::string& name : names) EXPECT_EQ(name.rfind("laprox-test-", 0), 0u) << name;
  EXPECT_NE(names[0], names[1]);
  EXPECT_EQ(exited_threads.load(), 0);
  pool.reset();
  EXPECT_EQ(exited_threads.load(), 2);
}

}  // namespace
}  // namespace laprox::kernels
