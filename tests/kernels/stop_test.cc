// kernels::StopSignal and the CPU backend's checks of it (issue 34): a signal latches on the
// first reason it sees; a computation that is stopped — before it starts, or at any of its checks
// while it runs — answers that status and nothing else, for LaProx and every baseline, for
// batches and for model preparation; a signal that never fires changes no bit of the plan.
#include "laprox/kernels/stop.h"

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "laprox/kernels/registry.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using Clock = StopSignal::Clock;
using testing::TinyCase;

constexpr int L = 2, H = 4, Hkv = 2, d = 8, D = 16, kRows = 8;
constexpr int64_t kN = 96;

TEST(StopSignalTest, LatchesTheFirstReason) {
  EXPECT_TRUE(StopSignal().Check().ok());
  const StopSignal expired(Clock::now() - std::chrono::seconds(1), nullptr);
  EXPECT_EQ(expired.Check().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(expired.Check("scoring").message()),
              ::testing::HasSubstr("deadline passed; scoring stopped"));
  EXPECT_TRUE(expired.stopped());

  std::atomic<bool> cancelled{false};
  const StopSignal live(Clock::now() + std::chrono::hours(1), [&] { return cancelled.load(); });
  EXPECT_TRUE(live.Check().ok());
  cancelled = true;
  // The callback is asked at most every kPollInterval.
  const auto give_up = Clock::now() + std::chrono::seconds(5);
  while (live.Check().ok() && Clock::now() < give_up) {
  }
  EXPECT_EQ(live.Check().code(), absl::StatusCode::kCancelled);
  cancelled = false;  // latched: the first reason stays
  EXPECT_EQ(live.Check().code(), absl::StatusCode::kCancelled);

  const StopSignal cancelled_by_server(Clock::now() + std::chrono::hours(1), nullptr);
  cancelled_by_server.Cancel();
  EXPECT_EQ(cancelled_by_server.Check().code(), absl::StatusCode::kCancelled);
}

std::vector<PolicyKind> AllKinds() {
  return {PolicyKind::kLaprox,        PolicyKind::kStreamingLlm, PolicyKind::kSnapKv,
          PolicyKind::kPyramidKv,     PolicyKind::kAdaKv,        PolicyKind::kCriticalKv,
          PolicyKind::kCriticalAdaKv, PolicyKind::kCake};
}

class StopTest : public ::testing::TestWithParam<PolicyKind> {
 protected:
  void SetUp() override {
    c_.Randomize(34);
    c_.policy = PolicySpec::ForKind(GetParam());
    c_.policy.window = kRows;
    c_.policy.budget = Budget::TokensPerHead(40);
    backend_ = *CreateBackend("cpu", {.threads = 2});
    model_ = *backend_->PrepareModel(c_.geometry, c_.OProjViews());
  }

  TinyCase c_{L, H, Hkv, d, D, kN, kRows};
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const PreparedModel> model_;
};

TEST_P(StopTest, ASignalThatNeverFiresChangesNothing) {
  KeepPlanRequest request = c_.Request();
  request.outputs.scores = true;
  const absl::StatusOr<KeepPlan> plain = backend_->ComputeKeepPlan(*model_, request);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const StopSignal never(Clock::now() + std::chrono::hours(1), [] { return false; });
  request.stop = &never;
  const absl::StatusOr<KeepPlan> checked = backend_->ComputeKeepPlan(*model_, request);
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(plain->positions, checked->positions);
  EXPECT_EQ(plain->scores, checked->scores);  // the same bits
}

TEST_P(StopTest, AnExpiredSignalComputesNothing) {
  KeepPlanRequest request = c_.Request();
  const StopSignal expired(Clock::now() - std::chrono::seconds(1), nullptr);
  request.stop = &expired;
  EXPECT_EQ(backend_->ComputeKeepPlan(*model_, request).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  std::vector<KeepPlanRequest> batch = {c_.Request(), c_.Request()};
  batch[1].stop = &expired;
  EXPECT_EQ(backend_->ComputeKeepPlans(*model_, batch).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

// Cancelled at its k-th check for k = 1, 2, ...: every such run answers CANCELLED, until k is
// beyond the checks the computation makes and it answers its plan (the same as without a
// signal). A check whose status were dropped would let a cancelled run answer a plan (or
// another error) before that: ignoring the stop in the baselines' selection fails here.
TEST_P(StopTest, CancelledAtAnyCheckAnswersCancelled) {
  const KeepPlanRequest base = c_.Request();
  const absl::StatusOr<KeepPlan> plain = backend_->ComputeKeepPlan(*model_, base);
  ASSERT_TRUE(plain.ok()) << plain.status();
  int runs = 0;
  for (int k = 1;; ++k, ++runs) {
    std::atomic<int> looks{0};
    // Asked at every check (poll interval 0): the k-th check stops the computation.
    const StopSignal at_k(
        Clock::now() + std::chrono::hours(1), [&looks, k] { return looks.fetch_add(1) + 1 >= k; },
        std::chrono::microseconds(0));
    KeepPlanRequest request = base;
    request.stop = &at_k;
    const absl::StatusOr<KeepPlan> plan = backend_->ComputeKeepPlan(*model_, request);
    if (plan.ok()) {
      EXPECT_EQ(plan->positions, plain->positions);
      break;
    }
    ASSERT_EQ(plan.status().code(), absl::StatusCode::kCancelled) << "k = " << k << plan.status();
    ASSERT_LT(k, 100000);
  }
  EXPECT_GE(runs, 1);  // at least the first look stops it
}

INSTANTIATE_TEST_SUITE_P(EveryKind, StopTest, ::testing::ValuesIn(AllKinds()),
                         [](const ::testing::TestParamInfo<PolicyKind>& info) {
                           return std::string(PolicyKindName(info.param));
                         });

TEST(StopPrepareTest, AnExpiredSignalPreparesNothing) {
  TinyCase c(L, H, Hkv, d, D, kN, kRows);
  c.Randomize(35);
  auto backend = *CreateBackend("cpu", {.threads = 2});
  const StopSignal expired(Clock::now() - std::chrono::seconds(1), nullptr);
  EXPECT_EQ(backend->PrepareModel(c.geometry, c.OProjViews(), {}, &expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const StopSignal never(Clock::now() + std::chrono::hours(1), nullptr);
  EXPECT_TRUE(backend->PrepareModel(c.geometry, c.OProjViews(), {}, &never).ok());
}

}  // namespace
}  // namespace laprox::kernels
