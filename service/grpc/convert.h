// Conversions between laprox.v1 messages and the domain types of service/core and kernels.
// Every error is INVALID_ARGUMENT (or UNIMPLEMENTED for what this server does not offer yet) and
// names the field.
#ifndef LAPROX_SERVICE_GRPC_CONVERT_H_
#define LAPROX_SERVICE_GRPC_CONVERT_H_

#include "absl/status/statusor.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/v1/laprox.pb.h"
#include "service/core/core.h"
#include "service/core/registry.h"

namespace laprox::service {

// The domain views keep pointers into `proto` (inline bytes): it must outlive them.
absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::RegisterModelRequest& proto);
absl::StatusOr<KeepPlanCall> KeepPlanCallFromProto(const v1::ComputeKeepMaskRequest& proto);

// The region to open, its fields copied as they are (RegionRegistry and Backend::ImportCudaIpc
// check them); INVALID_ARGUMENT only when the request names no kind.
absl::StatusOr<RegionSpec> RegionSpecFromProto(const v1::RegisterRegionRequest& proto);

// Never includes the IPC handle.
void RegionInfoToProto(const RegionInfo& info, v1::RegionInfo* proto);

void DeviceToProto(const kernels::DeviceDescription& device, v1::DeviceInfo* proto);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_CONVERT_H_
