// ServingState: laproxd's health and readiness, decided in one place and pushed to whoever
// reports it (the grpc.health.v1 services of the main and the probe server, the Prometheus
// gauges).
//
// Two statuses: liveness (health service "") is SERVING from start until shutdown, or until the
// backend fails for good (a sticky CUDA error: the context is unusable until the process
// restarts, so the orchestrator should restart it); readiness (the service named at
// construction, "laprox.v1.Laprox") is SERVING while at least one model is registered and
// liveness holds. Once the backend failed or shutdown began, nothing makes either SERVING again.
//
// Thread-safe: every method may be called from any thread; publishers are called with the
// state's lock held, in the order they were added, and must not call back into it.
#ifndef LAPROX_SERVICE_HEALTH_SERVING_STATE_H_
#define LAPROX_SERVICE_HEALTH_SERVING_STATE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace laprox::service {

class ServingState {
 public:
  // Receives (service, serving) for both services whenever the state may have changed: "" for
  // liveness, the readiness service's name for readiness.
  using Publisher = std::function<void(const std::string& service, bool serving)>;

  explicit ServingState(std::string readiness_service)
      : readiness_service_(std::move(readiness_service)) {}
  ServingState(const ServingState&) = delete;
  ServingState& operator=(const ServingState&) = delete;

  // Adds a publisher and publishes the current state to it at once.
  void AddPublisher(Publisher publisher);
  // The number of registered models changed (the readiness input).
  void SetModels(int64_t models);
  // The backend failed for good: both statuses NOT_SERVING from now on. Returns true for the
  // first call (the caller logs the cause once), false after.
  bool BackendFailed(const absl::Status& cause);
  // Shutdown began: both statuses NOT_SERVING from now on.
  void ShutDown();

  bool live() const;
  bool ready() const;
  // OK, or the cause BackendFailed was given first.
  absl::Status backend_failure() const;

 private:
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool LiveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return backend_failure_.ok() && !shut_down_;
  }

  const std::string readiness_service_;
  mutable absl::Mutex mu_;
  std::vector<Publisher> publishers_ ABSL_GUARDED_BY(mu_);
  int64_t models_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status backend_failure_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_HEALTH_SERVING_STATE_H_
