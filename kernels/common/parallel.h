// WorkerPool: persistent, named threads that run the items of ParallelFor calls; one pool per
// backend, joined when the backend is destroyed.
//
// How concurrent callers share it. laproxd computes several requests at once (--workers,
// --heavy_workers), each asking for `threads` workers (--threads), as each did when every call
// started its own threads. A call is a team: the caller is worker 0 and runs items itself, and
// `threads - 1` helper slots are queued for the pool. The pool starts a new thread whenever the
// queued slots outnumber its idle threads, so it grows to threads - 1 times the largest number
// of calls ever in flight at once and no call gets fewer workers than it asked for. A call never
// waits for a free pool thread: once the caller has run out of items it withdraws its slots that
// no thread has taken yet, and waits only for the helpers that are running its items.
#ifndef LAPROX_KERNELS_COMMON_PARALLEL_H_
#define LAPROX_KERNELS_COMMON_PARALLEL_H_

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace laprox::kernels {

class WorkerPool {
 public:
  // Threads are named "<name>-<k>" (k = 1, 2, ... in start order; Linux keeps 15 characters).
  // No thread starts before the first ParallelFor that needs one.
  explicit WorkerPool(std::string name);
  // Joins every thread. No ParallelFor may be running.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Calls fn(item, worker) exactly once for every item in [0, count) on min(threads, count)
  // workers, the calling thread being worker 0 and the others pool threads; worker < threads, and
  // two calls of fn with the same worker never overlap (so `worker` may index per-worker scratch).
  // Items are claimed in increasing order. Returns when every item is done. `fn` must not throw.
  // Thread-safe: any number of threads may call it at once, and fn may call it again (nested).
  void ParallelFor(int64_t count, int threads, absl::FunctionRef<void(int64_t, int)> fn);

  // Threads started so far (they stay until the destructor).
  int threads_started() const;

 private:
  struct Call;
  struct Slot {
    Call* call;
    int worker;
  };

  void ThreadMain(int index);

  const std::string name_;
  mutable absl::Mutex mu_;
  absl::CondVar work_;                           // a slot was queued, or stopping_
  std::deque<Slot> queue_ ABSL_GUARDED_BY(mu_);  // helper slots no thread has taken yet
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads not running a slot (waiting, or about to take one)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_COMMON_PARALLEL_H_
