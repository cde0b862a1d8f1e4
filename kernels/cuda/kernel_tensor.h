// The description of a strided input tensor that kernel launchers take. Plain C++ (no CUDA, no
// Abseil), so .cc and .cu files share it; device code reads it as load.cuh's DeviceView.
#ifndef LAPROX_KERNELS_CUDA_KERNEL_TENSOR_H_
#define LAPROX_KERNELS_CUDA_KERNEL_TENSOR_H_

#include <cstdint>

namespace laprox::kernels::cuda {

// A rank-3 strided device tensor. `dtype` is static_cast<int>(laprox::kernels::DType) (0 fp32,
// 1 fp16, 2 bf16); strides are in elements. A tensor of lower rank is padded with dimensions of
// 1 and stride 0 ([a, b] is [a, b, 1] with strides [s0, s1, 0]).
struct KernelTensor {
  const void* data = nullptr;
  int dtype = 0;
  int64_t dims[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_KERNEL_TENSOR_H_
