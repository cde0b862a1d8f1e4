// Finite inputs too large to score (issue 20, item 5; tests/reference/SEMANTICS.md, "Finite
// inputs too large to score"): every policy kind either computes them safely or rejects the
// request with INVALID_ARGUMENT naming the tensor, never a plan with NaN in it; the backend then
// answers the next valid request with the plan it gave before. Inputs scaled by powers of two
// inside the limits give exactly the plan of the unscaled inputs, so the limits reject only what
// could overflow. NaN never reaches a selection: a non-finite score there is INTERNAL.
//
// Run: build/tests/kernels/laprox_kernels_test --gtest_filter='Overflow*:*NonFinite*'.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "laprox/kernels/registry.h"
#include "policy/baselines.h"
#include "policy/budget.h"
#include "policy/select.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::TinyCase;

MATCHER_P2(IsStatus, code, substring, "") {
  *result_listener << "status " << arg;
  return arg.code() == code && absl::StrContains(arg.message(), substring);
}

void ExpectSamePlan(const KeepPlan& want, const KeepPlan& got, double layer_sum_scale = 1.0) {
  EXPECT_EQ(got.counts, want.counts);
  EXPECT_EQ(got.offsets, want.offsets);
  EXPECT_EQ(got.positions, want.positions);
  EXPECT_EQ(got.bitmask, want.bitmask);
  EXPECT_EQ(got.scores, want.scores);
  ASSERT_EQ(got.layer_sums.size(), want.layer_sums.size());
  for (size_t l = 0; l < want.layer_sums.size(); ++l) {
    EXPECT_EQ(got.layer_sums[l], want.layer_sums[l] * layer_sum_scale) << "layer " << l;
  }
}

void ExpectAllFinite(const KeepPlan& plan) {
  for (double s : plan.layer_sums) EXPECT_TRUE(std::isfinite(s)) << s;
  for (float s : plan.scores) EXPECT_FALSE(std::isnan(s));
}

void Scale(std::vector<std::vector<float>>& tensors, float factor) {
  for (auto& t : tensors) {
    for (float& x : t) x *= factor;
  }
}

class OverflowTest : public ::testing::TestWithParam<PolicyKind> {
 protected:
  OverflowTest() : case_(2, 4, 2, 8, 16, 64, 8) {
    case_.Randomize(11);
    case_.policy = PolicySpec::ForKind(GetParam());
    case_.policy.window = 8;
    case_.policy.budget = Budget::TokensPerHead(20);
  }

  absl::StatusOr<KeepPlan> Compute(const TinyCase& c) {
    auto model = backend_->PrepareModel(c.geometry, c.OProjViews());
    if (!model.ok()) return model.status();
    return backend_->ComputeKeepPlan(**model, c.Request());
  }
  KeepPlan Plan(const TinyCase& c) {
    absl::StatusOr<KeepPlan> plan = Compute(c);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *std::move(plan) : KeepPlan{};
  }

  // The plan of the unmodified case, computed first; after a rejection the backend must give
  // it again.
  void SetUp() override { good_ = Plan(case_); }
  void ExpectGoodPlanAgain() {
    SCOPED_TRACE("the valid request after the bad one");
    ExpectSamePlan(good_, Plan(case_));
  }

  bool ComputesWindowAttention() const { return GetParam() != PolicyKind::kStreamingLlm; }
  bool ScoresValues() const {
    return GetParam() == PolicyKind::kLaprox || GetParam() == PolicyKind::kCriticalKv ||
           GetParam() == PolicyKind::kCriticalAdaKv;
  }

  std::unique_ptr<Backend> backend_ = *CreateBackend("cpu");
  TinyCase case_;
  KeepPlan good_;
};

