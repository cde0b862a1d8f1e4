// The seam where CUDA errors become absl::Status (docs/style.md principle 7): the runtime's
// CudaStatus (laprox/kernels/cuda/runtime.h, shared with the client) and cuBLAS's here.
#ifndef LAPROX_KERNELS_CUDA_CUDA_STATUS_H_
#define LAPROX_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "laprox/kernels/cuda/runtime.h"

namespace laprox::kernels::cuda {

// cuBLAS: OK for CUBLAS_STATUS_SUCCESS; RESOURCE_EXHAUSTED for
// CUBLAS_STATUS_ALLOC_FAILED; INTERNAL otherwise (invalid values, unsupported configurations and
// execution failures are broken invariants of our own calls). The message is
// "<context>: <cublas status name>: <text>".
absl::Status CublasStatus(cublasStatus_t status, absl::string_view context);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CUDA_STATUS_H_
