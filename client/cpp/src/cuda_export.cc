// The client's only file that includes CUDA headers (built when LAPROX_WITH_CUDA is on;
// cuda_export_stub.cc otherwise). The driver API is reached through the runtime's entry-point
// query, so the client links libcudart only, never libcuda.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "laprox/client/cuda_export.h"
#include "laprox/kernels/cuda/runtime.h"

namespace laprox::client {
namespace {

// The runtime's conversion (laprox/kernels/cuda/runtime.h), after clearing the failed call's error
// from the runtime's per-thread last error: the engine's own launch checks (cudaGetLastError)
// must not see laprox's failure later.
absl::Status CudaError(cudaError_t error, absl::string_view what) {
  cudaGetLastError();
  return kernels::cuda::CudaStatus(error, what);
}

}  // namespace

bool CudaExportBuilt() { return true; }

absl::StatusOr<CudaIpcExport> ExportCudaBuffer(const void* device_ptr, int64_t byte_size) {
  if (device_ptr == nullptr) return absl::InvalidArgumentError("device_ptr is null");
  if (byte_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size = ", byte_size, " must be > 0"));
  }
  cudaPointerAttributes attributes{};
  if (cudaError_t e = cudaPointerGetAttributes(&attributes, device_ptr); e != cudaSuccess) {
    return CudaError(e, "cudaPointerGetAttributes");
  }
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_ptr is not device memory from cudaMalloc (cudaMemoryType ",
                     static_cast<int>(attributes.type), "); only such memory has IPC handles"));
  }
  kernels::cuda::ScopedDevice current(attributes.device);
  if (current.error() != cudaSuccess) return CudaError(current.error(), "cudaSetDevice");

  auto address_range = kernels::cuda::AddressRangeQuery();
  if (!address_range.ok()) {
    cudaGetLastError();
    return address_range.status();
  }
  CUdeviceptr base = 0;
  size_t allocation_bytes = 0;
  if (CUresult r =
          (*address_range)(&base, &allocation_bytes, reinterpret_cast<CUdeviceptr>(device_ptr));
      r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", r));
  }
  const int64_t offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(device_ptr) - base);
  if (byte_size > static_cast<int64_t>(allocation_bytes) - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset + byte_size = ", offset, " + ", byte_size, " runs past the ",
                     allocation_bytes, " bytes of the allocation that holds device_ptr"));
  }
  cudaIpcMemHandle_t handle;
  // The base as a pointer derived from device_ptr (not cast back from the integer).
  void* base_ptr = const_cast<std::byte*>(static_cast<const std::byte*>(device_ptr) - offset);
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, base_ptr); e != cudaSuccess) {
    return CudaError(e, "cudaIpcGetMemHandle");
  }
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, attributes.device); e != cudaSuccess) {
    return CudaError(e, "cudaGetDeviceProperties");
  }
  CudaIpcExport out;
  out.handle.assign(handle.reserved, sizeof(handle.reserved));
  out.device_uuid = kernels::cuda::FormatUuid(prop.uuid);
  out.offset = offset;
  out.byte_size = byte_size;
  return out;
}

absl::StatusOr<DeviceAllocation> DeviceAllocation::Allocate(size_t bytes) {
  DeviceAllocation out;
  if (cudaError_t e = cudaMalloc(&out.data_, bytes); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaMalloc(", bytes, ")"));
  }
  out.size_ = bytes;
  return out;
}

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() {
  if (data_ != nullptr) cudaFree(data_);
}

absl::Status DeviceAllocation::CopyFromHost(size_t offset, const void* src, size_t bytes) {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", bytes, ") are outside the ",
                                              size_, "-byte allocation"));
  }
  if (cudaError_t e =
          cudaMemcpy(static_cast<std::byte*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return CudaError(e, "cudaMemcpy to the device");
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocation::CopyToHost(size_t offset, void* dst, size_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", +", bytes, ") are outside the ",
                                              size_, "-byte allocation"));
  }
  if (cudaError_t e = cudaMemcpy(dst, static_cast<const std::byte*>(data_) + offset, bytes,
                                 cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return CudaError(e, "cudaMemcpy to the host");
  }
  return absl::OkStatus();
}

}  // namespace laprox::client
