// Small CUDA runtime helpers shared by the backend's IPC import (ipc.cc) and the client's export
// (client/cpp/src/cuda_export.cc), the input check and model preparation: the device UUID's
// spelling, a scoped current device, the driver's address-range query reached through the
// runtime, a TensorView as the launchers take it, and one device element read back.
#ifndef LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_
#define LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cuda/kernel_tensor.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::cuda {

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

// `view` as kernel launchers take it (kernel_tensor.h): rank padded to 3.
KernelTensor ToKernelTensor(const TensorView& view);

// Element `offset` (in elements) of device memory holding `dtype` values, read back to the host
// as fp32 (for error messages); `what` names the read in a CUDA error.
absl::StatusOr<float> ReadDeviceElement(const void* data, DType dtype, int64_t offset,
                                        absl::string_view what);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_
