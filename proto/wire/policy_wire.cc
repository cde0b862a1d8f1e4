#include "laprox/v1/policy_wire.h"

#include "absl/strings/str_cat.h"

namespace laprox::v1 {
namespace {

namespace k = ::laprox::kernels;

static_assert(ALLOCATION_UNIFORM == static_cast<int>(k::Allocation::kUniform) + 1);
static_assert(INDICATOR_ATTENTION == static_cast<int>(k::Indicator::kAttention) + 1);
static_assert(GQA_VALUE_EXACT_BLOCK == static_cast<int>(k::GqaValue::kExactBlock) + 1);
static_assert(POOLING_AVG_PEAK == static_cast<int>(k::Pooling::kAvgPeak) + 1);
static_assert(POOL_TARGET_SCORE == static_cast<int>(k::PoolTarget::kScore) + 1);
static_assert(POLICY_KIND_CAKE == static_cast<int>(k::PolicyKind::kCake) + 1);
static_assert(PLAN_SHAPE_BLOCKS_PER_LAYER == static_cast<int>(k::PlanShape::kBlocksPerLayer) + 1);
static_assert(NUMERIC_MODE_KVPRESS_COMPAT == static_cast<int>(k::NumericMode::kKvpressCompat) + 1);
// UNSPECIFIED (0) decodes to the first kernels value, which must be the default (gqa_value and
// pool_target: UNSPECIFIED leaves them unset, PolicySpec resolves them; pooling: UNSPECIFIED
// keeps the kind's default from PolicySpec::ForKind).
static_assert(k::PolicySpec().kind == k::PolicyKind{} &&
              k::PolicySpec().numeric_mode == k::NumericMode{} &&
              k::PolicySpec().allocation == k::Allocation{} &&
              k::PolicySpec().indicator == k::Indicator{} &&
              k::PolicySpec().plan_shape == k::PlanShape{});

template <typename Wire>
absl::Status CheckWire(Wire value, Wire last, const char* field) {
  if (value >= 0 && value <= last) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("policy.", field, " = ", value));
}

template <typename Kernel, typename Wire>
absl::StatusOr<Kernel> EnumFromWire(Wire value, Wire last, const char* field) {
  if (absl::Status s = CheckWire(value, last, field); !s.ok()) return s;
  return static_cast<Kernel>(value == 0 ? 0 : value - 1);
}

template <typename Wire, typename Kernel>
Wire EnumToWire(Kernel value) {
  return static_cast<Wire>(static_cast<int>(value) + 1);
}

// Fills the fields the preset names where the request leaves them unset (SEMANTICS.md,
// "Presets"). The request's kind is valid; INVALID_ARGUMENT for a preset with another kind.
absl::Status ApplyPreset(const Policy& p, k::PolicySpec* spec) {
  if (p.preset() == POLICY_PRESET_UNSPECIFIED) return absl::OkStatus();
  if (spec->kind != k::PolicyKind::kLaprox) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.preset = ", PolicyPreset_Name(p.preset()), " needs policy.kind = ",
                     PolicyKind_Name(POLICY_KIND_LAPROX), ", got ", PolicyKind_Name(p.kind())));
  }
  if (p.preset() != POLICY_PRESET_PAPER) return absl::OkStatus();  // DEFAULT: the defaults
  if (p.indicator() == INDICATOR_UNSPECIFIED) {
    spec->indicator = k::Indicator::kAttentionXProjectedValue;
  }
  if (p.allocation() == ALLOCATION_UNSPECIFIED) {
    spec->allocation = k::Allocation::kGlobalNormalized;
  }
  // A gqa_value combines projected values only: with another indicator it stays unset
  // (MEAN_HEAD_NORM, PolicySpec::EffectiveGqaValue).
  if (p.gqa_value() == GQA_VALUE_UNSPECIFIED &&
      spec->indicator == k::Indicator::kAttentionXProjectedValue) {
    spec->gqa_value = k::GqaValue::kSummedProjection;
  }
  if (p.pooling() == POOLING_UNSPECIFIED) spec->pooling = k::Pooling::kNone;
  if (!p.has_window()) spec->window = 32;
  if (!p.has_sinks()) spec->sinks = 0;
  if (!p.has_min_per_head()) spec->min_per_head = 0;
  return absl::OkStatus();
}

}  // namespace

void PolicyToProto(const kernels::PolicySpec& policy, Policy* p) {
  p->set_kind(EnumToWire<PolicyKind>(policy.kind));
  p->set_numeric_mode(EnumToWire<NumericMode>(policy.numeric_mode));
  p->set_allocation(EnumToWire<Allocation>(policy.allocation));
  p->set_indicator(EnumToWire<Indicator>(policy.indicator));
  p->set_gqa_value(EnumToWire<GqaValue>(policy.EffectiveGqaValue()));
  p->set_pooling(EnumToWire<Pooling>(policy.pooling));
  p->set_pool_target(EnumToWire<PoolTarget>(policy.EffectivePoolTarget()));
  p->set_window(policy.window);
  p->set_pool_kernel(policy.pool_kernel);
  p->set_sinks(policy.sinks);
  p->set_min_per_head(policy.min_per_head);
  p->set_head_uniform_layers(policy.head_uniform_layers);
  p->set_plan_shape(EnumToWire<PlanShape>(policy.EffectivePlanShape()));
  if (policy.block_size != 0) p->set_block_size(policy.block_size);
  if (policy.max_layer_share) p->set_max_layer_share(*policy.max_layer_share);
  const kernels::BaselineParams& b = policy.baseline;
  p->set_pyramid_beta(b.pyramid_beta);
  p->set_alpha_safeguard(b.alpha_safeguard);
  p->set_epsilon(b.epsilon);
  p->set_first_stage_ratio(b.first_stage_ratio);
  p->set_cake_tau1(b.cake_tau1);
  p->set_cake_tau2(b.cake_tau2);
  p->set_cake_gamma(b.cake_gamma);
}

