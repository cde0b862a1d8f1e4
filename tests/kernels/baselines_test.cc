// Hand-checked plans of the baseline policies (STREAMING_LLM, SNAPKV, PYRAMIDKV, ADAKV,
// CRITICALKV, CRITICAL_ADAKV, CAKE) on the CPU backend, their budget arithmetic, and their bad
// options. The arithmetic is in the comments; tests/reference/compare_test.py compares random
// cases with the float64 oracle.
//
// Most cases use d = 1, query 1, softmax scale 1 and keys log(a_j): the window row then gives
// key j the attention a_j / sum(a) over the keys it sees.
#include <cmath>
#include <limits>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "common/half.h"
#include "laprox/kernels/registry.h"
#include "policy/baselines.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using testing::TinyCase;

// Scores go through fp32 softmax (exp to 2e-7 relative) and means.
auto Near(float x) { return FloatNear(x, 1e-6f * std::abs(x)); }

std::vector<int32_t> Kept(const KeepPlan& plan, int layer, int head) {
  auto span = plan.kept(layer, head);
  return {span.begin(), span.end()};
}

// Keys log(a) for one KV head of one layer (d = 1), query rows 1.
void SetAttention(TinyCase& c, int layer, int kv_head, const std::vector<float>& a) {
  for (size_t j = 0; j < a.size(); ++j) c.keys[layer][kv_head * c.n + j] = std::log(a[j]);
  std::fill(c.queries[layer].begin(), c.queries[layer].end(), 1.f);
}

class BaselinesTest : public ::testing::Test {
 protected:
  absl::StatusOr<KeepPlan> Compute(const TinyCase& c, const PrepareOptions& options = {}) {
    auto model = backend_->PrepareModel(c.geometry, c.OProjViews(), options);
    if (!model.ok()) return model.status();
    return backend_->ComputeKeepPlan(**model, c.Request());
  }
  KeepPlan Plan(const TinyCase& c) {
    auto plan = Compute(c);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : KeepPlan{};
  }
  // One layer, one head, d = D = 1, window 1 (the last row sees every key), no pooling.
  static TinyCase OneHead(PolicyKind kind, const std::vector<float>& a) {
    TinyCase c(1, 1, 1, 1, 1, static_cast<int64_t>(a.size()), 1);
    c.policy = PolicySpec::ForKind(kind);
    c.policy.window = 1;
    c.policy.pooling = Pooling::kNone;
    SetAttention(c, 0, 0, a);
    return c;
  }

  std::unique_ptr<Backend> backend_ = *CreateBackend("cpu");
};

TEST(PolicySpecTest, ForKindGivesEachKindsDefaults) {
  EXPECT_EQ(PolicySpec::ForKind(PolicyKind::kLaprox).window, 32);
  EXPECT_EQ(PolicySpec::ForKind(PolicyKind::kLaprox).pool_kernel, 7);
  EXPECT_EQ(PolicySpec::ForKind(PolicyKind::kStreamingLlm).sinks, 4);
  for (PolicyKind k : {PolicyKind::kSnapKv, PolicyKind::kPyramidKv, PolicyKind::kAdaKv,
                       PolicyKind::kCriticalKv, PolicyKind::kCriticalAdaKv}) {
    const PolicySpec p = PolicySpec::ForKind(k);
    EXPECT_EQ(p.kind, k);
    EXPECT_EQ(p.window, 64) << PolicyKindName(k);
    EXPECT_EQ(p.pool_kernel, 5) << PolicyKindName(k);
    EXPECT_EQ(p.pooling, Pooling::kAvg) << PolicyKindName(k);
    EXPECT_EQ(p.sinks, 0) << PolicyKindName(k);
  }
  const PolicySpec cake = PolicySpec::ForKind(PolicyKind::kCake);
  EXPECT_EQ(cake.window, 32);
  EXPECT_EQ(cake.pool_kernel, 5);
  EXPECT_EQ(cake.baseline.cake_gamma, 200.0);
  EXPECT_EQ(cake.baseline.pyramid_beta, 20.0);
  EXPECT_EQ(cake.numeric_mode, NumericMode::kExact);
}

