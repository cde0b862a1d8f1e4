#include "common/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::kernels {

// One ParallelFor in flight: its items, and its helpers still running.
struct WorkerPool::Call {
  Call(int64_t count_in, absl::FunctionRef<void(int64_t, int)> fn_in)
      : count(count_in), fn(fn_in) {}

  const int64_t count;
  const absl::FunctionRef<void(int64_t, int)> fn;
  std::atomic<int64_t> next{0};
  int running = 0;  // helpers that took a slot and have not finished; guarded by the pool's mu_
  absl::CondVar done;

  void Run(int worker) {
    for (int64_t item = next.fetch_add(1); item < count; item = next.fetch_add(1)) {
      fn(item, worker);
    }
  }
};

WorkerPool::WorkerPool(std::string name) : name_(std::move(name)) {}

WorkerPool::~WorkerPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);  // only the threads themselves run now: none starts another
  }
  work_.SignalAll();
  for (std::thread& thread : threads) thread.join();
}

int WorkerPool::threads_started() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

void WorkerPool::ParallelFor(int64_t count, int threads, absl::FunctionRef<void(int64_t, int)> fn) {
  const int workers = static_cast<int>(std::clamp<int64_t>(count, 1, std::max(threads, 1)));
  Call call(count, fn);
  if (workers > 1) {
    absl::MutexLock lock(&mu_);
    for (int w = 1; w < workers; ++w) queue_.push_back({&call, w});
    // Every queued slot has a thread of its own: a call gets the workers it asked for even
    // while other calls hold the pool's threads.
    while (idle_ < static_cast<int>(queue_.size())) {
      const int index = static_cast<int>(threads_.size()) + 1;
      try {
        threads_.emplace_back([this, index] { ThreadMain(index); });
      } catch (const std::exception&) {
        break;  // the system refuses another thread: the caller runs what nobody takes
      }
      ++idle_;  // the thread waits for mu_, which this call holds
    }
  }
  if (workers > 1) work_.SignalAll();
  call.Run(0);
  if (workers == 1) return;
  // Every item is claimed: withdraw the slots nobody took, then wait for the helpers running.
  absl::MutexLock lock(&mu_);
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                              [&call](const Slot& slot) { return slot.call == &call; }),
               queue_.end());
  while (call.running != 0) call.done.Wait(&mu_);
}

void WorkerPool::ThreadMain(int index) {
  // Linux limits a thread's name to 15 characters; a longer one is refused, so cut it.
  const std::string thread_name = absl::StrCat(name_, "-", index).substr(0, 15);
  pthread_setname_np(pthread_self(), thread_name.c_str());
  mu_.Lock();
  while (true) {
    while (!stopping_ && queue_.empty()) work_.Wait(&mu_);
    if (queue_.empty()) break;  // stopping, and nothing left to run
    const Slot slot = queue_.front();
    queue_.pop_front();
    --idle_;
    ++slot.call->running;
    mu_.Unlock();
    slot.call->Run(slot.worker);
    mu_.Lock();
    ++idle_;
    // The caller may return (and destroy the call) as soon as running is 0 and the lock is free.
    if (--slot.call->running == 0) slot.call->done.SignalAll();
  }
  mu_.Unlock();
}

}  // namespace laprox::kernels
