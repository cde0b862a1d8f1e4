#include "cuda/context.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/device_query.h"

namespace laprox::kernels::cuda {

absl::StatusOr<DeviceContext> CreateDeviceContext(int device) {
  int count = 0;
  LAPROX_RETURN_IF_ERROR(CudaStatus(CountDevices(&count), "cudaGetDeviceCount"));
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " devices)"));
  }
  LAPROX_RETURN_IF_ERROR(CudaStatus(ProbeDevice(device), "probing the CUDA device"));
  DeviceContext context;
  context.device = device;
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&context.multiprocessors, cudaDevAttrMultiProcessorCount, device),
      "cudaDeviceGetAttribute"));
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&context.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  if (cublasCreate(&context.cublas) != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(context.stream);
    return absl::InternalError("cublasCreate failed");
  }
  if (cublasSetStream(context.cublas, context.stream) != CUBLAS_STATUS_SUCCESS ||
      cublasSetMathMode(context.cublas, CUBLAS_PEDANTIC_MATH) != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(context.cublas);
    cudaStreamDestroy(context.stream);
    return absl::InternalError("configuring the cuBLAS handle failed");
  }
  return context;
}

void DestroyDeviceContext(const DeviceContext& context) {
  cudaSetDevice(context.device);
  cublasDestroy(context.cublas);
  cudaStreamDestroy(context.stream);
}

}  // namespace laprox::kernels::cuda
