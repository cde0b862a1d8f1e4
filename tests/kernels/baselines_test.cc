// Hand-checked plans of the baseline policies (STREAMING_LLM, SNAPKV, PYRAMIDKV, ADAKV,
// CRITICALKV, CRITICAL_ADAKV, CAKE) on the CPU backend, their budget arithmetic, and their bad
// options. The arithmetic is in the comments; tests/reference/compare_test.py compares random
// cases with the float64 oracle.
//
// Most cases use d = 1, query 1, softmax scale 1 and keys log(a_j): the window row then gives
// key j the attention a_j / sum(a) over the keys it sees.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
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
  // LAPROX: the defaults chosen on bench/quality's dev grid and joint endpoint (ENDPOINT.md),
  // the same as a default PolicySpec.
  const PolicySpec laprox = PolicySpec::ForKind(PolicyKind::kLaprox);
  EXPECT_EQ(laprox.window, 32);
  EXPECT_EQ(laprox.pooling, Pooling::kAvgPeak);
  EXPECT_EQ(PolicySpec().pooling, Pooling::kAvgPeak);
  EXPECT_EQ(laprox.pool_kernel, 31);
  EXPECT_EQ(laprox.sinks, 0);
  EXPECT_EQ(laprox.EffectiveGqaValue(), GqaValue::kMeanHeadProduct);
  EXPECT_EQ(laprox.EffectivePoolTarget(), PoolTarget::kScore);
  EXPECT_EQ(PolicySpec().pool_kernel, 31);
  EXPECT_EQ(PolicySpec().EffectiveGqaValue(), GqaValue::kMeanHeadProduct);
  // The baselines keep kvpress's defaults and none of LAPROX's new ones.
  const PolicySpec streaming = PolicySpec::ForKind(PolicyKind::kStreamingLlm);
  EXPECT_EQ(streaming.sinks, 4);
  EXPECT_EQ(streaming.window, 32);
  EXPECT_EQ(streaming.pool_kernel, 7);
  EXPECT_EQ(streaming.pooling, Pooling::kAvg);
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
  EXPECT_EQ(cake.pooling, Pooling::kAvg);
  EXPECT_EQ(cake.baseline.cake_gamma, 200.0);
  EXPECT_EQ(cake.baseline.pyramid_beta, 20.0);
  EXPECT_EQ(cake.numeric_mode, NumericMode::kExact);
  for (PolicyKind k : {PolicyKind::kStreamingLlm, PolicyKind::kSnapKv, PolicyKind::kCake}) {
    EXPECT_EQ(PolicySpec::ForKind(k).EffectiveGqaValue(), GqaValue::kMeanHeadNorm)
        << PolicyKindName(k);
    EXPECT_EQ(PolicySpec::ForKind(k).EffectivePoolTarget(), PoolTarget::kAttention)
        << PolicyKindName(k);
  }
}