// keys = queries = 3e38 (issue 20, row 7): every logit q . k overflows fp32.
TEST_P(OverflowTest, RejectsKeysAndQueriesWhoseLogitsOverflow) {
  TinyCase bad = case_;
  for (auto* tensors : {&bad.keys, &bad.queries}) {
    for (float& x : (*tensors)[1]) x = 3e38f;
  }
  absl::StatusOr<KeepPlan> plan = Compute(bad);
  if (ComputesWindowAttention()) {
    EXPECT_THAT(plan.status(),
                IsStatus(absl::StatusCode::kInvalidArgument,
                         "layers[1].keys: the logits scale * q . k of KV head 0 may reach"));
    EXPECT_THAT(plan.status(), IsStatus(absl::StatusCode::kInvalidArgument,
                                        "keys and window_queries are finite but too large"));
  } else {
    // STREAMING_LLM reads no window and computes nothing from keys: its plan does not change.
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectSamePlan(good_, *plan);
  }
  ExpectGoodPlanAgain();
}

// Keys times 2^60 and queries times 2^-60 give exactly the same logits: accepted, same plan.
TEST_P(OverflowTest, AcceptsLargeKeysWhoseLogitsAreSmall) {
  TinyCase scaled = case_;
  Scale(scaled.keys, 0x1p60f);
  Scale(scaled.queries, 0x1p-60f);
  ExpectSamePlan(good_, Plan(scaled));
}

// A value of 1e35 overflows v M v^T (LAPROX; 1e20 already does, OverflowIndicatorTest) and
// ||v W_O^h||_1 (CriticalKV, linear in v: 1e20 is safe, CriticalKvScoresValuesOf1e20).
TEST_P(OverflowTest, RejectsValuesThatOverflowTheScores) {
  TinyCase bad = case_;
  bad.values[1][3 * 8 + 2] = 1e35f;  // KV head 0, position 3
  absl::StatusOr<KeepPlan> plan = Compute(bad);
  if (GetParam() == PolicyKind::kLaprox) {
    EXPECT_THAT(plan.status(),
                IsStatus(absl::StatusCode::kInvalidArgument,
                         "layers[1].values: the squared scores of KV head 0 may reach"));
  } else if (ScoresValues()) {
    EXPECT_THAT(plan.status(), IsStatus(absl::StatusCode::kInvalidArgument,
                                        "layers[1].values: ||v W_O^h||_1 of KV head 0 may reach"));
  } else {
    // The SnapKV kinds, CAKE and STREAMING_LLM only check values for NaN/Inf.
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectSamePlan(good_, *plan);
  }
  ExpectGoodPlanAgain();
}

// Values times 2^40 scale every value factor by exactly 2^40: the normalised plan is unchanged
// (the raw layer sums of LAPROX scale by 2^40).
TEST_P(OverflowTest, AcceptsLargeValuesBelowTheLimit) {
  TinyCase scaled = case_;
  Scale(scaled.values, 0x1p40f);
  const KeepPlan plan = Plan(scaled);
  if (GetParam() == PolicyKind::kLaprox) {
    ExpectSamePlan(good_, plan, 0x1p40);
  } else if (!ScoresValues()) {
    ExpectSamePlan(good_, plan);
  } else {
    // (s + epsilon) * u ranks by u * 2^40 now, epsilon relatively 2^40 smaller: kept sets may
    // move, but nothing may overflow.
    ExpectAllFinite(plan);
  }
}

// Huge o_proj weights overflow the factors W_O^h W_O^h^T: PrepareModel refuses the model.
TEST_P(OverflowTest, RejectsOProjWhoseFactorsOverflow) {
  TinyCase bad = case_;
  bad.o_proj[1][5] = 1e20f;
  auto model = backend_->PrepareModel(bad.geometry, bad.OProjViews());
  EXPECT_THAT(model.status(),
              IsStatus(absl::StatusCode::kInvalidArgument,
                       "o_proj[1]: the factors W_O^h W_O^h'^T may reach 6.4e+41 (hidden_size 16, "
                       "group 2, max |o_proj[1]| 1e+20)"));
  ExpectGoodPlanAgain();
}

// o_proj times 2^40 scales every value factor by 2^40: same plan as the unscaled model.
TEST_P(OverflowTest, AcceptsLargeOProjBelowTheLimit) {
  TinyCase scaled = case_;
  Scale(scaled.o_proj, 0x1p40f);
  const KeepPlan plan = Plan(scaled);
  if (GetParam() == PolicyKind::kLaprox) {
    ExpectSamePlan(good_, plan, 0x1p40);
  } else if (!ScoresValues()) {
    ExpectSamePlan(good_, plan);
  } else {
    ExpectAllFinite(plan);
  }
}

