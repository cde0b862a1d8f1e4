// WorkQueue: a fixed set of worker threads running blocking jobs (keep-plans, model
// preparation, region draining) off the gRPC callback threads, with a bounded backlog.
#ifndef LAPROX_SERVICE_CORE_WORK_QUEUE_H_
#define LAPROX_SERVICE_CORE_WORK_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace laprox::service {

class WorkQueue {
 public:
  // `workers` threads; at most `max_pending` jobs wait beyond those running.
  WorkQueue(int workers, int64_t max_pending);
  // Runs every job already accepted, then joins the workers.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `job`. RESOURCE_EXHAUSTED when the backlog is full, UNAVAILABLE after Shutdown.
  absl::Status Submit(std::function<void()> job);
  // Refuses new jobs; those accepted still run.
  void Shutdown();

 private:
  void Run();

  const int64_t max_pending_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_WORK_QUEUE_H_