void BudgetToProto(const kernels::Budget& budget, Budget* proto) {
  if (budget.kind == kernels::Budget::Kind::kTokensPerHead) {
    proto->set_tokens_per_head(budget.tokens_per_head);
  } else {
    proto->set_compression_ratio(budget.compression_ratio);
  }
}

absl::StatusOr<kernels::PolicySpec> PolicyFromProto(const Policy& p, const Budget& budget) {
  // The kind first: every field that is not set takes its default (the backend answers
  // UNIMPLEMENTED for a kind it does not implement).
  auto kind = EnumFromWire<k::PolicyKind>(p.kind(), PolicyKind_MAX, "kind");
  if (!kind.ok()) return kind.status();
  kernels::PolicySpec spec = kernels::PolicySpec::ForKind(*kind);
  auto numeric_mode =
      EnumFromWire<k::NumericMode>(p.numeric_mode(), NumericMode_MAX, "numeric_mode");
  auto allocation = EnumFromWire<k::Allocation>(p.allocation(), Allocation_MAX, "allocation");
  auto indicator = EnumFromWire<k::Indicator>(p.indicator(), Indicator_MAX, "indicator");
  auto gqa_value = EnumFromWire<k::GqaValue>(p.gqa_value(), GqaValue_MAX, "gqa_value");
  auto pooling = EnumFromWire<k::Pooling>(p.pooling(), Pooling_MAX, "pooling");
  auto pool_target = EnumFromWire<k::PoolTarget>(p.pool_target(), PoolTarget_MAX, "pool_target");
  auto plan_shape = EnumFromWire<k::PlanShape>(p.plan_shape(), PlanShape_MAX, "plan_shape");
  for (const absl::Status& s :
       {numeric_mode.status(), allocation.status(), indicator.status(), gqa_value.status(),
        pooling.status(), pool_target.status(), plan_shape.status(),
        CheckWire(p.preset(), PolicyPreset_MAX, "preset")}) {
    if (!s.ok()) return s;
  }
  spec.numeric_mode = *numeric_mode;
  spec.allocation = *allocation;
  spec.indicator = *indicator;
  if (p.gqa_value() != GQA_VALUE_UNSPECIFIED) spec.gqa_value = *gqa_value;
  if (p.pooling() != POOLING_UNSPECIFIED) spec.pooling = *pooling;
  if (p.pool_target() != POOL_TARGET_UNSPECIFIED) spec.pool_target = *pool_target;
  if (p.has_window()) spec.window = p.window();
  if (p.has_pool_kernel()) spec.pool_kernel = p.pool_kernel();
  if (p.has_sinks()) spec.sinks = p.sinks();
  if (p.has_min_per_head()) spec.min_per_head = p.min_per_head();
  spec.head_uniform_layers = p.head_uniform_layers();
  spec.plan_shape = *plan_shape;
  if (p.has_block_size()) {
    if (p.block_size() < 1) {
      return absl::InvalidArgumentError(absl::StrCat("policy.block_size = ", p.block_size(),
                                                     " is outside [1, ",
                                                     k::PolicySpec::kMaxBlockSize, "]"));
    }
    spec.block_size = p.block_size();
  }
  if (p.has_max_layer_share()) spec.max_layer_share = p.max_layer_share();
  kernels::BaselineParams& b = spec.baseline;
  if (p.has_pyramid_beta()) b.pyramid_beta = p.pyramid_beta();
  if (p.has_alpha_safeguard()) b.alpha_safeguard = p.alpha_safeguard();
  if (p.has_epsilon()) b.epsilon = p.epsilon();
  if (p.has_first_stage_ratio()) b.first_stage_ratio = p.first_stage_ratio();
  if (p.has_cake_tau1()) b.cake_tau1 = p.cake_tau1();
  if (p.has_cake_tau2()) b.cake_tau2 = p.cake_tau2();
  if (p.has_cake_gamma()) b.cake_gamma = p.cake_gamma();
  if (absl::Status s = ApplyPreset(p, &spec); !s.ok()) return s;
  switch (budget.kind_case()) {
    case Budget::kTokensPerHead:
      spec.budget = kernels::Budget::TokensPerHead(budget.tokens_per_head());
      break;
    case Budget::kCompressionRatio:
      spec.budget = kernels::Budget::CompressionRatio(budget.compression_ratio());
      break;
    case Budget::KIND_NOT_SET:
      return absl::InvalidArgumentError(
          "budget is missing: give tokens_per_head or compression_ratio");
  }
  return spec;
}

DType DTypeToProto(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kF32:
      return DTYPE_F32;
    case kernels::DType::kF16:
      return DTYPE_F16;
    case kernels::DType::kBF16:
      return DTYPE_BF16;
  }
  return DTYPE_UNSPECIFIED;
}

absl::StatusOr<kernels::DType> DTypeFromProto(DType dtype, const std::string& field) {
  switch (dtype) {
    case DTYPE_F32:
      return kernels::DType::kF32;
    case DTYPE_F16:
      return kernels::DType::kF16;
    case DTYPE_BF16:
      return kernels::DType::kBF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype = ", DType_Name(dtype), " is not F32, F16 or BF16"));
  }
}

}  // namespace laprox::v1
