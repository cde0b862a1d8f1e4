// Sharing device memory with laproxd through CUDA IPC (laprox.v1 CudaIpcRegion).
//
// ExportCudaBuffer describes a tensor's device memory the way laproxd opens it: the IPC handle of
// the whole allocation that holds it (cudaIpcGetMemHandle on the allocation's base, as the
// driver's address-range query finds it — caching allocators hand out blocks inside larger
// allocations), the tensor's byte offset from that base, and the owning device's UUID. Register
// the result with Client::RegisterCudaIpcRegion; the server then reads the tensor in place.
//
//   auto region = laprox::client::ExportCudaBuffer(d_keys, bytes);       // d_keys: cudaMalloc'd
//   uint64_t id = *client->RegisterCudaIpcRegion(*region);
//   TensorRef keys = TensorRef::InRegion(id, 0, DType::kBF16, {Hkv, n, d});
//
// The exporting process must keep the allocation alive until the region is unregistered, and
// must be another process than laproxd (CUDA IPC does not open handles of one's own process).
// The functions are in laprox::client_cuda (link it beside laprox::client; CudaIpcExport alone
// is plain data that laprox::client takes). They exist in every build; without the CUDA backend
// (LAPROX_WITH_CUDA off) they return UNIMPLEMENTED, so the library builds and links without
// nvcc. This header includes no CUDA header (src/cuda_export.cc is the client's only
// CUDA-including file, and laprox::client itself links no CUDA library).
#ifndef LAPROX_CLIENT_CUDA_EXPORT_H_
#define LAPROX_CLIENT_CUDA_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace laprox::client {

// The fields of a laprox.v1 CudaIpcRegion.
struct CudaIpcExport {
  std::string handle;       // the cudaIpcMemHandle_t of the base allocation, 64 bytes
  std::string device_uuid;  // "GPU-" + 36 lower-case characters, as nvidia-smi -L prints it
  int64_t offset = 0;       // bytes from the allocation's base to device_ptr
  int64_t byte_size = 0;    // the bytes the region covers
};

// Whether this build can export device memory (the CUDA backend was built).
bool CudaExportBuilt();

// Describes [device_ptr, device_ptr + byte_size) of device memory (cudaMalloc'd, also inside a
// larger allocation). Blocks only on the driver queries. INVALID_ARGUMENT: null pointer,
// byte_size <= 0, host or managed memory, or the range runs past the allocation's end (naming
// both numbers); UNIMPLEMENTED: built without CUDA; INTERNAL / UNAVAILABLE: CUDA errors (the
// call's name and the CUDA error). Thread-safe.
absl::StatusOr<CudaIpcExport> ExportCudaBuffer(const void* device_ptr, int64_t byte_size);

// Device memory of the current CUDA device, for demos and tests: freed when destroyed.
// Move-only. UNIMPLEMENTED without CUDA; RESOURCE_EXHAUSTED when the device is full;
// UNAVAILABLE when there is no device.
class DeviceAllocation {
 public:
  static absl::StatusOr<DeviceAllocation> Allocate(size_t bytes);
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  // Frees the memory (cudaFree) in CUDA builds; the stub of builds without CUDA has nothing to
  // free.
  ~DeviceAllocation();  // NOLINT(performance-trivially-destructible)

  void* data() const { return data_; }  // device memory: do not dereference on the host
  size_t size() const { return size_; }
  // Copies `bytes` host bytes to data() + offset and waits. OUT_OF_RANGE past size().
  absl::Status CopyFromHost(size_t offset, const void* src, size_t bytes);
  // Copies `bytes` from data() + offset to host memory and waits. OUT_OF_RANGE past size().
  absl::Status CopyToHost(size_t offset, void* dst, size_t bytes) const;

 private:
  DeviceAllocation() = default;
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace laprox::client

#endif  // LAPROX_CLIENT_CUDA_EXPORT_H_
