#include "cuda/random_fill.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace laprox::kernels::cuda {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillRandomKernel(void* data, int dtype_code, int64_t count, uint64_t seed,
                                 float scale) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t h = Mix(seed ^ Mix(static_cast<uint64_t>(i)));
    // Four 16-bit uniforms in [0, 1): their sum has mean 2 and variance 1/3.
    float sum = 0.f;
    for (int k = 0; k < 4; ++k) sum += static_cast<float>((h >> (16 * k)) & 0xffff) / 65536.f;
    const float x = (sum - 2.f) * 1.7320508f * scale;
    if (dtype_code == 1) {
      static_cast<__half*>(data)[i] = __float2half_rn(x);
    } else if (dtype_code == 2) {
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(x);
    } else {
      static_cast<float*>(data)[i] = x;
    }
  }
}

}  // namespace

cudaError_t LaunchFillRandom(void* data, int dtype_code, int64_t count, uint64_t seed, float scale,
                             cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (count + threads - 1) / threads;
  FillRandomKernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), threads, 0, stream>>>(
      data, dtype_code, count, seed, scale);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