TEST(PolicySpecTest, RejectsBaselineParametersOutOfRangeNamingThem) {
  struct Bad {
    double BaselineParams::*field;
    double value;
    const char* message;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Bad& bad : {Bad{&BaselineParams::pyramid_beta, 0.5, "policy.pyramid_beta = 0.5"},
                         Bad{&BaselineParams::pyramid_beta, nan, "policy.pyramid_beta = nan"},
                         Bad{&BaselineParams::alpha_safeguard, 1.5, "policy.alpha_safeguard = 1.5"},
                         Bad{&BaselineParams::alpha_safeguard, -0.1, "alpha_safeguard = -0.1"},
                         Bad{&BaselineParams::epsilon, -1e-3, "policy.epsilon = -0.001"},
                         Bad{&BaselineParams::first_stage_ratio, 2, "first_stage_ratio = 2"},
                         Bad{&BaselineParams::cake_tau1, 0, "policy.cake_tau1 = 0"},
                         Bad{&BaselineParams::cake_tau2, -1, "policy.cake_tau2 = -1"},
                         Bad{&BaselineParams::cake_gamma, -5, "policy.cake_gamma = -5"}}) {
    PolicySpec p = PolicySpec::ForKind(PolicyKind::kSnapKv);
    p.baseline.*bad.field = bad.value;
    const absl::Status s = p.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_TRUE(absl::StrContains(s.message(), bad.message)) << s;
  }
  // Baselines ignore LAPROX's indicator / gqa_value combination.
  PolicySpec p = PolicySpec::ForKind(PolicyKind::kSnapKv);
  p.indicator = Indicator::kAttention;
  p.gqa_value = GqaValue::kExactBlock;
  EXPECT_TRUE(p.Validate().ok());
}

// Sinks [0, 2) plus the n_kept - 2 most recent; n_kept below the sinks keeps the first n_kept.
// STREAMING_LLM reads no window, so its window (default 32) may exceed the rows given (1).
TEST_F(BaselinesTest, StreamingLlmKeepsSinksAndRecentTokens) {
  TinyCase c(2, 2, 1, 1, 1, 10, 1);
  c.policy = PolicySpec::ForKind(PolicyKind::kStreamingLlm);
  c.policy.sinks = 2;
  c.policy.budget = Budget::TokensPerHead(5);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 7, 8, 9));
  EXPECT_THAT(Kept(plan, 1, 0), ElementsAre(0, 1, 7, 8, 9));
  EXPECT_THAT(plan.scores, ElementsAre(1, 1, 0, 0, 0, 0, 0, 1, 1, 1,  //
                                       1, 1, 0, 0, 0, 0, 0, 1, 1, 1));
  EXPECT_EQ(plan.window, 0);
  EXPECT_EQ(plan.sinks, 2);
  c.policy.sinks = 4;  // kvpress zeroes [4, 4 + 8): only the sinks score 1
  c.policy.budget = Budget::TokensPerHead(2);
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(0, 1));
  c.policy.budget = Budget::CompressionRatio(0.0);
  EXPECT_THAT(Plan(c).counts, ElementsAre(10, 10));
  c.policy.budget = Budget::TokensPerHead(0);
  EXPECT_THAT(Plan(c).counts, ElementsAre(0, 0));
}

// a = [2, 3, 8, 1, 1, 4, 1 | 2]: prefix scores a / 22, the window (position 7) 8/22 + 1.
//   no pooling: window, 8 (2), 4 (5);   avg 3: pooled * 66 = [5, 13, 12, 10, 6, 6, 5].
TEST_F(BaselinesTest, SnapKvKeepsTheWindowAndTheBestMeanAttention) {
  TinyCase c = OneHead(PolicyKind::kSnapKv, {2, 3, 8, 1, 1, 4, 1, 2});
  c.policy.budget = Budget::TokensPerHead(3);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(2, 5, 7));
  EXPECT_THAT(plan.scores[2], Near(8.f / 22));
  EXPECT_THAT(plan.scores[7], Near(8.f / 22 + 1));
  c.policy.pooling = Pooling::kAvg;
  c.policy.pool_kernel = 3;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(1, 2, 7));
  EXPECT_THAT(plan.scores[1], Near(13.f / 66));
  EXPECT_THAT(plan.layer_sums, ElementsAre(0.0));
  c.policy.budget = Budget::TokensPerHead(1);  // the window only
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(7));
  c.policy.budget = Budget::TokensPerHead(0);
  EXPECT_THAT(Plan(c).counts, ElementsAre(0));
}

