// Hand-checked keep-plans: tiny cases whose kept positions are worked out on paper (the
// arithmetic is in the comments) and written here literally. The random-input comparison with
// the float64 oracle lives in tests/reference/compare_test.py.
#include <chrono>
#include <cmath>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "laprox/kernels/registry.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using testing::TinyCase;

std::vector<int32_t> Kept(const KeepPlan& plan, int layer, int head) {
  auto span = plan.kept(layer, head);
  return {span.begin(), span.end()};
}

class GoldenTest : public ::testing::Test {
 protected:
  KeepPlan Plan(const TinyCase& c, const PrepareOptions& options = {}) {
    auto model = backend_->PrepareModel(c.geometry, c.OProjViews(), options);
    EXPECT_TRUE(model.ok()) << model.status();
    auto plan = backend_->ComputeKeepPlan(**model, c.Request());
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : KeepPlan{};
  }

  std::unique_ptr<Backend> backend_ = *CreateBackend("cpu");
};

// One head, d = 1, all keys 0: attention is uniform (1/n), so p_i = |v_i| / n and the plan
// keeps the largest |v| among candidates [0, n - w) plus the window.
TEST_F(GoldenTest, KeepsLargestProjectedValuesWithUniformAttention) {
  TinyCase c(/*L=*/1, /*H=*/1, /*Hkv=*/1, /*d=*/1, /*D=*/1, /*n=*/7, /*window_rows=*/1);
  c.values[0] = {3, 1, 4, 1, 5, 9, 2};
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(4);  // window 1 + 3 selected: 9 (5), 5 (4), 4 (2)
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(2, 4, 5, 6));
  EXPECT_EQ(plan.quota, 3);
  EXPECT_THAT(plan.bitmask, ElementsAre(0b1110100));
}

// Keys log(a_j) and query 1 give attention a_j / 16 with a = [2,3,8,1,1,4,1 | 2] (window is
// position 7). Indicator ATTENTION, two selected slots.
//   no pooling: c = [2,3,8,1,1,4,1]/16          -> best 8 (pos 2), 4 (pos 5)
//   avg k = 3:  c pooled *48 = [5,13,12,10,6,6,5] -> best 13 (pos 1), 12 (pos 2)
//   max k = 3:  [3,8,8,8,4,4,4]                   -> 8 at 1, 2, 3: ties go to 1, 2
TEST_F(GoldenTest, PoolingSpreadsAttentionToNeighbours) {
  TinyCase c(1, 1, 1, 1, 1, 8, 1);
  const float a[] = {2, 3, 8, 1, 1, 4, 1, 2};
  for (int j = 0; j < 8; ++j) c.keys[0][j] = std::log(a[j]);
  c.queries[0] = {1.f};
  c.policy.window = 1;
  c.policy.indicator = Indicator::kAttention;
  c.policy.budget = Budget::TokensPerHead(3);

  c.policy.pooling = Pooling::kNone;
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(2, 5, 7));
  c.policy.pooling = Pooling::kAvg;
  c.policy.pool_kernel = 3;
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(1, 2, 7));
  c.policy.pooling = Pooling::kMax;
  EXPECT_THAT(Kept(Plan(c), 0, 0), ElementsAre(1, 2, 7));
}

// Keys log(a_j) and query 1 give attention a_j / 20 with a = [1, 2, 3, 4 | 10]; o_proj 2 and
// values [5, 1, 1, 1 | 1]: c = [.05, .10, .15, .20], r = 2|v| = [10, 2, 2, 2]. Avg k = 3, two
// selected slots; with one query head per KV head every gqa_value gives the same score.
//   pool_target ATTENTION: pool(c) * r = [.15, .30, .45, .35] / 3 * r = [.5, .2, .3, .23] -> 0, 2
//   pool_target SCORE:     pool(c * r) = pool([.5, .2, .3, .4]) = [.7, 1, .9, .7] / 3  -> 1, 2
// Not set: ATTENTION for MEAN_HEAD_NORM and SUMMED_PROJECTION, SCORE for the per-head modes.
TEST_F(GoldenTest, PoolTargetChoosesWhatIsPooled) {
  TinyCase c(1, 1, 1, 1, 1, 5, 1);
  const float a[] = {1, 2, 3, 4, 10};
  for (int j = 0; j < 5; ++j) c.keys[0][j] = std::log(a[j]);
  c.queries[0] = {1.f};
  c.values[0] = {5, 1, 1, 1, 1};
  c.o_proj[0] = {2.f};
  c.policy.window = 1;
  c.policy.pooling = Pooling::kAvg;  // AVG_PEAK, the default, would keep the peak at 0 in both
  c.policy.pool_kernel = 3;
  c.policy.budget = Budget::TokensPerHead(3);
  for (GqaValue gqa : {GqaValue::kMeanHeadNorm, GqaValue::kSummedProjection,
                       GqaValue::kMeanHeadProduct, GqaValue::kExactBlock}) {
    SCOPED_TRACE(GqaValueName(gqa));
    c.policy.gqa_value = gqa;
    c.policy.pool_target = PoolTarget::kAttention;
    EXPECT_THAT(Kept(Plan(c, {.cross_grams = true}), 0, 0), ElementsAre(0, 2, 4));
    c.policy.pool_target = PoolTarget::kScore;
    EXPECT_THAT(Kept(Plan(c, {.cross_grams = true}), 0, 0), ElementsAre(1, 2, 4));
    c.policy.pool_target.reset();
    const bool per_head = gqa == GqaValue::kMeanHeadProduct || gqa == GqaValue::kExactBlock;
    EXPECT_THAT(Kept(Plan(c, {.cross_grams = true}), 0, 0),
                per_head ? ElementsAre(1, 2, 4) : ElementsAre(0, 2, 4));
  }
}