// gqa_value not set follows the indicator; set, it is used as given (and checked against it).
TEST(PolicySpecTest, UnsetGqaValueFollowsTheIndicator) {
  PolicySpec p;
  for (auto [indicator, gqa] :
       {std::pair{Indicator::kAttentionXProjectedValue, GqaValue::kMeanHeadProduct},
        {Indicator::kAttentionXValue, GqaValue::kMeanHeadNorm},
        {Indicator::kAttention, GqaValue::kMeanHeadNorm}}) {
    p.indicator = indicator;
    EXPECT_EQ(p.EffectiveGqaValue(), gqa) << IndicatorName(indicator);
    EXPECT_TRUE(p.Validate().ok()) << IndicatorName(indicator) << ": " << p.Validate();
  }
  EXPECT_EQ(p.EffectivePoolTarget(), PoolTarget::kAttention);
  p.gqa_value = GqaValue::kMeanHeadNorm;
  EXPECT_TRUE(p.Validate().ok());
  p.gqa_value = GqaValue::kExactBlock;
  const absl::Status s = p.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "policy.gqa_value = EXACT_BLOCK")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "got ATTENTION")) << s;
  p.indicator = Indicator::kAttentionXProjectedValue;
  p.gqa_value = GqaValue::kMeanHeadNorm;
  EXPECT_EQ(p.EffectiveGqaValue(), GqaValue::kMeanHeadNorm);
  EXPECT_EQ(p.EffectivePoolTarget(), PoolTarget::kAttention);
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
  EXPECT_THAT(policy::PyramidLayerCounts(3000, 64, 1350, 20, 4, 0),
              ElementsAre(2632, 1778, 922, 68));
  // n 1000, q 500: max 975 >= 936 -> max 936, min 64; steps 436.
  EXPECT_THAT(policy::PyramidLayerCounts(1000, 64, 500, 20, 3, 0), ElementsAre(936, 500, 64));
  // q 100: min 5 < w -> every layer keeps round(q).
  EXPECT_THAT(policy::PyramidLayerCounts(1000, 64, 100, 20, 3, 0), ElementsAre(100, 100, 100));
  // One layer has no slope.
  EXPECT_THAT(policy::PyramidLayerCounts(3000, 64, 1350, 20, 1, 0), ElementsAre(1350));
  // beta 2, n 600, q 420: min 210, max 630 >= 536 -> max 536, min 304; steps 116.
  EXPECT_THAT(policy::PyramidLayerCounts(600, 64, 420, 2, 3, 0), ElementsAre(536, 420, 304));
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

// P_l overflowed to +inf or every P_l underflowed to 0: the shares come from log P_l (3:1 of
// 10 is 7.5 and 2.5, truncated to 7 and 2; the deficit goes to the lowest layer).
TEST(CakeLayerBudgetsTest, FollowsLogPreferencesPastOverflow) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(policy::CakeLayerBudgets({inf, 1}, 10, 100, {900, 0}), ElementsAre(10, 0));
  EXPECT_THAT(policy::CakeLayerBudgets({inf, 1}, 10, 6, {900, 0}), ElementsAre(6, 4));
  EXPECT_THAT(policy::CakeLayerBudgets({inf, inf}, 10, 100, {800 + std::log(3.0), 800}),
              ElementsAre(8, 2));
  EXPECT_THAT(policy::CakeLayerBudgets({0, 0}, 10, 100, {-900, -900 + std::log(3.0)}),
              ElementsAre(3, 7));
  EXPECT_THAT(policy::CakeLayerBudgets({0, 0}, 8, 100, {-inf, -inf}), ElementsAre(4, 4));
  EXPECT_THAT(policy::CakeLayerBudgets({inf, 1}, 8, 100), ElementsAre(4, 4));
}

