// PrepareFactors: a model's value factors computed on the device at registration (cuBLAS).
#ifndef LAPROX_KERNELS_CUDA_PREPARE_H_
#define LAPROX_KERNELS_CUDA_PREPARE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cuda/context.h"
#include "cuda/prepared_model.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

// Computes every factor matrix (prepared_model.h) from each layer's o_proj.weight [D, H*d]
// (fp32, fp16 or bf16, any element strides, device memory: the backend stages host views first)
// in fp32 with fp32 accumulation (CUBLAS_COMPUTE_32F, no TF32). Synchronises the stream before
// it returns. INVALID_ARGUMENT "layers[l].o_proj has a non-finite value (x) at [0, r, c]" (the
// CPU backend's words) for the lowest layer, then lowest element, that is NaN or Inf;
// RESOURCE_EXHAUSTED when the device is full; INTERNAL for other CUDA / cuBLAS errors.
// Preconditions: geometry valid, o_proj.size() == L, each [D, H*d] in MemorySpace::kDevice.
absl::StatusOr<std::shared_ptr<CudaPreparedModel>> PrepareFactors(
    const DeviceContext& context, const ModelGeometry& geometry,
    absl::Span<const TensorView> o_proj, const PrepareOptions& options);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_PREPARE_H_
