// DeviceContext: the device resources one CUDA request runs on, owned by CudaBackend and passed
// to every stage explicitly (docs/style.md principle 4).
#ifndef LAPROX_KERNELS_CUDA_CONTEXT_H_
#define LAPROX_KERNELS_CUDA_CONTEXT_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"

namespace laprox::kernels::cuda {

// Every stage enqueues its work on `stream` (cuBLAS is bound to it) and does not synchronise
// unless its contract says so. The current device of the calling thread is `device`.
struct DeviceContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  int multiprocessors = 0;  // SM count, for grid sizing
};

// The context of `device`, made current on the calling thread: the device is checked to exist
// and to run a kernel, then a non-blocking stream and a cuBLAS handle bound to it with pedantic
// math (no TF32: plans must match the CPU backend's fp32 arithmetic). UNAVAILABLE when there is
// no such device or no usable driver.
absl::StatusOr<DeviceContext> CreateDeviceContext(int device);

// Releases what CreateDeviceContext made.
void DestroyDeviceContext(const DeviceContext& context);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CONTEXT_H_