// A tiny tau1 overflows P_l = H^(1/tau1) V^(1/tau2): the plan reports the largest finite double
// (not +inf) and still spends exactly T (a fuzz finding: tests/fuzz/corpus/compute_keep_mask/
// regress-compute_keep_mask-cake-preference-overflow).
TEST_F(BaselinesTest, CakeReportsAnOverflowedPreferenceAsTheLargestDouble) {
  TinyCase c(2, 2, 1, 4, 4, 40, 4);
  c.Randomize(5);
  c.policy = PolicySpec::ForKind(PolicyKind::kCake);
  c.policy.window = 4;
  c.policy.baseline.cake_tau1 = 1e-4;
  c.policy.budget = Budget::TokensPerHead(10);
  KeepPlan plan = Plan(c);
  ASSERT_EQ(plan.layer_sums.size(), 2u);
  for (double p : plan.layer_sums) EXPECT_TRUE(std::isfinite(p)) << p;
  EXPECT_EQ(std::max(plan.layer_sums[0], plan.layer_sums[1]), std::numeric_limits<double>::max());
  EXPECT_EQ(plan.counts[0] + plan.counts[1], 2 * 10);
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

// ---- KVPRESS_COMPAT: kvpress's SnapKV and CriticalKV arithmetic in the model dtype ------------
//
// CompatModel is this test's literal version of the rounding points (bf16 keys, so T = bf16):
// logits r(q.k), r(logit / sqrt(d)), r(softmax), row mean r(sum / w), AVG pool r(sum / k), group
// mean r(sum / G), sentinel r(M + 1); CriticalKV: r(v W_O^h) elementwise, r(L1 norm), r(norm
// sum / G) and r(r(s + epsilon) * u). Each parameterised test below drops one point from the
// model and checks that the dropped model differs from the plan while the full one equals it
// bit for bit, so the test fails when the backend misses that point. Keys and values have one
// non-zero component (d = 2), so every dot product is one fp32 product (no FMA order effects).

enum class Skip {
  kNone,
  kLogits,
  kScaledLogits,
  kHeadDimScale,
  kSoftmax,
  kRowMean,
  kPool,
  kGroupMean,
  kSentinel,
  kProduct,
  kHeadNorm,
  kNormMean,
  kEpsilonSum,
  kStage2Product,
};

std::string SkipName(const ::testing::TestParamInfo<Skip>& info) {
  static constexpr const char* kNames[] = {
      "None",     "Logits",   "ScaledLogits", "HeadDimScale", "Softmax",
      "RowMean",  "Pool",     "GroupMean",    "Sentinel",     "Product",
      "HeadNorm", "NormMean", "EpsilonSum",   "Stage2Product"};
  return kNames[static_cast<int>(info.param)];
}

float R(float x) { return Bf16ToFloat(FloatToBf16(x)); }

class CompatModel {
 public:
  static constexpr int kG = 3, kD = 2, kHidden = 4, kWindow = 3, kKernel = 3;
  static constexpr int64_t kN = 24, kPrefix = kN - kWindow;

  CompatModel() : c_(1, kG, 1, kD, kHidden, kN, kWindow) {
    c_.Randomize(12);
    for (int64_t j = 0; j < kN; ++j) {
      // Logits of magnitude ~4-8, where one bf16 ulp of a logit is ~2% of its probability.
      key_bits_.push_back(FloatToBf16(3.f * c_.keys[0][j * kD]));
      c_.keys[0][j * kD] = Bf16ToFloat(key_bits_.back());
      key_bits_.push_back(0);
      c_.keys[0][j * kD + 1] = 0.f;
      c_.values[0][j * kD] = R(c_.values[0][j * kD]);
      c_.values[0][j * kD + 1] = 0.f;
    }
    for (float& q : c_.queries[0]) q *= 2.f;
    c_.geometry.softmax_scale = 0.3f;  // not 1/sqrt(d): KVPRESS_COMPAT must not use it
    c_.policy = PolicySpec::ForKind(PolicyKind::kSnapKv);
    c_.policy.window = kWindow;
    c_.policy.pool_kernel = kKernel;
    c_.policy.numeric_mode = NumericMode::kKvpressCompat;
  }

  TinyCase& tiny() { return c_; }
  const TinyCase& tiny() const { return c_; }

  KeepPlanRequest Request() const {
    KeepPlanRequest request = c_.Request();
    request.layers[0].keys = TensorView(key_bits_.data(), DType::kBF16, {1, kN, kD});
    return request;
  }

  // Window attention [G, w, n] (0 on masked keys), as the backend computes it from queries.
  std::vector<float> Attention(Skip skip) const {
    std::vector<float> a(kG * kWindow * kN, 0.f);
    const float sqrt_d = std::sqrt(static_cast<float>(kD));
    for (int h = 0; h < kG; ++h) {
      for (int t = 0; t < kWindow; ++t) {
        const float q = c_.queries[0][(h * kWindow + t) * kD];
        const int64_t visible = kPrefix + t + 1;
        std::vector<float> x(visible);
        for (int64_t j = 0; j < visible; ++j) {
          float logit = q * c_.keys[0][j * kD];
          if (skip == Skip::kHeadDimScale) {
            x[j] = logit * c_.geometry.softmax_scale;
            continue;
          }
          if (skip != Skip::kLogits) logit = R(logit);
          logit /= sqrt_d;
          x[j] = skip == Skip::kScaledLogits ? logit : R(logit);
        }
        const float max = *std::max_element(x.begin(), x.end());
        double sum = 0.0;
        for (float& v : x) sum += v = std::exp(v - max);
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < visible; ++j) {
          const float p = x[j] * inv;
          a[(h * kWindow + t) * kN + j] = skip == Skip::kSoftmax ? p : R(p);
        }
      }
    }
    return a;
  }

  // SnapKV scores [n] from attention `a`, window sentinel included.
  std::vector<float> SnapScores(const std::vector<float>& a, Skip skip) const {
    std::vector<float> group(kN, 0.f);
    for (int h = 0; h < kG; ++h) {
      std::vector<float> mean(kPrefix, 0.f);
      for (int t = 0; t < kWindow; ++t) {
        for (int64_t i = 0; i < kPrefix; ++i) mean[i] += a[(h * kWindow + t) * kN + i];
      }
      for (float& m : mean) m = skip == Skip::kRowMean ? m / kWindow : R(m / kWindow);
      for (int64_t i = 0; i < kPrefix; ++i) {
        double sum = 0.0;
        for (int64_t j = std::max<int64_t>(0, i - 1); j <= std::min(kPrefix - 1, i + 1); ++j) {
          sum += mean[j];
        }
        const float pooled = static_cast<float>(sum / kKernel);
        group[i] += skip == Skip::kPool ? pooled : R(pooled);
      }
    }
    float top = 0.f;
    for (int64_t i = 0; i < kPrefix; ++i) {
      group[i] = skip == Skip::kGroupMean ? group[i] / kG : R(group[i] / kG);
      top = std::max(top, group[i]);
    }
    std::fill(group.begin() + kPrefix, group.end(), skip == Skip::kSentinel ? top + 1 : R(top + 1));
    return group;
  }

  // CriticalKV's value factor u [n].
  std::vector<float> ValueNorms(Skip skip) const {
    std::vector<float> u(kN, 0.f);
    for (int64_t i = 0; i < kN; ++i) {
      for (int h = 0; h < kG; ++h) {
        float norm = 0.f;
        for (int e = 0; e < kHidden; ++e) {
          const float p = c_.values[0][i * kD] * c_.o_proj[0][e * kG * kD + h * kD];
          norm += std::abs(skip == Skip::kProduct ? p : R(p));
        }
        u[i] += skip == Skip::kHeadNorm ? norm : R(norm);
      }
      u[i] = skip == Skip::kNormMean ? u[i] / kG : R(u[i] / kG);
    }
    return u;
  }

  // CriticalKV's stage-2 score of SnapKV score s and value factor u.
  float Stage2(float s, float u, Skip skip) const {
    const float shifted = s + static_cast<float>(c_.policy.baseline.epsilon);
    const float product = (skip == Skip::kEpsilonSum ? shifted : R(shifted)) * u;
    return skip == Skip::kStage2Product ? product : R(product);
  }

 private:
  TinyCase c_;
  std::vector<uint16_t> key_bits_;
};

