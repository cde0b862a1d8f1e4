#include "service/grpc/convert.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "laprox/kernels/layer_tensors.h"
#include "laprox/v1/plan_wire.h"
#include "laprox/v1/policy_wire.h"

namespace laprox::service {
namespace {

constexpr v1::LayerTensorGetters kGetters;

absl::StatusOr<TensorRef> TensorFromProto(const v1::TensorRef& proto, const std::string& field,
                                          bool optional, bool pageable = false) {
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
  if (proto.has_paged()) {
    if (!pageable) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".paged is set; only keys and values may be paged"));
    }
    if (ref.source != TensorRef::Source::kRegion) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".paged needs the pool in a region (source region)"));
    }
    if (!ref.strides.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".strides must be empty for a paged tensor (its layout gives the strides)"));
    }
    const v1::PagedLayout& paged = proto.paged();
    ref.paged = {.block_table = paged.block_table(),
                 .block_stride = paged.block_stride(),
                 .slot_stride = paged.slot_stride(),
                 .head_stride = paged.head_stride(),
                 .dim_stride = paged.dim_stride()};
  }
  return ref;
}

}  // namespace

absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::RegisterModelRequest& proto) {
  ModelSpec spec;
  spec.name = proto.name();
  spec.geometry = v1::GeometryFromProto(proto.geometry());
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
  if (absl::Status s = v1::OutputsFromProto(proto.outputs(), &call.outputs, &call.destination);
      !s.ok()) {
    return s;
  }
  for (int l = 0; l < proto.layers_size(); ++l) {
    const v1::LayerInputs& in = proto.layers(l);
    const std::string prefix = absl::StrCat("layers[", l, "].");
    LayerRefs& refs = call.layers.emplace_back();
    absl::Status converted = kernels::ForEachLayerTensor(
        [&](kernels::LayerTensor tensor, TensorRef& ref, auto getter) {
          auto from = TensorFromProto((in.*getter)(), prefix + tensor.name, !tensor.required,
                                      tensor.pageable);
          if (!from.ok()) return from.status();
          ref = *std::move(from);
          return absl::OkStatus();
        },
        refs, kGetters);
    if (!converted.ok()) return converted;
  }
  for (int t = 0; t < proto.block_tables_size(); ++t) {
    const v1::BlockTable& table = proto.block_tables(t);
    BlockTableSpec& spec = call.block_tables.emplace_back();
    spec.ids = table.block_ids();
    spec.block_size = table.block_size();
    spec.allow_repeated_ids = table.allow_repeated_ids();
    if (!table.has_ids_region()) {
      if (table.ids_count() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block_tables[", t, "].ids_count = ", table.ids_count(), " without ids_region"));
      }
      continue;
    }
    if (table.block_ids_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("block_tables[", t, "] has both block_ids (",
                                                     table.block_ids_size(),
                                                     " ids) and ids_region; give the ids one way"));
    }
    if (table.ids_region().byte_offset() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block_tables[", t, "].ids_region.byte_offset = ", table.ids_region().byte_offset(),
          " is negative"));
    }
    spec.in_region = {.region_id = table.ids_region().region_id(),
                      .byte_offset = table.ids_region().byte_offset(),
                      .count = table.ids_count()};
  }
  if (proto.has_cache()) {
    std::vector<CacheLayer>& cache = call.cache.emplace();
    for (const v1::DecodeCacheLayer& layer : proto.cache().layers()) {
      cache.push_back({.entries = layer.entries(), .positions = layer.positions()});
    }
  }
  return call;
}

absl::StatusOr<RegionSpec> RegionSpecFromProto(const v1::RegisterRegionRequest& proto) {
  switch (proto.kind_case()) {
    case v1::RegisterRegionRequest::kShm:
      return ShmRegionSpec{.name = proto.shm().name(),
                           .offset = proto.shm().offset(),
                           .byte_size = proto.shm().byte_size(),
                           .writable = proto.writable()};
    case v1::RegisterRegionRequest::kCudaIpc: {
      const v1::CudaIpcRegion& ipc = proto.cuda_ipc();
      CudaIpcRegistration registration;
      registration.writable = proto.writable();
      registration.spec.handle = ipc.handle();
      registration.spec.device_uuid = ipc.device_uuid();
      registration.spec.offset = ipc.offset();
      registration.spec.byte_size = ipc.byte_size();
      return registration;
    }
    case v1::RegisterRegionRequest::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("region kind is missing: give shm or cuda_ipc");
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
  proto->set_shrunk(info.shrunk);
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
