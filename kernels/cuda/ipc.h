// CUDA IPC import and device discovery for the CUDA backend.
#ifndef LAPROX_KERNELS_CUDA_IPC_H_
#define LAPROX_KERNELS_CUDA_IPC_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

// Every visible device, `active` marking `active_device`. Empty when CUDA reports none.
std::vector<DeviceDescription> ListDevices(int active_device);

// Opens `spec` (already checked by Backend::ImportCudaIpc: handle size, UUID syntax, offset,
// byte_size) on `device` with cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess), checks
// offset + byte_size against the allocation with the driver's address-range query, and returns
// the region; destroying it closes the handle. NOT_FOUND: no visible device has the UUID;
// INVALID_ARGUMENT: the UUID is another device than `device`, or the driver refuses the handle
// (naming the driver's error); OUT_OF_RANGE: past the allocation's end (naming both numbers).
absl::StatusOr<std::unique_ptr<ImportedRegion>> ImportIpcRegion(int device,
                                                                const CudaIpcRegionSpec& spec);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_IPC_H_