class KvpressCompatTest : public BaselinesTest, public ::testing::WithParamInterface<Skip> {
 protected:
  KeepPlan PlanOf(const CompatModel& m) {
    auto model = backend_->PrepareModel(m.tiny().geometry, m.tiny().OProjViews());
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return {};
    auto plan = backend_->ComputeKeepPlan(**model, m.Request());
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : KeepPlan{};
  }
};

// The SnapKV score points: the plan's scores are the full model's, not the model without `skip`.
class KvpressCompatSnapKvTest : public KvpressCompatTest {};

TEST_P(KvpressCompatSnapKvTest, RoundsAtEachKvpressStep) {
  CompatModel m;
  const Skip skip = GetParam();
  const std::vector<float> want = m.SnapScores(m.Attention(Skip::kNone), Skip::kNone);
  const std::vector<float> dropped = m.SnapScores(m.Attention(skip), skip);
  ASSERT_NE(want, dropped) << "the case does not depend on this rounding point";
  EXPECT_EQ(PlanOf(m).scores, want);
}

INSTANTIATE_TEST_SUITE_P(Points, KvpressCompatSnapKvTest,
                         ::testing::Values(Skip::kLogits, Skip::kScaledLogits, Skip::kHeadDimScale,
                                           Skip::kSoftmax, Skip::kRowMean, Skip::kPool,
                                           Skip::kGroupMean, Skip::kSentinel),
                         SkipName);

