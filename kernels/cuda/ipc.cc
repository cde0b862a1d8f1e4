#include "cuda/ipc.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/device_util.h"

namespace laprox::kernels::cuda {
namespace {

// An allocation opened with cudaIpcOpenMemHandle; closing it is the destructor's job.
class IpcRegion final : public ImportedRegion {
 public:
  IpcRegion(int device, void* base, std::byte* data, int64_t byte_size)
      : ImportedRegion(data, byte_size), device_(device), base_(base) {}
  ~IpcRegion() override {
    ScopedDevice current(device_);
    cudaError_t error = current.error();
    if (error == cudaSuccess) error = cudaIpcCloseMemHandle(base_);
    // Nothing can be returned from here; the handle itself is never printed.
    if (error != cudaSuccess) {
      std::fprintf(stderr, "laproxd: closing a cuda_ipc region on device %d failed: %s\n", device_,
                   CudaErrorText(error).c_str());
    }
  }

 private:
  const int device_;
  void* const base_;  // what cudaIpcOpenMemHandle returned
};

}  // namespace

std::vector<DeviceDescription> ListDevices(int active_device) {
  std::vector<DeviceDescription> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no device is not an error worth keeping
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      cudaGetLastError();  // or the next kernel launch check on this thread reports it
      continue;
    }
    DeviceDescription& d = out.emplace_back();
    d.uuid = FormatUuid(prop.uuid);
    d.name = prop.name;
    d.ordinal = i;
    d.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    d.compute_capability_major = prop.major;
    d.compute_capability_minor = prop.minor;
    d.active = i == active_device;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ImportedRegion>> ImportIpcRegion(int device,
                                                                const CudaIpcRegionSpec& spec) {
  LAPROX_ASSIGN_OR_RETURN(const std::string uuid, CanonicalDeviceUuid(spec.device_uuid));
  int owner = -1;
  for (const DeviceDescription& d : ListDevices(device)) {
    if (d.uuid == uuid) owner = d.ordinal;
  }
  if (owner < 0) {
    return absl::NotFoundError(
        absl::StrCat("cuda_ipc.device_uuid = ", uuid, " is not a device this server sees"));
  }
  if (owner != device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.device_uuid = ", uuid, " is CUDA device ", owner,
        "; this server computes on device ", device, " (start it with --device=", owner, ")"));
  }
  LAPROX_ASSIGN_OR_RETURN(PFN_cuMemGetAddressRange_v3020 address_range, AddressRangeQuery());

  ScopedDevice current(device);
  LAPROX_RETURN_IF_ERROR(CudaStatus(current.error(), "cudaSetDevice"));
  cudaIpcMemHandle_t handle;
  static_assert(sizeof(handle.reserved) == CudaIpcRegionSpec::kHandleBytes);
  std::memcpy(handle.reserved, spec.handle.data(), sizeof(handle.reserved));
  void* base = nullptr;
  if (const cudaError_t error = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
      error != cudaSuccess) {
    cudaGetLastError();  // a refused handle is the request's fault, not a sticky device error
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.handle: the CUDA driver refused it: ", CudaErrorText(error)));
  }
  // From here on every failure closes the handle again: the region takes ownership of `base`.
  auto region = std::make_unique<IpcRegion>(
      device, base, static_cast<std::byte*>(base) + spec.offset, spec.byte_size);
  CUdeviceptr allocation = 0;
  size_t allocation_bytes = 0;
  if (const CUresult result =
          address_range(&allocation, &allocation_bytes, reinterpret_cast<CUdeviceptr>(base));
      result != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "cuMemGetAddressRange on an opened cuda_ipc region failed with CUresult ", result));
  }
  // The mapping starts at the exported allocation's base; count from `base` in case the driver
  // reports an enclosing range.
  const int64_t available = static_cast<int64_t>(allocation_bytes) -
                            static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(base) - allocation);
  if (spec.offset + spec.byte_size > available) {  // no overflow: Backend::ImportCudaIpc checked
    return absl::OutOfRangeError(
        absl::StrCat("cuda_ipc.offset + cuda_ipc.byte_size = ", spec.offset, " + ", spec.byte_size,
                     " exceeds the ", available, " bytes of the exported allocation"));
  }
  return region;
}

}  // namespace laprox::kernels::cuda
