// Device helpers shared by the CUDA kernels: reading an element of any input dtype as fp32.
// Included only from .cu files.
#ifndef LAPROX_KERNELS_CUDA_LOAD_CUH_
#define LAPROX_KERNELS_CUDA_LOAD_CUH_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace laprox::kernels::cuda {

// Element types as the launchers receive them (the values of laprox::kernels::DType).
enum class DeviceDType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Element `offset` (in elements) of `data` as fp32. 16-bit values convert exactly.
__device__ __forceinline__ float LoadAsFloat(const void* data, DeviceDType dtype, int64_t offset) {
  switch (dtype) {
    case DeviceDType::kF16:
      return __half2float(static_cast<const __half*>(data)[offset]);
    case DeviceDType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[offset]);
    case DeviceDType::kF32:
    default:
      return static_cast<const float*>(data)[offset];
  }
}

// A strided view of up to 3 dimensions as the kernels receive it (element strides).
struct DeviceView {
  const void* data = nullptr;
  DeviceDType dtype = DeviceDType::kF32;
  int64_t shape[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
};

__device__ __forceinline__ float LoadAt(const DeviceView& v, int64_t a, int64_t b, int64_t c) {
  return LoadAsFloat(v.data, v.dtype, a * v.strides[0] + b * v.strides[1] + c * v.strides[2]);
}

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_LOAD_CUH_