// n <= w: every position is a window position with the same sentinel; n_kept = 3 of 5 keeps
// the earliest (ties by position), and the empty prefix puts the sentinel at 0 + 1.
TEST_F(BaselinesTest, SnapKvWithTheWholeSequenceInTheWindow) {
  TinyCase c(1, 2, 1, 2, 2, 5, 8);
  c.Randomize(3);
  c.policy = PolicySpec::ForKind(PolicyKind::kSnapKv);
  c.policy.window = 8;
  c.policy.budget = Budget::TokensPerHead(3);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2));
  EXPECT_THAT(plan.scores, ElementsAre(1, 1, 1, 1, 1));
  EXPECT_EQ(plan.window, 5);
}

// kvpress PyramidKV arithmetic (budget 1350 tokens: exact halves, so round half to even shows).
TEST(PyramidLayerCountsTest, FollowsKvpressBranches) {
  // n 3000, w 64, q 1350: min 67.5, max 2632.5 < n - w; steps 855 -> 2632.5 1777.5 922.5 67.5.
  EXPECT_THAT(policy::PyramidLayerCounts(3000, 64, 1350, 20, 4), ElementsAre(2632, 1778, 922, 68));
  // n 1000, q 500: max 975 >= 936 -> max 936, min 64; steps 436.
  EXPECT_THAT(policy::PyramidLayerCounts(1000, 64, 500, 20, 3), ElementsAre(936, 500, 64));
  // q 100: min 5 < w -> every layer keeps round(q).
  EXPECT_THAT(policy::PyramidLayerCounts(1000, 64, 100, 20, 3), ElementsAre(100, 100, 100));
  // One layer has no slope.
  EXPECT_THAT(policy::PyramidLayerCounts(3000, 64, 1350, 20, 1), ElementsAre(1350));
  // beta 2, n 600, q 420: min 210, max 630 >= 536 -> max 536, min 304; steps 116.
  EXPECT_THAT(policy::PyramidLayerCounts(600, 64, 420, 2, 3), ElementsAre(536, 420, 304));
}

TEST_F(BaselinesTest, PyramidKvLayersKeepTheirPyramidCounts) {
  TinyCase c(3, 2, 1, 4, 8, 1000, 64);
  c.Randomize(5);
  c.policy = PolicySpec::ForKind(PolicyKind::kPyramidKv);
  c.policy.budget = Budget::TokensPerHead(500);
  EXPECT_THAT(Plan(c).counts, ElementsAre(936, 500, 64));
  c.policy.budget = Budget::TokensPerHead(1000);  // n <= B: everything
  EXPECT_THAT(Plan(c).counts, ElementsAre(1000, 1000, 1000));
}

// Two KV heads, window 1 (position 5), sums 17:
//   head 0 a = [8, 4, 2, 1, 1 | 1], head 1 a = [1, 1, 1, 1, 12 | 1]; sentinel 12/17 + 1.
// n_kept 3: the layer keeps 6: both windows, 12 (h1), 8, 4, 2 (h0).
TEST_F(BaselinesTest, AdaKvSharesTheLayerBudgetAcrossHeads) {
  TinyCase c(1, 2, 2, 1, 1, 6, 1);
  c.policy = PolicySpec::ForKind(PolicyKind::kAdaKv);
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(3);
  SetAttention(c, 0, 0, {8, 4, 2, 1, 1, 1});
  SetAttention(c, 0, 1, {1, 1, 1, 1, 12, 1});
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(4, 5));
  EXPECT_THAT(plan.scores[5], Near(12.f / 17 + 1));  // alpha 0.2: n_safe = int(0.6) = 0
  // alpha 1: each head's best 3 are safeguarded (head 1: window, 12, then 1 at position 0).
  c.policy.baseline.alpha_safeguard = 1.0;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 4, 5));
  EXPECT_EQ(plan.scores[6], std::numeric_limits<float>::max());
}

// Cross-head ties go to the lower head. Three heads, sums 17:
//   h0 [8, 4, 2, 1, 1 | 1], h1 [4, 8, 2, 1, 1 | 1], h2 [1, 1, 1, 1, 12 | 1]
// n_kept 3, 9 slots: 3 windows, 12 (h2), 8, 8, 4, 4, then 2/17 of h0 and h1 tie for the last.
TEST_F(BaselinesTest, AdaKvCrossHeadTiesGoToTheLowerHead) {
  TinyCase c(1, 3, 3, 1, 1, 6, 1);
  c.policy = PolicySpec::ForKind(PolicyKind::kAdaKv);
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(3);
  SetAttention(c, 0, 0, {8, 4, 2, 1, 1, 1});
  SetAttention(c, 0, 1, {4, 8, 2, 1, 1, 1});
  SetAttention(c, 0, 2, {1, 1, 1, 1, 12, 1});
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 1, 5));
  EXPECT_THAT(Kept(plan, 0, 2), ElementsAre(4, 5));
}