// The CriticalKV points: stage-2 scores (all but the one stage-1 pick, at bf16's maximum).
class KvpressCompatCriticalKvTest : public KvpressCompatTest {};

TEST_P(KvpressCompatCriticalKvTest, RoundsTheValueFactorAndTheStageTwoScore) {
  CompatModel m;
  m.tiny().policy.kind = PolicyKind::kCriticalKv;
  m.tiny().policy.budget = Budget::TokensPerHead(2);  // stage 1: int(2 * 0.5) = 1
  const Skip skip = GetParam();
  const std::vector<float> snap = m.SnapScores(m.Attention(Skip::kNone), Skip::kNone);
  const std::vector<float> u = m.ValueNorms(Skip::kNone), u_dropped = m.ValueNorms(skip);
  const KeepPlan plan = PlanOf(m);
  ASSERT_EQ(plan.scores.size(), static_cast<size_t>(CompatModel::kN));
  int stage1 = 0, differs = 0;
  for (int64_t i = 0; i < CompatModel::kN; ++i) {
    if (plan.scores[i] == Bf16ToFloat(0x7f7f)) {
      ++stage1;
      continue;
    }
    EXPECT_EQ(plan.scores[i], m.Stage2(snap[i], u[i], Skip::kNone)) << i;
    differs += m.Stage2(snap[i], u_dropped[i], skip) != m.Stage2(snap[i], u[i], Skip::kNone);
  }
  EXPECT_EQ(stage1, 1);
  EXPECT_GT(differs, 0) << "the case does not depend on this rounding point";
}

INSTANTIATE_TEST_SUITE_P(Points, KvpressCompatCriticalKvTest,
                         ::testing::Values(Skip::kProduct, Skip::kHeadNorm, Skip::kNormMean,
                                           Skip::kEpsilonSum, Skip::kStage2Product),
                         SkipName);

// Given window attention is used unrounded, but the row mean, pool, group mean and sentinel
// are still rounded.
TEST_F(KvpressCompatTest, GivenAttentionIsRoundedFromTheRowMeanOn) {
  CompatModel m;
  // Probabilities that are not bf16 values: the unrounded softmax of the model.
  const std::vector<float> given = m.Attention(Skip::kSoftmax);
  KeepPlanRequest request = m.Request();
  request.layers[0].window_queries = TensorView();
  request.layers[0].window_attention = TensorView(
      given.data(), DType::kF32, {CompatModel::kG, CompatModel::kWindow, CompatModel::kN});
  auto model = *backend_->PrepareModel(m.tiny().geometry, m.tiny().OProjViews());
  const KeepPlan plan = *backend_->ComputeKeepPlan(*model, request);
  const std::vector<float> want = m.SnapScores(given, Skip::kNone);
  ASSERT_NE(want, m.SnapScores(given, Skip::kRowMean));
  EXPECT_EQ(plan.scores, want);
}