// Engine window attention (no logits): keys are not scored, so huge keys change nothing, while
// huge values are rejected as with queries.
TEST_P(OverflowTest, WindowAttentionPathRejectsHugeValuesOnly) {
  if (!ComputesWindowAttention()) GTEST_SKIP() << "STREAMING_LLM reads no window";
  const int64_t H = 4, wq = 8, n = 64;
  std::vector<float> attention(H * wq * n);
  for (int64_t r = 0; r < H * wq; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      attention[r * n + j] = 1.f + static_cast<float>((r * 7 + j * 3) % 11);
      sum += attention[r * n + j];
    }
    for (int64_t j = 0; j < n; ++j) {
      attention[r * n + j] = static_cast<float>(attention[r * n + j] / sum);
    }
  }
  auto compute = [&](const TinyCase& c) {
    KeepPlanRequest r = c.Request();
    for (auto& layer : r.layers) {
      layer.window_queries = TensorView();
      layer.window_attention = TensorView(attention.data(), DType::kF32, {H, wq, n});
    }
    auto model = backend_->PrepareModel(c.geometry, c.OProjViews());
    EXPECT_TRUE(model.ok()) << model.status();
    return backend_->ComputeKeepPlan(**model, r);
  };
  const absl::StatusOr<KeepPlan> given = compute(case_);
  ASSERT_TRUE(given.ok()) << given.status();
  TinyCase huge_keys = case_;
  for (float& x : huge_keys.keys[0]) x = 3e38f;
  const absl::StatusOr<KeepPlan> same = compute(huge_keys);
  ASSERT_TRUE(same.ok()) << same.status();
  ExpectSamePlan(*given, *same);

  TinyCase huge_values = case_;
  huge_values.values[0][8 * 64 + 1] = 1e35f;  // KV head 1, position 0
  const absl::StatusOr<KeepPlan> plan = compute(huge_values);
  if (ScoresValues()) {
    EXPECT_THAT(plan.status(), IsStatus(absl::StatusCode::kInvalidArgument, "layers[0].values: "));
    EXPECT_THAT(plan.status(), IsStatus(absl::StatusCode::kInvalidArgument, "of KV head 1 may"));
  } else {
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectSamePlan(*given, *plan);
  }
  ExpectGoodPlanAgain();
}

// An engine LSE far below the logits would give probabilities up to e^88 whose squares overflow:
// probabilities are capped at 1 instead (SEMANTICS.md), so the plan is finite, and every LSE
// that low gives the same plan (every probability is 1).
TEST_P(OverflowTest, WindowLseBelowTheLogitsIsCappedAtProbabilityOne) {
  if (!ComputesWindowAttention()) GTEST_SKIP() << "STREAMING_LLM reads no window";
  auto compute = [&](float lse_value) {
    std::vector<float> lse(4 * 8, lse_value);
    TinyCase c = case_;
    KeepPlanRequest r = c.Request();
    for (auto& layer : r.layers) layer.window_lse = TensorView(lse.data(), DType::kF32, {4, 8});
    auto model = backend_->PrepareModel(c.geometry, c.OProjViews());
    EXPECT_TRUE(model.ok()) << model.status();
    return backend_->ComputeKeepPlan(**model, r);
  };
  const absl::StatusOr<KeepPlan> low = compute(-1e30f), lower = compute(-3e38f);
  ASSERT_TRUE(low.ok()) << low.status();
  ASSERT_TRUE(lower.ok()) << lower.status();
  ExpectAllFinite(*low);
  ExpectSamePlan(*low, *lower);
  ExpectGoodPlanAgain();
}

INSTANTIATE_TEST_SUITE_P(EveryKind, OverflowTest,
                         ::testing::Values(PolicyKind::kLaprox, PolicyKind::kStreamingLlm,
                                           PolicyKind::kSnapKv, PolicyKind::kPyramidKv,
                                           PolicyKind::kAdaKv, PolicyKind::kCriticalKv,
                                           PolicyKind::kCriticalAdaKv, PolicyKind::kCake),
                         [](const ::testing::TestParamInfo<PolicyKind>& kind) {
                           return std::string(PolicyKindName(kind.param));
                         });