// a = [4, 3, 2, 1, 1 | 1] / 12, u = |v| (W_O = 1), v = [1, 1, 10, 100, 1, 1e-3].
// B 4: stage 1 = int(4 * 0.5) = 2: the window and 4/12; stage 2 by (s + 1e-4) u:
//   p1 .2501, p2 1.668, p3 8.34, p4 .0834 -> p3, p2.
TEST_F(BaselinesTest, CriticalKvRanksTheSecondStageByProjectedValues) {
  TinyCase c = OneHead(PolicyKind::kCriticalKv, {4, 3, 2, 1, 1, 1});
  c.values[0] = {1, 1, 10, 100, 1, 1e-3f};
  c.policy.budget = Budget::TokensPerHead(4);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 2, 3, 5));
  EXPECT_EQ(plan.scores[0], std::numeric_limits<float>::max());
  EXPECT_THAT(plan.scores[3], FloatNear((1.f / 12 + 1e-4f) * 100, 1e-5f));
  c.policy.baseline.first_stage_ratio = 1.0;  // SnapKV's choice
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(0, 1, 2, 5));
}

// kvpress edge case: with two window rows and a stage 1 of int(2 * 0.5) = 1, only the first
// window position is forced; the second competes with (M + 1 + eps) * 1e-3 and loses to p3
// ((1/11 + 1/12) / 2 * 100 = 8.7).
TEST_F(BaselinesTest, CriticalKvWindowCanLoseWhenStageOneIsSmallerThanTheWindow) {
  TinyCase c(1, 1, 1, 1, 1, 6, 2);
  c.policy = PolicySpec::ForKind(PolicyKind::kCriticalKv);
  c.policy.window = 2;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(2);
  SetAttention(c, 0, 0, {4, 3, 2, 1, 1, 1});
  c.values[0] = {1, 1, 10, 100, 1, 1e-3f};
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(3, 4));
}

// The AdaKV case above with values: head budgets 4 and 2; stage 1 = int(4 * .5) = 2 (window,
// 8/17) and int(2 * .5) = 1 (window); stage 2 by (s + 1e-4) |v|:
//   head 0 v = [1, 1, 1, 50, 1, 1]: p3 2.94, p1 .235 -> [0, 1, 3, 5]
//   head 1 v = [30, 1, 1, 1, 1, 1]: p0 1.77 beats p4 .706 -> [0, 5]
TEST_F(BaselinesTest, CriticalAdaKvRunsBothStagesInsideAdaKvBudgets) {
  TinyCase c(1, 2, 2, 1, 1, 6, 1);
  c.policy = PolicySpec::ForKind(PolicyKind::kCriticalAdaKv);
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(3);
  SetAttention(c, 0, 0, {8, 4, 2, 1, 1, 1});
  SetAttention(c, 0, 1, {1, 1, 1, 1, 12, 1});
  c.values[0] = {1, 1, 1, 50, 1, 1, /*head 1*/ 30, 1, 1, 1, 1, 1};
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 3, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 5));
  // first_stage_ratio 1: exactly Ada-KV's selection.
  c.policy.baseline.first_stage_ratio = 1.0;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(4, 5));
}

TEST_F(BaselinesTest, CriticalKvNeedsTheOutputProjection) {
  TinyCase c = OneHead(PolicyKind::kCriticalAdaKv, {4, 3, 2, 1, 1, 1});
  auto plan = Compute(c, {.output_projection = false});
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), "output_projection")) << plan.status();
  c.policy.kind = PolicyKind::kSnapKv;  // the others do not
  EXPECT_TRUE(Compute(c, {.output_projection = false}).ok());
}

// CAKE budgets: shares of T, truncated; the deficit to the lowest layers; capped layers' excess
// spread over the others, again while a spread overflows.
TEST(CakeLayerBudgetsTest, SplitsTheTotalByPreference) {
  EXPECT_THAT(policy::CakeLayerBudgets({1, 1, 2}, 40, 100), ElementsAre(10, 10, 20));
  EXPECT_THAT(policy::CakeLayerBudgets({1, 1, 1}, 10, 100), ElementsAre(4, 3, 3));
  EXPECT_THAT(policy::CakeLayerBudgets({1, 1, 8}, 100, 50), ElementsAre(25, 25, 50));
  // [5, 35, 60] -> cap 40, excess 20 -> [15, 45, 40] -> excess 5 -> [20, 40, 40].
  EXPECT_THAT(policy::CakeLayerBudgets({1, 7, 12}, 100, 40), ElementsAre(20, 40, 40));
  EXPECT_THAT(policy::CakeLayerBudgets({0, 0}, 7, 100), ElementsAre(4, 3));  // equal shares
  EXPECT_THAT(policy::CakeLayerBudgets({std::nan(""), 1}, 8, 100), ElementsAre(4, 4));
  EXPECT_THAT(policy::CakeLayerBudgets({1, 3}, 0, 100), ElementsAre(0, 0));
}

