#include "service/health/serving_state.h"

#include <utility>

namespace laprox::service {

void ServingState::AddPublisher(Publisher publisher) {
  absl::MutexLock lock(&mu_);
  publishers_.push_back(std::move(publisher));
  const bool live = LiveLocked();
  publishers_.back()("", live);
  publishers_.back()(readiness_service_, live && models_ > 0);
}

void ServingState::SetModels(int64_t models) {
  absl::MutexLock lock(&mu_);
  models_ = models;
  PublishLocked();
}

bool ServingState::BackendFailed(const absl::Status& cause) {
  absl::MutexLock lock(&mu_);
  if (!backend_failure_.ok()) return false;
  // An OK cause would leave the state live; a failure is a failure whatever it says.
  backend_failure_ = cause.ok() ? absl::UnavailableError("the backend failed") : cause;
  PublishLocked();
  return true;
}

void ServingState::ShutDown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  PublishLocked();
}

bool ServingState::live() const {
  absl::MutexLock lock(&mu_);
  return LiveLocked();
}

bool ServingState::ready() const {
  absl::MutexLock lock(&mu_);
  return LiveLocked() && models_ > 0;
}

absl::Status ServingState::backend_failure() const {
  absl::MutexLock lock(&mu_);
  return backend_failure_;
}

void ServingState::PublishLocked() {
  const bool live = LiveLocked();
  for (const Publisher& publish : publishers_) {
    publish("", live);
    publish(readiness_service_, live && models_ > 0);
  }
}

}  // namespace laprox::service