// LAPROX's value indicators each bound what they compute: ||v|| (ATTENTION_X_VALUE) and
// v M v^T (every gqa_value); ATTENTION ignores values.
TEST(OverflowIndicatorTest, EveryValueIndicatorRejectsHugeValues) {
  std::unique_ptr<Backend> backend = *CreateBackend("cpu");
  struct Mode {
    Indicator indicator;
    GqaValue gqa;
    bool rejects;
  } modes[] = {{Indicator::kAttention, GqaValue::kMeanHeadNorm, false},
               {Indicator::kAttentionXValue, GqaValue::kMeanHeadNorm, true},
               {Indicator::kAttentionXProjectedValue, GqaValue::kMeanHeadNorm, true},
               {Indicator::kAttentionXProjectedValue, GqaValue::kSummedProjection, true},
               {Indicator::kAttentionXProjectedValue, GqaValue::kMeanHeadProduct, true},
               {Indicator::kAttentionXProjectedValue, GqaValue::kExactBlock, true}};
  for (const Mode& m : modes) {
    TinyCase c(2, 4, 2, 8, 16, 64, 8);
    c.Randomize(5);
    c.policy.window = 8;
    c.policy.budget = Budget::TokensPerHead(20);
    c.policy.indicator = m.indicator;
    c.policy.gqa_value = m.gqa;
    SCOPED_TRACE(absl::StrCat(IndicatorName(m.indicator), " ", GqaValueName(m.gqa)));
    auto model = backend->PrepareModel(c.geometry, c.OProjViews(), {.cross_grams = true});
    ASSERT_TRUE(model.ok()) << model.status();
    const absl::StatusOr<KeepPlan> good = backend->ComputeKeepPlan(**model, c.Request());
    ASSERT_TRUE(good.ok()) << good.status();
    for (float& x : c.values[0]) x *= 1e20f;
    const absl::StatusOr<KeepPlan> plan = backend->ComputeKeepPlan(**model, c.Request());
    if (m.rejects) {
      EXPECT_THAT(plan.status(),
                  IsStatus(absl::StatusCode::kInvalidArgument,
                           "layers[0].values: the squared scores of KV head 0 may reach"));
    } else {
      ASSERT_TRUE(plan.ok()) << plan.status();
      ExpectSamePlan(*good, *plan);
    }
  }
}

// ||v W_O^h||_1 is linear in v: a value of 1e20 is scored (no overflow) and its token, with by
// far the largest (s + epsilon) * u of its head, is kept.
TEST(OverflowCriticalKvTest, ScoresValuesOf1e20) {
  std::unique_ptr<Backend> backend = *CreateBackend("cpu");
  for (PolicyKind kind : {PolicyKind::kCriticalKv, PolicyKind::kCriticalAdaKv}) {
    SCOPED_TRACE(PolicyKindName(kind));
    TinyCase c(2, 4, 2, 8, 16, 64, 8);
    c.Randomize(13);
    c.policy = PolicySpec::ForKind(kind);
    c.policy.window = 8;
    c.policy.budget = Budget::TokensPerHead(20);
    c.values[1][(64 + 30) * 8 + 4] = 1e20f;  // layer 1, KV head 1, position 30
    auto model = backend->PrepareModel(c.geometry, c.OProjViews());
    ASSERT_TRUE(model.ok()) << model.status();
    const absl::StatusOr<KeepPlan> plan = backend->ComputeKeepPlan(**model, c.Request());
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectAllFinite(*plan);
    const auto kept = plan->kept(1, 1);
    EXPECT_NE(std::find(kept.begin(), kept.end(), 30), kept.end());
    EXPECT_GT(plan->scores[(2 + 1) * 64 + 30], 1e15f);
  }
}