// Two layers with uniform attention (1/5) and indicator ATTENTION_X_VALUE, candidates 0..3:
//   layer 0 v = [10, 25, 30, 35]: raw p = v/5, S0 = 20, s = [.10, .25, .30, .35]
//   layer 1 v = [ 6,  1,  1,  2]: raw p = v/5, S1 = 2,  s = [.60, .10, .10, .20]
// B = 3 per head (window 1) -> q = 2, K = 4 slots for the model.
TEST_F(GoldenTest, AllocationModesSpendTheBudgetDifferently) {
  TinyCase c(2, 1, 1, 1, 1, 5, 1);
  c.values[0] = {10, 25, 30, 35, 1};
  c.values[1] = {6, 1, 1, 2, 1};
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.indicator = Indicator::kAttentionXValue;
  c.policy.budget = Budget::TokensPerHead(3);

  // Normalised: .60 (1,0), .35 (0,3), .30 (0,2), .25 (0,1).
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(Kept(plan, 1, 0), ElementsAre(0, 4));
  EXPECT_DOUBLE_EQ(plan.layer_sums[0], 20.0);
  EXPECT_NEAR(plan.layer_sums[1], 2.0, 1e-6);

  // Raw: layer 0's p (2..7) beats all of layer 1's (0.2..1.2).
  c.policy.allocation = Allocation::kGlobalRaw;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(Kept(plan, 1, 0), ElementsAre(4));

  // Per layer (and uniform, with one head): two each.
  for (Allocation a : {Allocation::kPerLayer, Allocation::kUniform}) {
    c.policy.allocation = a;
    plan = Plan(c);
    EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(2, 3, 4)) << AllocationName(a);
    EXPECT_THAT(Kept(plan, 1, 0), ElementsAre(0, 3, 4)) << AllocationName(a);
  }
}

// Two KV heads, uniform attention, one sink, window 1; candidates 1..4.
//   head 0 v = [*, 9, 8, 7, 6, *], head 1 v = [*, 1, 2, 3, 4, *]
// B = 4 -> q = 4 - 1 - 1 = 2 per head, K = 4.
TEST_F(GoldenTest, SinksMinPerHeadAndHeadUniformLayers) {
  TinyCase c(1, 2, 2, 1, 1, 6, 1);
  c.values[0] = {0, 9, 8, 7, 6, 0, /*head 1*/ 0, 1, 2, 3, 4, 0};
  c.policy.window = 1;
  c.policy.sinks = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.indicator = Indicator::kAttentionXValue;
  c.policy.budget = Budget::TokensPerHead(4);

  // Global: head 0 takes all four slots.
  KeepPlan plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 5));

  // min_per_head 1: head 0 reserves 9, head 1 reserves 4; the rest go to 8 and 7.
  c.policy.min_per_head = 1;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 3, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 4, 5));

  // head_uniform_layers: the layer's 4 slots split 2 + 2, each head its own best.
  c.policy.min_per_head = 0;
  c.policy.head_uniform_layers = true;
  plan = Plan(c);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 3, 4, 5));
  EXPECT_THAT(plan.counts, ElementsAre(4, 4));
}

// kvpress semantics: int((1.0 - 0.9) * 1000) = int(99.99999999999997) = 99 kept per head.
TEST_F(GoldenTest, CompressionRatioTruncatesInDouble) {
  TinyCase c(2, 2, 1, 4, 8, 1000, 32);
  c.Randomize(7);
  c.policy.budget = Budget::CompressionRatio(0.9);
  KeepPlan plan = Plan(c);
  EXPECT_EQ(plan.quota, 99 - 32);
  EXPECT_EQ(plan.counts[0] + plan.counts[1], 2 * 99);  // the global split varies by layer
  c.policy.allocation = Allocation::kUniform;
  EXPECT_THAT(Plan(c).counts, ElementsAre(99, 99));
}

