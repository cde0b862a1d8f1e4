// ExportCudaBuffer and DeviceAllocation in a build without the CUDA backend: UNIMPLEMENTED.
#include <utility>

#include "laprox/client/cuda_export.h"

namespace laprox::client {
namespace {

absl::Status NotBuilt() {
  return absl::UnimplementedError(
      "this laprox client was built without CUDA (LAPROX_WITH_CUDA off): it cannot export device "
      "memory; rebuild with nvcc available or use shared memory (ShareHostBuffer)");
}

}  // namespace

bool CudaExportBuilt() { return false; }

absl::StatusOr<CudaIpcExport> ExportCudaBuffer(const void*, int64_t) { return NotBuilt(); }

absl::StatusOr<DeviceAllocation> DeviceAllocation::Allocate(size_t) { return NotBuilt(); }

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  return *this;
}

DeviceAllocation::~DeviceAllocation() = default;

absl::Status DeviceAllocation::CopyFromHost(size_t, const void*, size_t) { return NotBuilt(); }

absl::Status DeviceAllocation::CopyToHost(size_t, void*, size_t) const { return NotBuilt(); }

}  // namespace laprox::client
