#include "service/grpc/convert.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "policy/budget.h"

namespace laprox::service {
namespace {

using kernels::Allocation;
using kernels::GqaValue;
using kernels::Indicator;
using kernels::NumericMode;
using kernels::PolicyKind;
using kernels::Pooling;

absl::StatusOr<kernels::DType> DTypeFromProto(v1::DType dtype, const std::string& field) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return kernels::DType::kF32;
    case v1::DTYPE_F16:
      return kernels::DType::kF16;
    case v1::DTYPE_BF16:
      return kernels::DType::kBF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype = ", v1::DType_Name(dtype), " is not F32, F16 or BF16"));
  }
}

absl::StatusOr<TensorRef> TensorFromProto(const v1::TensorRef& proto, const std::string& field,
                                          bool optional) {
  TensorRef ref;
  switch (proto.source_case()) {
    case v1::TensorRef::SOURCE_NOT_SET:
      if (optional) return ref;
      return absl::InvalidArgumentError(absl::StrCat(field, " is missing"));
    case v1::TensorRef::kRegion:
      ref.source = TensorRef::Source::kRegion;
      ref.region_id = proto.region().region_id();
      ref.byte_offset = proto.region().byte_offset();
      if (ref.byte_offset < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".region.byte_offset = ", ref.byte_offset, " is negative"));
      }
      break;
    case v1::TensorRef::kInlineBytes:
      ref.source = TensorRef::Source::kInline;
      ref.inline_bytes = proto.inline_bytes();
      break;
  }
  auto dtype = DTypeFromProto(proto.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  ref.dtype = *dtype;
  ref.shape.assign(proto.shape().begin(), proto.shape().end());
  ref.strides.assign(proto.strides().begin(), proto.strides().end());
  return ref;
}

// Policy enums travel as the kernels value + 1, with UNSPECIFIED = 0 meaning the policy's
// default (the first kernels value). The static_asserts pin the ends; the proto contract test
// checks every value's number.
static_assert(v1::ALLOCATION_UNIFORM == static_cast<int>(Allocation::kUniform) + 1);
static_assert(v1::INDICATOR_ATTENTION == static_cast<int>(Indicator::kAttention) + 1);
static_assert(v1::GQA_VALUE_EXACT_BLOCK == static_cast<int>(GqaValue::kExactBlock) + 1);
static_assert(v1::POOLING_NONE == static_cast<int>(Pooling::kNone) + 1);
static_assert(v1::POLICY_KIND_CAKE == static_cast<int>(PolicyKind::kCake) + 1);
static_assert(v1::NUMERIC_MODE_KVPRESS_COMPAT == static_cast<int>(NumericMode::kKvpressCompat) + 1);
static_assert(kernels::PolicySpec().kind == PolicyKind{} &&
              kernels::PolicySpec().numeric_mode == NumericMode{} &&
              kernels::PolicySpec().allocation == Allocation{} &&
              kernels::PolicySpec().indicator == Indicator{} &&
              kernels::PolicySpec().gqa_value == GqaValue{} &&
              kernels::PolicySpec().pooling == Pooling{});

template <typename Kernel, typename Wire>
absl::StatusOr<Kernel> EnumFromWire(Wire value, Wire last, const char* field) {
  if (value < 0 || value > last) {
    return absl::InvalidArgumentError(absl::StrCat("policy.", field, " = ", value));
  }
  return static_cast<Kernel>(value == 0 ? 0 : value - 1);
}

template <typename Wire, typename Kernel>
Wire EnumToWire(Kernel value) {
  return static_cast<Wire>(static_cast<int>(value) + 1);
}

