#include "cuda/device_query.h"

namespace laprox::kernels::cuda {
namespace {

__global__ void ProbeKernel(int* flag) { *flag = 1; }

}  // namespace

cudaError_t CountDevices(int* count) {
  *count = 0;
  return cudaGetDeviceCount(count);
}

cudaError_t ProbeDevice(int device) {
  cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return error;
  int* flag = nullptr;
  error = cudaMalloc(&flag, sizeof(int));
  if (error != cudaSuccess) return error;
  ProbeKernel<<<1, 1>>>(flag);
  error = cudaGetLastError();
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  const cudaError_t freed = cudaFree(flag);
  return error != cudaSuccess ? error : freed;
}

}  // namespace laprox::kernels::cuda
