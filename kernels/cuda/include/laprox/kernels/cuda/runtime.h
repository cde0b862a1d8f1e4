// The CUDA runtime as everything that talks to it shares it: the one conversion of a runtime
// error into absl::Status (docs/style.md principle 7; cuBLAS statuses are in cuda/cuda_status.h), a
// scoped current device, nvidia-smi's spelling of a device UUID, and the driver's address-range
// query reached through the runtime. The target laprox_cuda_runtime: libcudart only (no cuBLAS,
// no libcuda, no kernels), so the client's device-memory export (laprox::client_cuda) uses it
// without linking the compute library. Built only with the CUDA backend.
#ifndef LAPROX_KERNELS_CUDA_RUNTIME_H_
#define LAPROX_KERNELS_CUDA_RUNTIME_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace laprox::kernels::cuda {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for allocation failures; UNAVAILABLE when no usable
// device or driver; INTERNAL otherwise. The message is "<context>: <cuda error name>: <text>".
absl::Status CudaStatus(cudaError_t error, absl::string_view context);

// "<cuda error name>: <text>" of `error`, for messages that give it another code than
// CudaStatus would (a refused IPC handle is the client's INVALID_ARGUMENT).
std::string CudaErrorText(cudaError_t error);

// nvidia-smi's spelling of a device UUID: "GPU-" and the 16 bytes as 8-4-4-4-12 lower-case hex.
std::string FormatUuid(const cudaUUID_t& uuid);

// Makes `device` current for the scope and restores the caller's device afterwards: the service
// calls in from worker threads, and an engine's threads, that other code may have pointed at
// another device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = cudaSetDevice(device);
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// The driver's cuMemGetAddressRange, looked up through the runtime: laproxd must start (and
// serve the CPU backend) on machines without libcuda, and the client links libcudart only, so
// neither links the driver.
absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeQuery();

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_RUNTIME_H_