absl::StatusOr<kernels::PolicySpec> PolicyFromProto(const v1::ComputeKeepMaskRequest& request) {
  const v1::Policy& p = request.policy();
  // The kind first: every field that is not set takes its default (the backend answers
  // UNIMPLEMENTED for a kind it does not implement).
  auto kind = EnumFromWire<PolicyKind>(p.kind(), v1::PolicyKind_MAX, "kind");
  if (!kind.ok()) return kind.status();
  kernels::PolicySpec spec = kernels::PolicySpec::ForKind(*kind);
  auto numeric_mode =
      EnumFromWire<NumericMode>(p.numeric_mode(), v1::NumericMode_MAX, "numeric_mode");
  auto allocation = EnumFromWire<Allocation>(p.allocation(), v1::Allocation_MAX, "allocation");
  auto indicator = EnumFromWire<Indicator>(p.indicator(), v1::Indicator_MAX, "indicator");
  auto gqa_value = EnumFromWire<GqaValue>(p.gqa_value(), v1::GqaValue_MAX, "gqa_value");
  auto pooling = EnumFromWire<Pooling>(p.pooling(), v1::Pooling_MAX, "pooling");
  for (const absl::Status& s : {numeric_mode.status(), allocation.status(), indicator.status(),
                                gqa_value.status(), pooling.status()}) {
    if (!s.ok()) return s;
  }
  spec.numeric_mode = *numeric_mode;
  spec.allocation = *allocation;
  spec.indicator = *indicator;
  spec.gqa_value = *gqa_value;
  spec.pooling = *pooling;
  if (p.has_window()) spec.window = p.window();
  if (p.has_pool_kernel()) spec.pool_kernel = p.pool_kernel();
  if (p.has_sinks()) spec.sinks = p.sinks();
  if (p.has_min_per_head()) spec.min_per_head = p.min_per_head();
  spec.head_uniform_layers = p.head_uniform_layers();
  kernels::BaselineParams& b = spec.baseline;
  if (p.has_pyramid_beta()) b.pyramid_beta = p.pyramid_beta();
  if (p.has_alpha_safeguard()) b.alpha_safeguard = p.alpha_safeguard();
  if (p.has_epsilon()) b.epsilon = p.epsilon();
  if (p.has_first_stage_ratio()) b.first_stage_ratio = p.first_stage_ratio();
  if (p.has_cake_tau1()) b.cake_tau1 = p.cake_tau1();
  if (p.has_cake_tau2()) b.cake_tau2 = p.cake_tau2();
  if (p.has_cake_gamma()) b.cake_gamma = p.cake_gamma();
  switch (request.budget().kind_case()) {
    case v1::Budget::kTokensPerHead:
      spec.budget = kernels::Budget::TokensPerHead(request.budget().tokens_per_head());
      break;
    case v1::Budget::kCompressionRatio:
      spec.budget = kernels::Budget::CompressionRatio(request.budget().compression_ratio());
      break;
    case v1::Budget::KIND_NOT_SET:
      return absl::InvalidArgumentError(
          "budget is missing: give tokens_per_head or compression_ratio");
  }
  return spec;
}

}  // namespace

absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::RegisterModelRequest& proto) {
  ModelSpec spec;
  spec.name = proto.name();
  const v1::ModelGeometry& g = proto.geometry();
  spec.geometry = {.num_layers = g.num_layers(),
                   .num_heads = g.num_heads(),
                   .num_kv_heads = g.num_kv_heads(),
                   .head_dim = g.head_dim(),
                   .hidden_size = g.hidden_size(),
                   .softmax_scale = g.softmax_scale()};
  spec.cross_grams = proto.prepare_cross_grams();
  for (int l = 0; l < proto.o_proj_size(); ++l) {
    auto ref = TensorFromProto(proto.o_proj(l), absl::StrCat("o_proj[", l, "]"), false);
    if (!ref.ok()) return ref.status();
    spec.o_proj.push_back(*std::move(ref));
  }
  return spec;
}

