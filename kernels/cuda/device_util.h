// Small helpers of the CUDA backend's host code (the input check, model preparation, the IPC
// import): a TensorView as the launchers take it and one device element read back, beside the
// runtime helpers it shares with the client (laprox/kernels/cuda/runtime.h, included here).
#ifndef LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_
#define LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cuda/kernel_tensor.h"
#include "laprox/kernels/cuda/runtime.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::cuda {

// `view` as kernel launchers take it (kernel_tensor.h): rank padded to 3.
KernelTensor ToKernelTensor(const TensorView& view);

// Element `offset` (in elements) of device memory holding `dtype` values, read back to the host
// as fp32 (for error messages); `what` names the read in a CUDA error.
absl::StatusOr<float> ReadDeviceElement(const void* data, DType dtype, int64_t offset,
                                        absl::string_view what);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_DEVICE_UTIL_H_