TEST_F(GoldenTest, ShortSequencesAndSmallBudgets) {
  // n <= w: everything is window.
  TinyCase c(1, 2, 2, 4, 8, 5, 32);
  c.Randomize(1);
  KeepPlan plan = Plan(c);
  EXPECT_THAT(plan.counts, ElementsAre(5, 5));
  EXPECT_EQ(plan.window, 5);

  // n <= B: nothing is evicted.
  TinyCase d(1, 2, 2, 4, 8, 100, 32);
  d.Randomize(2);
  d.policy.budget = Budget::TokensPerHead(100);
  EXPECT_THAT(Plan(d).counts, ElementsAre(100, 100));

  // B < w + sinks: only the forced tokens.
  d.policy.budget = Budget::TokensPerHead(10);
  d.policy.sinks = 4;
  plan = Plan(d);
  EXPECT_THAT(plan.counts, ElementsAre(36, 36));
  std::vector<int32_t> forced = {0, 1, 2, 3};
  for (int i = 68; i < 100; ++i) forced.push_back(i);
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAreArray(forced));
}

// Every candidate scores the same (identical keys and values): ties go to the lowest
// (layer, head, position).
TEST_F(GoldenTest, EqualScoresKeepLowestIndices) {
  TinyCase c(2, 2, 2, 2, 2, 10, 2);
  for (auto& v : c.values) std::fill(v.begin(), v.end(), 1.f);
  c.policy.window = 2;
  c.policy.pooling = Pooling::kNone;
  c.policy.budget = Budget::TokensPerHead(5);  // q = 3, K = 12 over 4 heads of 8 candidates
  KeepPlan plan = Plan(c);
  // Normalised scores are equal across layers too, so (0,0) and (0,1) fill first.
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9));
  EXPECT_THAT(Kept(plan, 0, 1), ElementsAre(0, 1, 2, 3, 8, 9));
  EXPECT_THAT(Kept(plan, 1, 0), ElementsAre(8, 9));
  EXPECT_THAT(Kept(plan, 1, 1), ElementsAre(8, 9));
}

TEST_F(GoldenTest, AllZeroLayerCountsAsUniform) {
  TinyCase c(1, 1, 1, 1, 1, 6, 1);  // values all zero: S = 0
  c.policy.window = 1;
  c.policy.budget = Budget::TokensPerHead(3);
  KeepPlan plan = Plan(c);
  EXPECT_EQ(plan.layer_sums[0], 0.0);
  EXPECT_THAT(Kept(plan, 0, 0), ElementsAre(0, 1, 5));
  EXPECT_FLOAT_EQ(plan.scores[2], 1.f / 5.f);
  EXPECT_TRUE(std::isinf(plan.scores[5]));
}

// The plan does not depend on the number of worker threads.
TEST(DeterminismTest, SamePlanForAnyThreadCount) {
  TinyCase c(5, 8, 2, 16, 32, 700, 32);
  c.Randomize(11);
  c.policy.budget = Budget::TokensPerHead(100);
  std::vector<KeepPlan> plans;
  for (int threads : {1, 2, 3}) {
    auto backend = *CreateBackend("cpu", {.threads = threads});
    auto model = backend->PrepareModel(c.geometry, c.OProjViews());
    ASSERT_TRUE(model.ok()) << model.status();
    auto plan = backend->ComputeKeepPlan(**model, c.Request());
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back(*std::move(plan));
  }
  for (size_t i = 1; i < plans.size(); ++i) {
    EXPECT_EQ(plans[i].positions, plans[0].positions);
    EXPECT_EQ(plans[i].scores, plans[0].scores);
    EXPECT_EQ(plans[i].layer_sums, plans[0].layer_sums);
  }
}

// validate_seconds is measured once, by the backend, from when its caller began checking the
// request (the service decodes and resolves regions first), and from the backend's entry when
// the caller says nothing.
TEST(TimingTest, ValidateCountsFromWhenTheCallerBeganItsChecks) {
  TinyCase c(1, 2, 1, 4, 4, 64, 4);
  c.Randomize(3);
  c.policy.window = 4;
  c.policy.budget = Budget::TokensPerHead(16);
  auto backend = *CreateBackend("cpu");
  auto model = backend->PrepareModel(c.geometry, c.OProjViews());
  ASSERT_TRUE(model.ok()) << model.status();
  KeepPlanRequest request = c.Request();
  auto plain = backend->ComputeKeepPlan(**model, request);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_GE(plain->timing.validate_seconds, 0);
  EXPECT_LT(plain->timing.validate_seconds, 5);
  request.checks_started = std::chrono::steady_clock::now() - std::chrono::seconds(10);
  auto late = backend->ComputeKeepPlan(**model, request);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_GE(late->timing.validate_seconds, 10);
  EXPECT_LT(late->timing.validate_seconds, 15);
}

}  // namespace
}  // namespace laprox::kernels