// CAKE's eviction score mean + gamma * var with a gamma beyond fp32: with one window row every
// variance is 0, so the scores are the means whatever gamma is (fp32 gamma * 0 was inf * 0 = NaN).
TEST(OverflowCakeTest, HugeGammaTimesZeroVarianceIsNotNaN) {
  std::unique_ptr<Backend> backend = *CreateBackend("cpu");
  TinyCase c(2, 4, 2, 8, 16, 64, 8);
  c.Randomize(7);
  c.policy = PolicySpec::ForKind(PolicyKind::kCake);
  c.policy.window = 1;
  c.policy.budget = Budget::TokensPerHead(20);
  auto model = backend->PrepareModel(c.geometry, c.OProjViews());
  ASSERT_TRUE(model.ok()) << model.status();
  c.policy.baseline.cake_gamma = 0.0;
  const absl::StatusOr<KeepPlan> plain = backend->ComputeKeepPlan(**model, c.Request());
  ASSERT_TRUE(plain.ok()) << plain.status();
  c.policy.baseline.cake_gamma = 1e300;
  const absl::StatusOr<KeepPlan> huge = backend->ComputeKeepPlan(**model, c.Request());
  ASSERT_TRUE(huge.ok()) << huge.status();
  ExpectAllFinite(*huge);
  ExpectSamePlan(*plain, *huge);
}

// KVPRESS_COMPAT computes the SnapKV logits in the keys' dtype: fp16 keys and queries of 200 give
// q . k = 8 * 200 * 200 = 320000, beyond fp16's 65504.
TEST(OverflowCompatTest, RejectsLogitsBeyondTheModelDtype) {
  std::unique_ptr<Backend> backend = *CreateBackend("cpu");
  TinyCase c(1, 2, 1, 8, 16, 64, 8);
  c.Randomize(9);
  c.policy = PolicySpec::ForKind(PolicyKind::kSnapKv);
  c.policy.window = 8;
  c.policy.numeric_mode = NumericMode::kKvpressCompat;
  c.policy.budget = Budget::TokensPerHead(20);
  auto model = backend->PrepareModel(c.geometry, c.OProjViews());
  ASSERT_TRUE(model.ok()) << model.status();
  auto as_f16 = [](const std::vector<float>& x) {
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = FloatToF16(x[i]);
    return h;
  };
  auto compute = [&](const TinyCase& t) {
    const std::vector<uint16_t> keys = as_f16(t.keys[0]), values = as_f16(t.values[0]),
                                queries = as_f16(t.queries[0]);
    KeepPlanRequest r = t.Request();
    r.layers[0].keys = TensorView(keys.data(), DType::kF16, {1, 64, 8});
    r.layers[0].values = TensorView(values.data(), DType::kF16, {1, 64, 8});
    r.layers[0].window_queries = TensorView(queries.data(), DType::kF16, {2, 8, 8});
    return backend->ComputeKeepPlan(**model, r);
  };
  const absl::StatusOr<KeepPlan> good = compute(c);
  ASSERT_TRUE(good.ok()) << good.status();
  TinyCase bad = c;
  for (float& x : bad.keys[0]) x = 200.f;
  for (float& x : bad.queries[0]) x = 200.f;
  EXPECT_THAT(
      compute(bad).status(),
      IsStatus(absl::StatusCode::kInvalidArgument,
               "layers[0].keys: the logit q . k of window_queries [0, 0] and keys [0, 0] is "
               "beyond the range of f16"));
  const absl::StatusOr<KeepPlan> again = compute(c);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSamePlan(*good, *again);
}

