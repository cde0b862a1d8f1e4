#include "laprox/kernels/policy.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace laprox::kernels {

absl::string_view AllocationName(Allocation a) {
  switch (a) {
    case Allocation::kGlobalNormalized:
      return "GLOBAL_NORMALIZED";
    case Allocation::kGlobalRaw:
      return "GLOBAL_RAW";
    case Allocation::kPerLayer:
      return "PER_LAYER";
    case Allocation::kUniform:
      return "UNIFORM";
  }
  return "?";
}

absl::string_view IndicatorName(Indicator i) {
  switch (i) {
    case Indicator::kAttentionXProjectedValue:
      return "ATTENTION_X_PROJECTED_VALUE";
    case Indicator::kAttentionXValue:
      return "ATTENTION_X_VALUE";
    case Indicator::kAttention:
      return "ATTENTION";
  }
  return "?";
}

absl::string_view GqaValueName(GqaValue g) {
  switch (g) {
    case GqaValue::kMeanHeadNorm:
      return "MEAN_HEAD_NORM";
    case GqaValue::kSummedProjection:
      return "SUMMED_PROJECTION";
    case GqaValue::kMeanHeadProduct:
      return "MEAN_HEAD_PRODUCT";
    case GqaValue::kExactBlock:
      return "EXACT_BLOCK";
  }
  return "?";
}

absl::string_view PoolingName(Pooling p) {
  switch (p) {
    case Pooling::kAvg:
      return "AVG";
    case Pooling::kMax:
      return "MAX";
    case Pooling::kNone:
      return "NONE";
  }
  return "?";
}

absl::Status PolicySpec::Validate() const {
  if (window < 1 || window > kMaxWindow) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.window = ", window, " is outside [1, ", kMaxWindow, "]"));
  }
  if (pool_kernel < 1 || pool_kernel > kMaxPoolKernel || pool_kernel % 2 == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.pool_kernel = ", pool_kernel, " must be odd and in [1, ", kMaxPoolKernel, "]"));
  }
  if (sinks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("policy.sinks = ", sinks, " is negative"));
  }
  if (min_per_head < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.min_per_head = ", min_per_head, " is negative"));
  }
  if (indicator != Indicator::kAttentionXProjectedValue && gqa_value != GqaValue::kMeanHeadNorm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.gqa_value = ", GqaValueName(gqa_value), " needs indicator ",
        IndicatorName(Indicator::kAttentionXProjectedValue), ", got ", IndicatorName(indicator)));
  }
  switch (budget.kind) {
    case Budget::Kind::kTokensPerHead:
      if (budget.tokens_per_head < 0 || budget.tokens_per_head > kMaxTokensPerHead) {
        return absl::InvalidArgumentError(
            absl::StrCat("budget.tokens_per_head = ", budget.tokens_per_head, " is outside [0, ",
                         kMaxTokensPerHead, "]"));
      }
      break;
    case Budget::Kind::kCompressionRatio:
      if (!(budget.compression_ratio >= 0.0 && budget.compression_ratio < 1.0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "budget.compression_ratio = ", budget.compression_ratio, " is outside [0, 1)"));
      }
      break;
  }
  return absl::OkStatus();
}

}  // namespace laprox::kernels
