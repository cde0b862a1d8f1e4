// LaunchFillRandom: seeded pseudo-random device data for the CUDA tests and benchmarks (the
// benchmark needs gigabytes of fresh, non-zero inputs; generating them on the host would take
// longer than the measurement).
#ifndef LAPROX_KERNELS_CUDA_RANDOM_FILL_H_
#define LAPROX_KERNELS_CUDA_RANDOM_FILL_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// Writes `count` values, approximately normal with standard deviation `scale` (sum of four
// uniforms from a counter-based hash of (seed, index)), into `data` (device memory) as
// dtype_code 0 = fp32, 1 = fp16, 2 = bf16 (laprox::kernels::DType order). Enqueued on `stream`;
// deterministic for a given seed. Returns the launch error.
cudaError_t LaunchFillRandom(void* data, int dtype_code, int64_t count, uint64_t seed, float scale,
                             cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_RANDOM_FILL_H_
