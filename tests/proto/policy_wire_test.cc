// PolicyFromProto / PolicyToProto (proto/wire/policy_wire.cc): how a wire Policy becomes the
// PolicySpec the kernels run, the defaults, pool_target and the presets included (SEMANTICS.md,
// "Defaults" and "Presets").
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "laprox/kernels/policy.h"
#include "laprox/v1/laprox.pb.h"
#include "laprox/v1/policy_wire.h"

namespace laprox {
namespace {

using kernels::GqaValue;
using kernels::PolicySpec;
using kernels::Pooling;
using kernels::PoolTarget;
using ::testing::AllOf;
using ::testing::HasSubstr;

absl::StatusOr<PolicySpec> FromProto(const v1::Policy& policy) {
  v1::Budget budget;
  budget.set_tokens_per_head(128);
  return v1::PolicyFromProto(policy, budget);
}

TEST(PolicyWireTest, UnsetFieldsTakeTheLaproxDefaultsAndTheEchoShowsThem) {
  const PolicySpec spec = *FromProto(v1::Policy());
  EXPECT_FALSE(spec.gqa_value.has_value());
  EXPECT_EQ(spec.EffectiveGqaValue(), GqaValue::kMeanHeadProduct);
  EXPECT_EQ(spec.EffectivePoolTarget(), PoolTarget::kScore);
  EXPECT_EQ(spec.pooling, Pooling::kAvgPeak);
  EXPECT_EQ(spec.pool_kernel, 31);
  EXPECT_EQ(spec.window, 32);
  EXPECT_EQ(spec.sinks, 0);
  v1::Policy echo;
  v1::PolicyToProto(spec, &echo);
  EXPECT_EQ(echo.kind(), v1::POLICY_KIND_LAPROX);
  EXPECT_EQ(echo.indicator(), v1::INDICATOR_ATTENTION_X_PROJECTED_VALUE);
  EXPECT_EQ(echo.gqa_value(), v1::GQA_VALUE_MEAN_HEAD_PRODUCT);
  EXPECT_EQ(echo.pool_target(), v1::POOL_TARGET_SCORE);
  EXPECT_EQ(echo.pooling(), v1::POOLING_AVG_PEAK);
  EXPECT_EQ(echo.pool_kernel(), 31);
  EXPECT_EQ(echo.window(), 32);
}

// max_layer_share: unset stays unset both ways; a value (even an invalid one: the kernels
// validate it) decodes as given and the echo carries it.
TEST(PolicyWireTest, MaxLayerShareTravelsBothWays) {
  const PolicySpec unset = *FromProto(v1::Policy());
  EXPECT_FALSE(unset.max_layer_share.has_value());
  v1::Policy echo;
  v1::PolicyToProto(unset, &echo);
  EXPECT_FALSE(echo.has_max_layer_share());
  for (const double value : {1.0, 1.25, 3.0, 0.5}) {
    v1::Policy policy;
    policy.set_max_layer_share(value);
    const PolicySpec spec = *FromProto(policy);
    ASSERT_TRUE(spec.max_layer_share.has_value());
    EXPECT_EQ(*spec.max_layer_share, value);
    v1::Policy back;
    v1::PolicyToProto(spec, &back);
    EXPECT_TRUE(back.has_max_layer_share());
    EXPECT_EQ(back.max_layer_share(), value);
  }
  v1::Policy bad;
  bad.set_max_layer_share(0.5);
  EXPECT_THAT(FromProto(bad)->Validate().message(), HasSubstr("policy.max_layer_share = 0.5"));
}

// ATTENTION and ATTENTION_X_VALUE take only MEAN_HEAD_NORM: an unset gqa_value is that one, an
// explicit other one is still INVALID_ARGUMENT naming both.
TEST(PolicyWireTest, UnsetGqaValueWithAnotherIndicatorIsMeanHeadNorm) {
  for (v1::Indicator indicator : {v1::INDICATOR_ATTENTION, v1::INDICATOR_ATTENTION_X_VALUE}) {
    SCOPED_TRACE(v1::Indicator_Name(indicator));
    v1::Policy policy;
    policy.set_indicator(indicator);
    const PolicySpec spec = *FromProto(policy);
    EXPECT_TRUE(spec.Validate().ok()) << spec.Validate();
    EXPECT_EQ(spec.EffectiveGqaValue(), GqaValue::kMeanHeadNorm);
    v1::Policy echo;
    v1::PolicyToProto(spec, &echo);
    EXPECT_EQ(echo.gqa_value(), v1::GQA_VALUE_MEAN_HEAD_NORM);
    EXPECT_EQ(echo.pool_target(), v1::POOL_TARGET_ATTENTION);
    EXPECT_EQ(echo.pool_kernel(), 31);
    EXPECT_TRUE(FromProto(echo)->Validate().ok());
  }
  v1::Policy policy;
  policy.set_indicator(v1::INDICATOR_ATTENTION);
  policy.set_gqa_value(v1::GQA_VALUE_EXACT_BLOCK);
  const absl::Status s = FromProto(policy)->Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("policy.gqa_value = EXACT_BLOCK"), HasSubstr("got ATTENTION")));
}