// One layer, window 4 of n 10: T = (B - 4) * 1. Key 2 draws most attention -> kept first.
TEST_F(BaselinesTest, CakeKeepsTheWindowAndItsLayerBudget) {
  TinyCase c(1, 1, 1, 1, 1, 10, 4);
  c.policy = PolicySpec::ForKind(PolicyKind::kCake);
  c.policy.window = 4;
  c.policy.pooling = Pooling::kNone;
  SetAttention(c, 0, 0, {1, 1, 50, 1, 1, 1, 1, 1, 1, 1});
  c.policy.budget = Budget::TokensPerHead(5);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(2, 6, 7, 8, 9));
  EXPECT_EQ(plan.scores[6], std::numeric_limits<float>::infinity());
  EXPECT_GT(plan.layer_sums[0], 0.0);          // the layer preference P_l
  c.policy.budget = Budget::TokensPerHead(4);  // the window only
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(6, 7, 8, 9));
  c.policy.budget = Budget::TokensPerHead(6);  // n <= B + w: no compression
  EXPECT_THAT(Plan(c).counts, ElementsAre(10));
}

// KVPRESS_COMPAT rounds computed attention to the keys' dtype: bf16 keys 0 give 1/3 per key,
// which bf16 stores as 0.333984375; the safeguard becomes bf16's maximum.
TEST_F(BaselinesTest, KvpressCompatRoundsAttentionToTheKeysDtype) {
  TinyCase c(1, 1, 1, 1, 1, 3, 1);
  c.policy = PolicySpec::ForKind(PolicyKind::kAdaKv);
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(2);
  c.policy.baseline.alpha_safeguard = 0.5;  // n_safe 1: the window
  const std::vector<uint16_t> keys(3, 0);
  auto model = *backend_->PrepareModel(c.geometry, c.OProjViews());
  KeepPlanRequest request = c.Request();
  request.layers[0].keys = TensorView(keys.data(), DType::kBF16, {1, 3, 1});
  KeepPlan plan = *backend_->ComputeKeepPlan(*model, request);
  EXPECT_THAT(plan.scores,
              ElementsAre(Near(1.f / 3), Near(1.f / 3), std::numeric_limits<float>::max()));
  request.policy.numeric_mode = NumericMode::kKvpressCompat;
  plan = *backend_->ComputeKeepPlan(*model, request);
  EXPECT_THAT(plan.scores, ElementsAre(0.333984375f, 0.333984375f, Bf16ToFloat(0x7f7f)));
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 2));
}

TEST_F(BaselinesTest, BadBaselineOptionsAreInvalidArgument) {
  TinyCase c = OneHead(PolicyKind::kCake, {1, 2, 3, 4});
  c.policy.baseline.cake_tau2 = 0;
  auto plan = Compute(c);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), "policy.cake_tau2 = 0")) << plan.status();
  c.policy = PolicySpec::ForKind(PolicyKind::kSnapKv);  // window 64 > the 1 row given
  plan = Compute(c);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), "policy.window = 64")) << plan.status();
}

// NaN in a tensor a baseline reads is rejected like for LAPROX, and so is NaN in the values
// that only CriticalKV multiplies.
TEST_F(BaselinesTest, NonFiniteInputsAreRejected) {
  for (PolicyKind kind : {PolicyKind::kStreamingLlm, PolicyKind::kSnapKv, PolicyKind::kCriticalKv,
                          PolicyKind::kCake}) {
    TinyCase c = OneHead(kind, {1, 2, 3, 4, 5});
    c.values[0][3] = std::numeric_limits<float>::quiet_NaN();
    auto plan = Compute(c);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << PolicyKindName(kind);
    EXPECT_TRUE(absl::StrContains(plan.status().message(), "layers[0].values")) << plan.status();
  }
}

}  // namespace
}  // namespace laprox::kernels
