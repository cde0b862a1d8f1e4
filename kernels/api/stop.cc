#include "laprox/kernels/stop.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::kernels {

StopSignal::StopSignal(Clock::time_point deadline, std::function<bool()> cancelled,
                       std::chrono::microseconds poll_interval)
    : deadline_(deadline),
      cancelled_(std::move(cancelled)),
      poll_interval_(std::chrono::duration_cast<Clock::duration>(poll_interval)) {}

absl::Status StopSignal::StatusOf(int state, const char* doing) const {
  if (state == kCancelled) {
    return absl::CancelledError(absl::StrCat("the call was cancelled; ", doing, " stopped"));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("the call's deadline passed; ", doing, " stopped"));
}

absl::Status StopSignal::Check(const char* doing) const {
  int state = state_.load(std::memory_order_relaxed);
  if (state != kRunning) return StatusOf(state, doing);
  const Clock::time_point now = Clock::now();
  if (now > deadline_) {
    state = kDeadline;
  } else if (cancelled_) {
    // The callback may take a lock (grpc::ServerContext::IsCancelled): ask it once per interval
    // across all threads, not at every check.
    const int64_t at = now.time_since_epoch().count();
    int64_t next = next_poll_.load(std::memory_order_relaxed);
    if (poll_interval_.count() <= 0) {
      if (cancelled_()) state = kCancelled;
    } else if (at >= next &&
               next_poll_.compare_exchange_strong(next, at + poll_interval_.count()) &&
               cancelled_()) {
      state = kCancelled;
    }
  }
  if (state == kRunning) return absl::OkStatus();
  int expected = kRunning;
  state_.compare_exchange_strong(expected, state);  // the first reason seen stays
  return StatusOf(state_.load(std::memory_order_relaxed), doing);
}

void StopSignal::Cancel() const {
  int expected = kRunning;
  state_.compare_exchange_strong(expected, kCancelled);
}

}  // namespace laprox::kernels
