// The one seam where CUDA runtime errors become absl::Status (STYLE.md principle 7).
#ifndef LAPROX_KERNELS_CUDA_CUDA_STATUS_H_
#define LAPROX_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace laprox::kernels::cuda {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for allocation failures; UNAVAILABLE when no usable
// device or driver; INTERNAL otherwise. The message is "<context>: <cuda error name>: <text>".
absl::Status CudaStatus(cudaError_t error, absl::string_view context);

// The same for cuBLAS: OK for CUBLAS_STATUS_SUCCESS; RESOURCE_EXHAUSTED for
// CUBLAS_STATUS_ALLOC_FAILED; INTERNAL otherwise (invalid values, unsupported configurations and
// execution failures are broken invariants of our own calls). The message is
// "<context>: <cublas status name>: <text>".
absl::Status CublasStatus(cublasStatus_t status, absl::string_view context);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CUDA_STATUS_H_
