#include "laprox/kernels/policy.h"

#include <charconv>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace laprox::kernels {
namespace {

// A baseline parameter outside its range: "policy.cake_tau1 = -1 must be finite and > 0".
absl::Status CheckParam(const char* name, double value, double low, bool low_inclusive, double high,
                        const char* range) {
  const bool ok =
      std::isfinite(value) && (low_inclusive ? value >= low : value > low) && value <= high;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("policy.", name, " = ", value, " ", range));
}

absl::Status ValidateBaseline(const BaselineParams& b) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (absl::Status s : {
           CheckParam("pyramid_beta", b.pyramid_beta, 1.0, true, kInf, "must be finite and >= 1"),
           CheckParam("alpha_safeguard", b.alpha_safeguard, 0.0, true, 1.0, "is outside [0, 1]"),
           CheckParam("epsilon", b.epsilon, 0.0, true, kInf, "must be finite and >= 0"),
           CheckParam("first_stage_ratio", b.first_stage_ratio, 0.0, true, 1.0,
                      "is outside [0, 1]"),
           CheckParam("cake_tau1", b.cake_tau1, 0.0, false, kInf, "must be finite and > 0"),
           CheckParam("cake_tau2", b.cake_tau2, 0.0, false, kInf, "must be finite and > 0"),
           CheckParam("cake_gamma", b.cake_gamma, 0.0, true, kInf, "must be finite and >= 0"),
       }) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The plan shape against the kind, head_uniform_layers and block_size (SEMANTICS.md, "Plan
// shapes").
absl::Status ValidatePlanShape(const PolicySpec& p) {
  const bool blocks = IsBlockShape(p.plan_shape);
  if (blocks && p.head_uniform_layers && p.kind == PolicyKind::kLaprox) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.head_uniform_layers = true asks for LAYER_UNIFORM plans, but policy.plan_shape = ",
        PlanShapeName(p.plan_shape)));
  }
  const bool block_kind = p.kind == PolicyKind::kLaprox || p.kind == PolicyKind::kStreamingLlm ||
                          p.kind == PolicyKind::kSnapKv || p.kind == PolicyKind::kAdaKv;
  if (blocks && !block_kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.plan_shape = ", PlanShapeName(p.plan_shape), " is not defined for policy.kind = ",
        PolicyKindName(p.kind), " (block shapes: LAPROX, STREAMING_LLM, SNAPKV, ADAKV)"));
  }
  if (p.plan_shape == PlanShape::kLayerUniform &&
      (p.kind == PolicyKind::kAdaKv || p.kind == PolicyKind::kCriticalAdaKv)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.plan_shape = LAYER_UNIFORM is not defined for policy.kind = ",
                     PolicyKindName(p.kind), ", whose heads keep different counts by design"));
  }
  if (p.block_size < 0 || p.block_size > PolicySpec::kMaxBlockSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.block_size = ", p.block_size, " is outside [1, ", PolicySpec::kMaxBlockSize, "]"));
  }
  if (p.block_size != 0 && !blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.block_size = ", p.block_size, " is set, but policy.plan_shape = ",
        PlanShapeName(p.plan_shape), " is not a block shape (BLOCKS_SHARED, BLOCKS_PER_LAYER)"));
  }
  return absl::OkStatus();
}