// Attention far below 1e-19 in every window row: squares below fp32's smallest normal must not
// flush to 0 (tokens would tie and be kept by position). Token j of the prefix gets attention
// 1e-20 * 2^-perm[j] (down to 3e-37), a permutation of the positions, so the plan must keep the
// 19 tokens with the smallest perm[j], not the first 19.
TEST(UnderflowTest, TinyAttentionKeepsItsOrder) {
  std::unique_ptr<Backend> backend = *CreateBackend("cpu");
  TinyCase c(1, 2, 1, 8, 16, 64, 1);
  c.Randomize(3);
  c.policy.window = 1;
  c.policy.pooling = Pooling::kNone;
  c.policy.indicator = Indicator::kAttention;
  c.policy.budget = Budget::TokensPerHead(20);
  std::vector<int> perm(63);
  for (int j = 0; j < 63; ++j) perm[j] = (j * 37 + 11) % 63;  // 37 is coprime to 63
  std::vector<float> attention(2 * 64, 0.f);
  for (int h = 0; h < 2; ++h) {
    float* row = attention.data() + h * 64;
    for (int j = 0; j < 63; ++j) row[j] = std::ldexp(1e-20f, -perm[j]);
    row[63] = 1.f;  // the window token
  }
  auto model = backend->PrepareModel(c.geometry, c.OProjViews());
  ASSERT_TRUE(model.ok()) << model.status();
  KeepPlanRequest r = c.Request();
  r.layers[0].window_queries = TensorView();
  r.layers[0].window_attention = TensorView(attention.data(), DType::kF32, {2, 1, 64});
  const absl::StatusOr<KeepPlan> plan = backend->ComputeKeepPlan(**model, r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int32_t> want;
  for (int j = 0; j < 63; ++j) {
    if (perm[j] < 19) want.push_back(j);
  }
  want.push_back(63);
  const auto kept = plan->kept(0, 0);
  EXPECT_EQ(std::vector<int32_t>(kept.begin(), kept.end()), want);
  for (int j = 0; j + 1 < 63; ++j) {  // the competing scores keep the order of the attention
    EXPECT_EQ(plan->scores[j] > plan->scores[j + 1], perm[j] < perm[j + 1]) << j;
  }
}

// The selections' last line of defence: a non-finite score that got past the backend's checks
// is INTERNAL naming where it is, never undefined behaviour in a sort.
TEST(NonFiniteScoreTest, SelectKeepPlanRefusesNonFiniteRawScores) {
  RequestShape shape;
  shape.n = 50;
  shape.num_layers = 2;
  shape.num_kv_heads = 3;
  shape.group_size = 1;
  shape.head_dim = 8;
  shape.window_rows = 4;
  PolicySpec policy;
  policy.window = 4;
  policy.budget = Budget::TokensPerHead(20);
  policy::DeriveBudget(policy, shape);
  std::vector<float> raw(2 * 3 * 50);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<float>(i % 17) / 16.f;
  ASSERT_TRUE(policy::SelectKeepPlan(shape, policy, raw, {}).ok());
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> poisoned = raw;
    poisoned[(1 * 3 + 2) * 50 + 7] = bad;
    EXPECT_THAT(policy::SelectKeepPlan(shape, policy, poisoned, {}).status(),
                IsStatus(absl::StatusCode::kInternal,
                         "layers[1], KV head 2, position 7: the raw score is"));
  }
}

TEST(NonFiniteScoreTest, SelectBaselinePlanRefusesNaNRankingScores) {
  RequestShape shape;
  shape.n = 50;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.group_size = 1;
  shape.head_dim = 8;
  shape.window_rows = 4;
  for (PolicyKind kind : {PolicyKind::kSnapKv, PolicyKind::kAdaKv, PolicyKind::kCriticalKv,
                          PolicyKind::kCriticalAdaKv, PolicyKind::kCake}) {
    SCOPED_TRACE(PolicyKindName(kind));
    PolicySpec policy = PolicySpec::ForKind(kind);
    policy.window = 4;
    policy.budget = Budget::TokensPerHead(20);
    RequestShape s = shape;
    policy::DeriveBudget(policy, s);
    std::vector<float> scores(2 * 2 * 50), norms(2 * 2 * 50, 1.f);
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i % 13) / 16.f;
    const std::vector<double> entropy(4, 1.0), variance(4, 1.0);
    const std::vector<float> safeguard(2, std::numeric_limits<float>::max());
    auto select = [&](const std::vector<float>& prefix) {
      const policy::BaselineStatistics st = {.prefix_scores = prefix,
                                             .value_norms = norms,
                                             .entropy = entropy,
                                             .variance = variance,
                                             .safeguard = safeguard,
                                             .compat_dtype = {}};
      return policy::SelectBaselinePlan(s, policy, st, {});
    };
    ASSERT_TRUE(select(scores).ok());
    scores[(1 * 2 + 0) * 50 + 9] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THAT(select(scores).status(),
                IsStatus(absl::StatusCode::kInternal,
                         "layers[1], KV head 0, position 9: the ranking score is nan"));
  }
}

}  // namespace
}  // namespace laprox::kernels
