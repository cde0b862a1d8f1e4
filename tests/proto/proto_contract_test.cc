// The wire API mirrors the kernels API: every policy option value and dtype the library has must
// be expressible in laprox.v1 (named <ENUM>_<VALUE>, docs/style.md), so that no option is reachable
// from C++ but not from a client.
#include <string>

#include <google/protobuf/descriptor.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/tensor_view.h"
#include "laprox/v1/laprox.pb.h"

namespace laprox {
namespace {

using google::protobuf::EnumDescriptor;

// The wire value named <PREFIX>_<name> exists and, when `kernel_value` >= 0, its number is
// kernel_value + 1: the server and the client convert policy enums by that rule.
void ExpectValue(const EnumDescriptor* e, const std::string& prefix, absl::string_view name,
                 int kernel_value = -1) {
  const std::string full = absl::StrCat(prefix, "_", name);
  const auto* value = e->FindValueByName(full);
  ASSERT_NE(value, nullptr) << e->full_name() << " lacks " << full;
  if (kernel_value >= 0) {
    EXPECT_EQ(value->number(), kernel_value + 1) << full;
  }
}

TEST(ProtoContractTest, EveryPolicyOptionHasAWireValue) {
  using namespace kernels;  // NOLINT(google-build-using-namespace): test brevity
  for (Allocation a : {Allocation::kGlobalNormalized, Allocation::kGlobalRaw, Allocation::kPerLayer,
                       Allocation::kUniform}) {
    ExpectValue(v1::Allocation_descriptor(), "ALLOCATION", AllocationName(a), static_cast<int>(a));
  }
  for (Indicator i :
       {Indicator::kAttentionXProjectedValue, Indicator::kAttentionXValue, Indicator::kAttention}) {
    ExpectValue(v1::Indicator_descriptor(), "INDICATOR", IndicatorName(i), static_cast<int>(i));
  }
  for (GqaValue g : {GqaValue::kMeanHeadNorm, GqaValue::kSummedProjection,
                     GqaValue::kMeanHeadProduct, GqaValue::kExactBlock}) {
    ExpectValue(v1::GqaValue_descriptor(), "GQA_VALUE", GqaValueName(g), static_cast<int>(g));
  }
  for (Pooling p : {Pooling::kAvg, Pooling::kMax, Pooling::kNone, Pooling::kAvgPeak}) {
    ExpectValue(v1::Pooling_descriptor(), "POOLING", PoolingName(p), static_cast<int>(p));
  }
  for (PoolTarget t : {PoolTarget::kAttention, PoolTarget::kScore}) {
    ExpectValue(v1::PoolTarget_descriptor(), "POOL_TARGET", PoolTargetName(t), static_cast<int>(t));
  }
  for (PolicyKind k : {PolicyKind::kLaprox, PolicyKind::kStreamingLlm, PolicyKind::kSnapKv,
                       PolicyKind::kPyramidKv, PolicyKind::kAdaKv, PolicyKind::kCriticalKv,
                       PolicyKind::kCriticalAdaKv, PolicyKind::kCake}) {
    ExpectValue(v1::PolicyKind_descriptor(), "POLICY_KIND", PolicyKindName(k), static_cast<int>(k));
  }
  for (NumericMode m : {NumericMode::kExact, NumericMode::kKvpressCompat}) {
    ExpectValue(v1::NumericMode_descriptor(), "NUMERIC_MODE", NumericModeName(m),
                static_cast<int>(m));
  }
  // Every wire value is reachable from the library (no kind or mode only a client can name).
  EXPECT_EQ(v1::PolicyKind_MAX, static_cast<int>(PolicyKind::kCake) + 1);
  EXPECT_EQ(v1::NumericMode_MAX, static_cast<int>(NumericMode::kKvpressCompat) + 1);
  EXPECT_EQ(v1::PoolTarget_MAX, static_cast<int>(PoolTarget::kScore) + 1);
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::string name(DTypeName(d));
    for (char& c : name) c = static_cast<char>(std::toupper(c));
    ExpectValue(v1::DType_descriptor(), "DTYPE", name);
  }
}

// Field numbers 20-49 of Policy hold the baseline options, each optional (unset = the kind's
// default) except the numeric_mode enum.
TEST(ProtoContractTest, BaselineOptionsUseTheReservedFieldNumbers) {
  const auto* policy = v1::Policy::descriptor();
  for (const char* name : {"numeric_mode", "pyramid_beta", "alpha_safeguard", "epsilon",
                           "first_stage_ratio", "cake_tau1", "cake_tau2", "cake_gamma"}) {
    const auto* field = policy->FindFieldByName(name);
    ASSERT_NE(field, nullptr) << name;
    EXPECT_GE(field->number(), 20) << name;
    EXPECT_LE(field->number(), 49) << name;
    if (field->type() == google::protobuf::FieldDescriptor::TYPE_DOUBLE) {
      EXPECT_TRUE(field->has_presence()) << name << " must be optional";
    }
  }
}

TEST(ProtoContractTest, EveryEnumStartsWithUnspecified) {
  const auto* file = v1::Allocation_descriptor()->file();
  for (int i = 0; i < file->enum_type_count(); ++i) {
    const EnumDescriptor* e = file->enum_type(i);
    ASSERT_GT(e->value_count(), 0);
    EXPECT_EQ(e->value(0)->number(), 0) << e->name();
    EXPECT_TRUE(absl::EndsWith(e->value(0)->name(), "_UNSPECIFIED")) << e->name();
  }
}

}  // namespace
}  // namespace laprox