// The baselines keep kvpress's defaults; LAPROX's gqa_value and pool_kernel do not reach them.
TEST(PolicyWireTest, BaselinesKeepTheirDefaults) {
  struct Expected {
    v1::PolicyKind kind;
    int window, pool_kernel, sinks;
  };
  for (const Expected& e : {Expected{v1::POLICY_KIND_SNAPKV, 64, 5, 0},
                            Expected{v1::POLICY_KIND_CRITICAL_ADAKV, 64, 5, 0},
                            Expected{v1::POLICY_KIND_CAKE, 32, 5, 0},
                            Expected{v1::POLICY_KIND_STREAMING_LLM, 32, 7, 4}}) {
    SCOPED_TRACE(v1::PolicyKind_Name(e.kind));
    v1::Policy policy;
    policy.set_kind(e.kind);
    v1::Policy echo;
    v1::PolicyToProto(*FromProto(policy), &echo);
    EXPECT_EQ(echo.window(), e.window);
    EXPECT_EQ(echo.pool_kernel(), e.pool_kernel);
    EXPECT_EQ(echo.sinks(), e.sinks);
    EXPECT_EQ(echo.pooling(), v1::POOLING_AVG);
    EXPECT_EQ(echo.gqa_value(), v1::GQA_VALUE_MEAN_HEAD_NORM);
    EXPECT_EQ(echo.pool_target(), v1::POOL_TARGET_ATTENTION);
  }
}

TEST(PolicyWireTest, PoolTargetUnsetIsTheModesPlacementAndTravelsResolved) {
  v1::Policy policy;
  policy.set_gqa_value(v1::GQA_VALUE_MEAN_HEAD_NORM);
  PolicySpec spec = *FromProto(policy);
  EXPECT_FALSE(spec.pool_target.has_value());
  EXPECT_EQ(spec.EffectivePoolTarget(), PoolTarget::kAttention);
  policy.set_gqa_value(v1::GQA_VALUE_EXACT_BLOCK);
  spec = *FromProto(policy);
  EXPECT_EQ(spec.EffectivePoolTarget(), PoolTarget::kScore);
  // The echo names the placement applied.
  v1::Policy echo;
  v1::PolicyToProto(spec, &echo);
  EXPECT_EQ(echo.pool_target(), v1::POOL_TARGET_SCORE);
  policy.set_pool_target(v1::POOL_TARGET_ATTENTION);
  spec = *FromProto(policy);
  EXPECT_EQ(spec.pool_target, PoolTarget::kAttention);
  v1::PolicyToProto(spec, &echo);
  EXPECT_EQ(echo.pool_target(), v1::POOL_TARGET_ATTENTION);
  EXPECT_EQ(echo.preset(), v1::POLICY_PRESET_UNSPECIFIED);
}

