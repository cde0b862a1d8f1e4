// Device helpers shared by the CUDA kernels: reading an element of any input dtype as fp32,
// the launchers' view of a KernelTensor, grid sizes. Included only from .cu files.
#ifndef LAPROX_KERNELS_CUDA_LOAD_CUH_
#define LAPROX_KERNELS_CUDA_LOAD_CUH_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernel_tensor.h"

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

inline DeviceView ToDeviceView(const KernelTensor& t) {
  DeviceView v;
  v.data = t.data;
  v.dtype = static_cast<DeviceDType>(t.dtype);
  for (int i = 0; i < 3; ++i) {
    v.shape[i] = t.dims[i];
    v.strides[i] = t.strides[i];
  }
  return v;
}

// Blocks for a grid-stride loop over `items`, `items_per_block` per block, capped at enough
// blocks to fill any current GPU several times over.
inline int GridBlocks(int64_t items, int64_t items_per_block) {
  constexpr int64_t kMaxBlocks = 8192;
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

__device__ __forceinline__ float LoadAt(const DeviceView& v, int64_t a, int64_t b, int64_t c) {
  return LoadAsFloat(v.data, v.dtype, a * v.strides[0] + b * v.strides[1] + c * v.strides[2]);
}

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_LOAD_CUH_
