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

}  // namespace laprox::kernels::cuda
