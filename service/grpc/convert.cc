#include "service/grpc/convert.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "laprox/v1/policy_wire.h"
#include "policy/budget.h"

namespace laprox::service {
namespace {

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
  auto dtype = v1::DTypeFromProto(proto.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  ref.dtype = *dtype;
  ref.shape.assign(proto.shape().begin(), proto.shape().end());
  ref.strides.assign(proto.strides().begin(), proto.strides().end());
  return ref;
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
  auto policy = v1::PolicyFromProto(proto.policy(), proto.budget());
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
    struct Offset {
      bool given;
      int64_t value;
      std::optional<int64_t>& to;
      const char* name;
    };
    for (const Offset& o :
         {Offset{d.has_counts_offset(), d.counts_offset(), to.counts, "counts"},
          Offset{d.has_offsets_offset(), d.offsets_offset(), to.offsets, "offsets"},
          Offset{d.has_positions_offset(), d.positions_offset(), to.positions, "positions"},
          Offset{d.has_bitmask_offset(), d.bitmask_offset(), to.bitmask, "bitmask"},
          Offset{d.has_scores_offset(), d.scores_offset(), to.scores, "scores"}}) {
      if (!o.given) continue;
      if (o.value < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("outputs.destination.", o.name, "_offset = ", o.value, " is negative"));
      }
      o.to = o.value;
    }
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
  v1::PolicyToProto(call.policy, proto->mutable_effective_policy());
}

kernels::CudaIpcRegionSpec CudaIpcSpecFromProto(const v1::CudaIpcRegion& proto) {
  kernels::CudaIpcRegionSpec spec;
  spec.handle = proto.handle();
  spec.device_uuid = proto.device_uuid();
  spec.offset = proto.offset();
  spec.byte_size = proto.byte_size();
  return spec;
}

void RegionInfoToProto(const RegionInfo& info, v1::RegionInfo* proto) {
  proto->set_region_id(info.id);
  proto->set_kind(info.kind == RegionKind::kShm ? v1::REGION_KIND_SHM : v1::REGION_KIND_CUDA_IPC);
  proto->set_name(info.name);
  proto->set_device_uuid(info.device_uuid);
  proto->set_offset(info.offset);
  proto->set_byte_size(info.byte_size);
  proto->set_writable(info.writable);
  proto->set_in_flight_requests(info.in_use);
  proto->set_draining(info.draining);
}

void DeviceToProto(const kernels::DeviceDescription& device, v1::DeviceInfo* proto) {
  proto->set_uuid(device.uuid);
  proto->set_name(device.name);
  proto->set_ordinal(device.ordinal);
  proto->set_total_memory_bytes(device.total_memory_bytes);
  proto->set_compute_capability_major(device.compute_capability_major);
  proto->set_compute_capability_minor(device.compute_capability_minor);
  proto->set_active(device.active);
}

}  // namespace laprox::service
