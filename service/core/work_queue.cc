#include "service/core/work_queue.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::service {

WorkQueue::WorkQueue(int workers, int64_t max_pending) : max_pending_(max_pending) {
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Run(); });
}

WorkQueue::~WorkQueue() {
  Shutdown();
  for (std::thread& t : threads_) t.join();
}

absl::Status WorkQueue::Submit(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(jobs_.size()) >= max_pending_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request queue is full (", max_pending_, " waiting)"));
  }
  jobs_.push_back(std::move(job));
  return absl::OkStatus();
}

void WorkQueue::Shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
}

void WorkQueue::Run() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkQueue* q)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) { return q->stopping_ || !q->jobs_.empty(); },
          this));
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace laprox::service