TEST(PolicyWireTest, UndefinedEnumValuesNameTheField) {
  v1::Policy policy;
  policy.set_pool_target(static_cast<v1::PoolTarget>(7));
  EXPECT_THAT(FromProto(policy).status().message(), HasSubstr("policy.pool_target = 7"));
  policy.set_pool_target(v1::POOL_TARGET_SCORE);
  policy.set_preset(static_cast<v1::PolicyPreset>(9));
  EXPECT_THAT(FromProto(policy).status().message(), HasSubstr("policy.preset = 9"));
  // Baselines ignore pool_target but still check it.
  policy.set_preset(v1::POLICY_PRESET_UNSPECIFIED);
  policy.set_kind(v1::POLICY_KIND_SNAPKV);
  policy.set_pool_target(static_cast<v1::PoolTarget>(-1));
  EXPECT_EQ(FromProto(policy).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PolicyWireTest, PaperPresetFillsTheFieldsLeftUnset) {
  v1::Policy policy;
  policy.set_preset(v1::POLICY_PRESET_PAPER);
  PolicySpec spec = *FromProto(policy);
  EXPECT_EQ(spec.indicator, kernels::Indicator::kAttentionXProjectedValue);
  EXPECT_EQ(spec.allocation, kernels::Allocation::kGlobalNormalized);
  EXPECT_EQ(spec.gqa_value, GqaValue::kSummedProjection);
  EXPECT_EQ(spec.pooling, Pooling::kNone);
  EXPECT_EQ(spec.window, 32);
  EXPECT_EQ(spec.sinks, 0);
  EXPECT_EQ(spec.min_per_head, 0);
  EXPECT_EQ(spec.pool_kernel, PolicySpec().pool_kernel);
  EXPECT_FALSE(spec.pool_target.has_value());
  EXPECT_TRUE(spec.Validate().ok());

  // A field set explicitly wins.
  policy.set_gqa_value(v1::GQA_VALUE_EXACT_BLOCK);
  policy.set_pooling(v1::POOLING_MAX);
  policy.set_window(16);
  policy.set_sinks(4);
  policy.set_min_per_head(2);
  policy.set_allocation(v1::ALLOCATION_PER_LAYER);
  spec = *FromProto(policy);
  EXPECT_EQ(spec.gqa_value, GqaValue::kExactBlock);
  EXPECT_EQ(spec.pooling, Pooling::kMax);
  EXPECT_EQ(spec.window, 16);
  EXPECT_EQ(spec.sinks, 4);
  EXPECT_EQ(spec.min_per_head, 2);
  EXPECT_EQ(spec.allocation, kernels::Allocation::kPerLayer);

  // Another indicator leaves gqa_value unset: MEAN_HEAD_NORM, the only one it takes.
  v1::Policy attention;
  attention.set_preset(v1::POLICY_PRESET_PAPER);
  attention.set_indicator(v1::INDICATOR_ATTENTION);
  spec = *FromProto(attention);
  EXPECT_FALSE(spec.gqa_value.has_value());
  EXPECT_EQ(spec.EffectiveGqaValue(), GqaValue::kMeanHeadNorm);
  EXPECT_EQ(spec.pooling, Pooling::kNone);
  EXPECT_TRUE(spec.Validate().ok());
}

TEST(PolicyWireTest, DefaultPresetIsTheDefaults) {
  v1::Policy policy;
  policy.set_preset(v1::POLICY_PRESET_DEFAULT);
  policy.set_kind(v1::POLICY_KIND_LAPROX);
  const PolicySpec spec = *FromProto(policy);
  v1::Policy with, without;
  v1::PolicyToProto(spec, &with);
  v1::PolicyToProto(*FromProto(v1::Policy()), &without);
  EXPECT_EQ(with.SerializeAsString(), without.SerializeAsString());
}

TEST(PolicyWireTest, PresetWithABaselineKindIsInvalid) {
  for (v1::PolicyPreset preset : {v1::POLICY_PRESET_DEFAULT, v1::POLICY_PRESET_PAPER}) {
    v1::Policy policy;
    policy.set_preset(preset);
    policy.set_kind(v1::POLICY_KIND_SNAPKV);
    const absl::Status s = FromProto(policy).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), AllOf(HasSubstr("policy.preset = POLICY_PRESET_"),
                                   HasSubstr("policy.kind"), HasSubstr("POLICY_KIND_SNAPKV")));
  }
}

}  // namespace
}  // namespace laprox