// max_layer_share (SEMANTICS.md, "Selection"): finite and >= 1, LAPROX only, not with a block
// shape.
absl::Status ValidateMaxLayerShare(const PolicySpec& p) {
  if (!p.max_layer_share) return absl::OkStatus();
  // The shortest text that reads back as the value (0.9999999 is not printed as "1").
  char text[32];
  const std::to_chars_result end =
      std::to_chars(std::begin(text), std::end(text), *p.max_layer_share);
  const std::string s(text, end.ptr);
  if (!(std::isfinite(*p.max_layer_share) && *p.max_layer_share >= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.max_layer_share = ", s, " must be finite and >= 1"));
  }
  if (p.kind != PolicyKind::kLaprox) {
    return absl::InvalidArgumentError(absl::StrCat("policy.max_layer_share = ", s,
                                                   " is a LAPROX option, not defined for ",
                                                   "policy.kind = ", PolicyKindName(p.kind)));
  }
  const PlanShape shape = p.EffectivePlanShape();
  if (IsBlockShape(shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.max_layer_share = ", s, " is not defined for policy.plan_shape = ",
                     PlanShapeName(shape), " (RAGGED and LAYER_UNIFORM take it)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<int64_t> PolicySpec::LayerSelectionCap(int64_t num_layers, int64_t num_kv_heads,
                                                     int64_t quota) const {
  if (!max_layer_share || kind != PolicyKind::kLaprox ||
      (allocation != Allocation::kGlobalNormalized && allocation != Allocation::kGlobalRaw)) {
    return std::nullopt;
  }
  const int64_t average = num_kv_heads * quota;  // K / L
  const int64_t total = num_layers * average;    // K
  const double cap = std::floor(*max_layer_share * static_cast<double>(average));
  if (!(cap < static_cast<double>(total))) return total;
  return static_cast<int64_t>(cap);
}

absl::string_view PolicyKindName(PolicyKind k) {
  switch (k) {
    case PolicyKind::kLaprox:
      return "LAPROX";
    case PolicyKind::kStreamingLlm:
      return "STREAMING_LLM";
    case PolicyKind::kSnapKv:
      return "SNAPKV";
    case PolicyKind::kPyramidKv:
      return "PYRAMIDKV";
    case PolicyKind::kAdaKv:
      return "ADAKV";
    case PolicyKind::kCriticalKv:
      return "CRITICALKV";
    case PolicyKind::kCriticalAdaKv:
      return "CRITICAL_ADAKV";
    case PolicyKind::kCake:
      return "CAKE";
  }
  return "?";
}

absl::string_view NumericModeName(NumericMode m) {
  return m == NumericMode::kKvpressCompat ? "KVPRESS_COMPAT" : "EXACT";
}

PolicySpec PolicySpec::ForKind(PolicyKind kind) {
  PolicySpec spec;
  spec.kind = kind;
  switch (kind) {
    case PolicyKind::kLaprox:
      break;
    case PolicyKind::kStreamingLlm:
      spec.sinks = 4;
      spec.pooling = Pooling::kAvg;  // unused by STREAMING_LLM, like the kernel
      spec.pool_kernel = 7;          // effective_policy keeps showing 7
      break;
    case PolicyKind::kSnapKv:
    case PolicyKind::kPyramidKv:
    case PolicyKind::kAdaKv:
    case PolicyKind::kCriticalKv:
    case PolicyKind::kCriticalAdaKv:
      spec.window = 64;
      spec.pooling = Pooling::kAvg;
      spec.pool_kernel = 5;
      break;
    case PolicyKind::kCake:
      spec.pooling = Pooling::kAvg;
      spec.pool_kernel = 5;
      break;
  }
  return spec;
}

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
    case Pooling::kAvgPeak:
      return "AVG_PEAK";
  }
  return "?";
}

absl::string_view PoolTargetName(PoolTarget t) {
  return t == PoolTarget::kScore ? "SCORE" : "ATTENTION";
}

absl::string_view PlanShapeName(PlanShape s) {
  switch (s) {
    case PlanShape::kRagged:
      return "RAGGED";
    case PlanShape::kLayerUniform:
      return "LAYER_UNIFORM";
    case PlanShape::kBlocksShared:
      return "BLOCKS_SHARED";
    case PlanShape::kBlocksPerLayer:
      return "BLOCKS_PER_LAYER";
  }
  return "?";
}

PlanShape PolicySpec::EffectivePlanShape() const {
  if (plan_shape == PlanShape::kRagged && head_uniform_layers && kind == PolicyKind::kLaprox) {
    return PlanShape::kLayerUniform;
  }
  return plan_shape;
}

GqaValue PolicySpec::EffectiveGqaValue() const {
  if (gqa_value) return *gqa_value;
  return kind == PolicyKind::kLaprox && indicator == Indicator::kAttentionXProjectedValue
             ? GqaValue::kMeanHeadProduct
             : GqaValue::kMeanHeadNorm;
}

PoolTarget PolicySpec::EffectivePoolTarget() const {
  if (pool_target) return *pool_target;
  const GqaValue gqa = EffectiveGqaValue();
  const bool per_head = indicator == Indicator::kAttentionXProjectedValue &&
                        (gqa == GqaValue::kMeanHeadProduct || gqa == GqaValue::kExactBlock);
  return per_head ? PoolTarget::kScore : PoolTarget::kAttention;
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
  if (absl::Status s = ValidateBaseline(baseline); !s.ok()) return s;
  // Baselines ignore indicator and gqa_value, so their combination does not matter there.
  if (kind == PolicyKind::kLaprox && indicator != Indicator::kAttentionXProjectedValue &&
      EffectiveGqaValue() != GqaValue::kMeanHeadNorm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.gqa_value = ", GqaValueName(EffectiveGqaValue()), " needs indicator ",
        IndicatorName(Indicator::kAttentionXProjectedValue), ", got ", IndicatorName(indicator)));
  }
  if (absl::Status s = ValidatePlanShape(*this); !s.ok()) return s;
  if (absl::Status s = ValidateMaxLayerShare(*this); !s.ok()) return s;
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
