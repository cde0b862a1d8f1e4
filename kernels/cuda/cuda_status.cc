#include "cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace laprox::kernels::cuda {

absl::Status CublasStatus(cublasStatus_t status, absl::string_view context) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat(context, ": ", cublasGetStatusName(status), ": ", cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace laprox::kernels::cuda
