// Device memory and devices as the Backend interface speaks of them: a CUDA IPC allocation
// another process exported (CudaIpcRegionSpec), the region a backend opened from it
// (ImportedRegion), one GPU as GetServerInfo reports it (DeviceDescription), and the canonical
// spelling of a device UUID. No CUDA header: these are the types the service and the clients
// share with the CUDA backend.
#ifndef LAPROX_KERNELS_DEVICE_H_
#define LAPROX_KERNELS_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels {

// A CUDA allocation another process exported with cudaIpcGetMemHandle, to be opened by a
// backend that reads device memory (docs/design.md §4, laprox.v1 CudaIpcRegion).
struct CudaIpcRegionSpec {
  std::string handle;       // the cudaIpcMemHandle_t bytes, exactly kHandleBytes
  std::string device_uuid;  // "GPU-" + 36-character UUID (lower or upper case), or the bare UUID
  int64_t offset = 0;       // bytes from the allocation's base to the region's first byte, >= 0
  int64_t byte_size = 0;    // > 0; offset + byte_size <= the allocation's size

  static constexpr size_t kHandleBytes = 64;
};

// Device memory a backend opened for the service (a cuda_ipc region). Closed when destroyed;
// the owner destroys it only after every request that reads it has finished.
class ImportedRegion {
 public:
  virtual ~ImportedRegion() = default;
  ImportedRegion(const ImportedRegion&) = delete;
  ImportedRegion& operator=(const ImportedRegion&) = delete;

  // First byte of the region (spec.offset into the allocation) in `space()`.
  std::byte* data() const { return data_; }
  int64_t byte_size() const { return byte_size_; }
  MemorySpace space() const { return MemorySpace::kDevice; }

 protected:
  ImportedRegion(std::byte* data, int64_t byte_size) : data_(data), byte_size_(byte_size) {}

 private:
  std::byte* data_;
  int64_t byte_size_;
};

// One GPU as GetServerInfo reports it.
struct DeviceDescription {
  std::string uuid;  // "GPU-" + 36 lower-case characters, as nvidia-smi -L prints it
  std::string name;  // "NVIDIA H200"
  int32_t ordinal = 0;
  int64_t total_memory_bytes = 0;
  int32_t compute_capability_major = 0;
  int32_t compute_capability_minor = 0;
  bool active = false;  // the device this backend computes on
  // Device memory in use on the active device (every process's: total - free, as the driver
  // reports it when Devices() is called); -1 for the other devices or when unknown.
  int64_t used_memory_bytes = -1;
};

// The UUID in the form DeviceDescription::uuid uses ("GPU-" + 36 lower-case characters) from
// either accepted spelling, or INVALID_ARGUMENT naming the value.
absl::StatusOr<std::string> CanonicalDeviceUuid(absl::string_view uuid);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_DEVICE_H_