// kvpress recomputes the softmax: KVPRESS_COMPAT ignores a given window_lse (EXACT uses it).
TEST_F(KvpressCompatTest, IgnoresTheWindowLse) {
  CompatModel m;
  const std::vector<float> lse(CompatModel::kG * CompatModel::kWindow, 5.f);
  KeepPlanRequest request = m.Request();
  request.layers[0].window_lse =
      TensorView(lse.data(), DType::kF32, {CompatModel::kG, CompatModel::kWindow});
  auto model = *backend_->PrepareModel(m.tiny().geometry, m.tiny().OProjViews());
  EXPECT_EQ(backend_->ComputeKeepPlan(*model, request)->scores,
            m.SnapScores(m.Attention(Skip::kNone), Skip::kNone));
  request.policy.numeric_mode = NumericMode::kExact;
  EXPECT_NE(backend_->ComputeKeepPlan(*model, request)->scores,
            backend_->ComputeKeepPlan(*model, m.Request())->scores);
}

// kvpress keeps at least one token for a compression ratio (compute_n_kept), floors
// CriticalKV's stage 1 and PyramidKV's fallback at 1; EXACT keeps int((1 - cr) * n).
TEST_F(BaselinesTest, KvpressCompatKeepsAtLeastOneToken) {
  for (PolicyKind kind :
       {PolicyKind::kStreamingLlm, PolicyKind::kSnapKv, PolicyKind::kPyramidKv, PolicyKind::kAdaKv,
        PolicyKind::kCriticalKv, PolicyKind::kCriticalAdaKv}) {
    TinyCase c = OneHead(kind, {1, 2, 3, 4, 5});  // n 5, cr 0.9: int(0.5) = 0
    c.values[0] = {1, 1, 1, 1, 1};                // u = 1: CriticalKV ranks by s + eps
    c.policy.budget = Budget::CompressionRatio(0.9);
    EXPECT_THAT(Plan(c).counts, ElementsAre(0)) << PolicyKindName(kind);
    c.policy.numeric_mode = NumericMode::kKvpressCompat;
    const KeepPlan plan = Plan(c);
    EXPECT_THAT(plan.counts, ElementsAre(1)) << PolicyKindName(kind);
    // StreamingLLM's scores still zero [4, 4 + 5 - int(0.5)): the kept token is sink 0.
    EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(kind == PolicyKind::kStreamingLlm ? 0 : 4))
        << PolicyKindName(kind);
  }
  // CAKE (no kvpress press) is not floored: n 2, int(0.2) = 0, so n > n_kept + w and only the
  // window is kept (n_kept 1 would keep both).
  TinyCase c = OneHead(PolicyKind::kCake, {1, 2});
  c.policy.budget = Budget::CompressionRatio(0.9);
  c.policy.numeric_mode = NumericMode::kKvpressCompat;
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(1));
}

// n 3, cr 0.5: n_kept int(1.5) = 1, stage 1 int(0.75) = 0 -> 1 in KVPRESS_COMPAT: the window
// is forced (bf16 max) instead of competing by (s + eps) * u, where position 0 wins.
TEST_F(BaselinesTest, KvpressCompatFloorsCriticalKvStageOne) {
  TinyCase c = OneHead(PolicyKind::kCriticalKv, {1, 1, 1});
  c.values[0] = {100, 1, 1};
  c.policy.budget = Budget::CompressionRatio(0.5);
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(0));
  c.policy.numeric_mode = NumericMode::kKvpressCompat;
  const KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(2));
  EXPECT_EQ(plan.scores[2], std::numeric_limits<float>::max());  // f32 keys: f32 max
}

TEST(PyramidLayerCountsTest, KvpressFloorsTheFallbackAtOne) {
  // q 0.4: min 0.02 < w -> fallback round(0.4) = 0, floored to 1.
  EXPECT_THAT(policy::PyramidLayerCounts(4, 1, 0.4, 20, 2, 0), ElementsAre(0, 0));
  EXPECT_THAT(policy::PyramidLayerCounts(4, 1, 0.4, 20, 2, 1), ElementsAre(1, 1));
  // The pyramid itself is not floored: n 3000, q 1350 as above.
  EXPECT_THAT(policy::PyramidLayerCounts(3000, 64, 1350, 20, 4, 1),
              ElementsAre(2632, 1778, 922, 68));
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
