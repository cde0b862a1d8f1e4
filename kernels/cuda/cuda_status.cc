#include "cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace laprox::kernels::cuda {

absl::Status CudaStatus(cudaError_t error, absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(context, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(cublasStatus_t status, absl::string_view context) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat(context, ": ", cublasGetStatusName(status), ": ", cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace laprox::kernels::cuda
