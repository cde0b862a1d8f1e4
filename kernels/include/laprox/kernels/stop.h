// StopSignal: when a computation must give up before it is done — its caller's deadline passed
// or its caller went away (a cancelled call, a server shutting down).
//
// The backends check it at bounded intervals of work: per chunk of keys or values, per window
// row of a softmax pass, per (layer, KV head) task, per sequence of a batch, per row of every
// pass of the selection. Between two checks a worker thread does at most a few milliseconds of
// work at the sizes the service admits (bench/RESULTS.md, "Stalls: work after a deadline"), so a
// call whose deadline passes stops computing within that time and its status says why.
//
//   StopSignal stop(deadline, [context] { return context->IsCancelled(); });
//   request.stop = &stop;
//   backend.ComputeKeepPlan(model, request);   // CANCELLED / DEADLINE_EXCEEDED once stopped
//
// Thread safety: Check() may be called from any number of threads at once. The signal latches:
// once one check has seen the deadline pass or the call cancelled, every later check answers
// the same status.
#ifndef LAPROX_KERNELS_STOP_H_
#define LAPROX_KERNELS_STOP_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace laprox::kernels {

class StopSignal {
 public:
  using Clock = std::chrono::steady_clock;
  // How often the `cancelled` callback is asked at most (the deadline is read at every check).
  static constexpr std::chrono::microseconds kPollInterval{500};

  // Never stops.
  StopSignal() = default;
  // Stops once `deadline` has passed or `cancelled` (may be empty: never) returns true, asked at
  // most every `poll_interval` (0: at every check, for tests that stop at each check in turn).
  // `cancelled` must be safe to call from any thread while the signal is in use.
  StopSignal(Clock::time_point deadline, std::function<bool()> cancelled,
             std::chrono::microseconds poll_interval = kPollInterval);
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // OK while the work may go on; CANCELLED ("the call was cancelled; <doing> stopped") or
  // DEADLINE_EXCEEDED ("the call's deadline passed; <doing> stopped") once it must stop. Costs
  // one clock read, plus the `cancelled` callback at most every poll interval.
  absl::Status Check(const char* doing = "computing") const;
  // Whether a check has seen the signal (latched).
  bool stopped() const { return state_.load(std::memory_order_relaxed) != kRunning; }
  // Stops every later check with CANCELLED (a server stopping its own work).
  void Cancel() const;

 private:
  enum State : int { kRunning = 0, kCancelled = 1, kDeadline = 2 };

  absl::Status StatusOf(int state, const char* doing) const;

  Clock::time_point deadline_ = Clock::time_point::max();
  std::function<bool()> cancelled_;
  Clock::duration poll_interval_ = kPollInterval;
  mutable std::atomic<int> state_{kRunning};
  // Clock::time_point::rep of the next time `cancelled_` may be asked.
  mutable std::atomic<int64_t> next_poll_{0};
};

// `stop` may be null (nothing stops the work): OK then.
inline absl::Status CheckStop(const StopSignal* stop, const char* doing = "computing") {
  return stop == nullptr ? absl::OkStatus() : stop->Check(doing);
}

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_STOP_H_