absl::StatusOr<KeepPlanCall> KeepPlanCallFromProto(const v1::ComputeKeepMaskRequest& proto) {
  KeepPlanCall call;
  call.model_id = proto.model_id();
  call.n = proto.n();
  auto policy = PolicyFromProto(proto);
  if (!policy.ok()) return policy.status();
  call.policy = *policy;
  const v1::OutputOptions& out = proto.outputs();
  if (out.has_destination()) {
    const v1::OutputDestination& d = out.destination();
    if (d.region_id() == 0) {
      return absl::InvalidArgumentError("outputs.destination.region_id is 0");
    }
    OutputDestination& to = call.destination.emplace();
    to.region_id = d.region_id();
    if (d.has_counts_offset()) to.counts = d.counts_offset();
    if (d.has_offsets_offset()) to.offsets = d.offsets_offset();
    if (d.has_positions_offset()) to.positions = d.positions_offset();
    if (d.has_bitmask_offset()) to.bitmask = d.bitmask_offset();
    if (d.has_scores_offset()) to.scores = d.scores_offset();
  }
  call.outputs.positions = out.has_positions() ? out.positions() : true;
  call.outputs.bitmask = out.bitmask();
  call.outputs.scores = out.scores();
  for (int l = 0; l < proto.layers_size(); ++l) {
    const v1::LayerInputs& in = proto.layers(l);
    const std::string prefix = absl::StrCat("layers[", l, "].");
    LayerRefs& refs = call.layers.emplace_back();
    struct Field {
      const v1::TensorRef& proto;
      TensorRef& ref;
      const char* name;
      bool optional;
    };
    for (const Field& f :
         {Field{in.keys(), refs.keys, "keys", false},
          Field{in.values(), refs.values, "values", false},
          Field{in.window_queries(), refs.window_queries, "window_queries", true},
          Field{in.window_attention(), refs.window_attention, "window_attention", true},
          Field{in.window_lse(), refs.window_lse, "window_lse", true}}) {
      auto ref = TensorFromProto(f.proto, prefix + f.name, f.optional);
      if (!ref.ok()) return ref.status();
      f.ref = *std::move(ref);
    }
  }
  return call;
}

void KeepPlanToProto(const kernels::KeepPlan& plan, const KeepPlanCall& call,
                     v1::ComputeKeepMaskResponse* proto) {
  proto->set_num_layers(plan.num_layers);
  proto->set_num_kv_heads(plan.num_kv_heads);
  proto->set_n(plan.n);
  proto->mutable_counts()->Assign(plan.counts.begin(), plan.counts.end());
  proto->mutable_offsets()->Assign(plan.offsets.begin(), plan.offsets.end());
  proto->mutable_positions()->Assign(plan.positions.begin(), plan.positions.end());
  proto->set_bitmask(plan.bitmask.data(), plan.bitmask.size());
  proto->mutable_scores()->Assign(plan.scores.begin(), plan.scores.end());
  proto->mutable_layer_sums()->Assign(plan.layer_sums.begin(), plan.layer_sums.end());
  proto->set_window(plan.window);
  proto->set_sinks(plan.sinks);
  proto->set_quota(plan.quota);
  proto->set_selected_total(plan.selected_total);
  proto->set_tokens_per_head(kernels::policy::BudgetTokensPerHead(call.policy.budget, plan.n));
  v1::Policy* p = proto->mutable_effective_policy();
  p->set_kind(EnumToWire<v1::PolicyKind>(call.policy.kind));
  p->set_numeric_mode(EnumToWire<v1::NumericMode>(call.policy.numeric_mode));
  p->set_allocation(EnumToWire<v1::Allocation>(call.policy.allocation));
  p->set_indicator(EnumToWire<v1::Indicator>(call.policy.indicator));
  p->set_gqa_value(EnumToWire<v1::GqaValue>(call.policy.gqa_value));
  p->set_pooling(EnumToWire<v1::Pooling>(call.policy.pooling));
  p->set_window(call.policy.window);
  p->set_pool_kernel(call.policy.pool_kernel);
  p->set_sinks(call.policy.sinks);
  p->set_min_per_head(call.policy.min_per_head);
  p->set_head_uniform_layers(call.policy.head_uniform_layers);
  const kernels::BaselineParams& b = call.policy.baseline;
  p->set_pyramid_beta(b.pyramid_beta);
  p->set_alpha_safeguard(b.alpha_safeguard);
  p->set_epsilon(b.epsilon);
  p->set_first_stage_ratio(b.first_stage_ratio);
  p->set_cake_tau1(b.cake_tau1);
  p->set_cake_tau2(b.cake_tau2);
  p->set_cake_gamma(b.cake_gamma);
}

void RegionInfoToProto(const RegionInfo& info, v1::RegionInfo* proto) {
  proto->set_region_id(info.id);
  proto->set_kind(info.kind == RegionKind::kShm ? v1::REGION_KIND_SHM : v1::REGION_KIND_CUDA_IPC);
  proto->set_name(info.name);
  proto->set_byte_size(info.byte_size);
  proto->set_writable(info.writable);
  proto->set_in_flight_requests(info.in_use);
  proto->set_draining(info.draining);
}

}  // namespace laprox::service
