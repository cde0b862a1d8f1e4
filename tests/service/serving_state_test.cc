// ServingState: what laproxd's health services and gauges report, from start through models
// coming and going, a backend failure and shutdown. Each publisher records the last status it
// was given per service, as a grpc.health.v1 service would hold it.
#include "service/health/serving_state.h"

#include <map>
#include <string>

#include <gtest/gtest.h>

namespace laprox::service {
namespace {

constexpr char kReadiness[] = "laprox.v1.Laprox";

struct Recorder {
  std::map<std::string, bool> status;
  int calls = 0;
  ServingState::Publisher publisher() {
    return [this](const std::string& service, bool serving) {
      status[service] = serving;
      ++calls;
    };
  }
  bool live() const { return status.at(""); }
  bool ready() const { return status.at(kReadiness); }
};

TEST(ServingStateTest, LiveAtOnceAndReadyOnlyWhileAModelIsRegistered) {
  ServingState state(kReadiness);
  Recorder health;
  state.AddPublisher(health.publisher());
  EXPECT_TRUE(health.live());
  EXPECT_FALSE(health.ready());
  state.SetModels(2);
  EXPECT_TRUE(health.ready());
  EXPECT_TRUE(state.ready());
  state.SetModels(0);
  EXPECT_FALSE(health.ready());
  EXPECT_TRUE(health.live());
  EXPECT_TRUE(state.live());
}

TEST(ServingStateTest, ALatePublisherGetsTheCurrentState) {
  ServingState state(kReadiness);
  state.SetModels(1);
  Recorder probe;
  state.AddPublisher(probe.publisher());
  EXPECT_TRUE(probe.live());
  EXPECT_TRUE(probe.ready());
}

TEST(ServingStateTest, ABackendFailureIsNotServingForGood) {
  ServingState state(kReadiness);
  Recorder health, metrics;
  state.AddPublisher(health.publisher());
  state.AddPublisher(metrics.publisher());
  state.SetModels(1);
  EXPECT_TRUE(state.BackendFailed(absl::UnavailableError("CUDA context lost")));
  EXPECT_FALSE(state.BackendFailed(absl::InternalError("again"))) << "reported once";
  EXPECT_EQ(state.backend_failure().message(), "CUDA context lost");
  for (const Recorder* r : {&health, &metrics}) {
    EXPECT_FALSE(r->live());
    EXPECT_FALSE(r->ready());
  }
  state.SetModels(3);  // models registered later do not bring it back
  EXPECT_FALSE(health.ready());
  EXPECT_FALSE(health.live());
  Recorder late;
  state.AddPublisher(late.publisher());
  EXPECT_FALSE(late.live());
}

TEST(ServingStateTest, AnOkCauseStillCountsAsAFailure) {
  ServingState state(kReadiness);
  EXPECT_TRUE(state.BackendFailed(absl::OkStatus()));
  EXPECT_FALSE(state.live());
  EXPECT_FALSE(state.backend_failure().ok());
}

TEST(ServingStateTest, ShutdownTurnsBothOffAndModelsCannotUndoIt) {
  ServingState state(kReadiness);
  Recorder health;
  state.AddPublisher(health.publisher());
  state.SetModels(1);
  state.ShutDown();
  EXPECT_FALSE(health.live());
  EXPECT_FALSE(health.ready());
  state.SetModels(1);
  EXPECT_FALSE(health.ready());
  EXPECT_TRUE(state.backend_failure().ok()) << "a shutdown is not a backend failure";
}

}  // namespace
}  // namespace laprox::service
