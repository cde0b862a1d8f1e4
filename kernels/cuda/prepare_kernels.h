// Kernels of PrepareFactors (prepare.cc): converting a layer's o_proj.weight to dense fp32 while
// finding its first non-finite element, and the per-KV-group sums of the head blocks. The factor
// matrices themselves are cuBLAS GEMMs issued by prepare.cc.
//
// Launchers enqueue on `stream`, never synchronise, and return the launch error
// (cudaGetLastError); cudaSuccess without launching when there is nothing to do. All pointers are
// device memory. Results are deterministic (no float atomics).
#ifndef LAPROX_KERNELS_CUDA_PREPARE_KERNELS_H_
#define LAPROX_KERNELS_CUDA_PREPARE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// dense[r * cols + c] = fp32(w[r * row_stride + c * col_stride]) for r < rows, c < cols, where
// `w` holds elements of `dtype` (static_cast<int>(laprox::kernels::DType): 0 fp32, 1 fp16,
// 2 bf16) and strides are in elements. *first_bad = min(*first_bad, r * cols + c) over the
// elements that are NaN or infinite (an integer atomicMin: the result does not depend on the
// schedule); the caller initialises *first_bad, e.g. to all ones (no bad element). Also
// *max_abs_bits = max(*max_abs_bits, bits of |x|) over the finite elements (integer atomicMax;
// the bits of non-negative floats order like the values): the largest finite |x| once the
// caller has initialised it to 0.
cudaError_t LaunchConvertProjection(const void* w, int dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t col_stride, float* dense,
                                    unsigned long long* first_bad, unsigned int* max_abs_bits,
                                    cudaStream_t stream);

// summed[(g * rows + r) * head_dim + k] = sum_{a < group} dense[r * cols + (g * group + a) *
// head_dim + k] for g < kv_heads, r < rows, k < head_dim, with cols = kv_heads * group *
// head_dim, added in increasing a from 0.f (the CPU backend's order, so the sums are identical).
cudaError_t LaunchGroupSum(const float* dense, int64_t rows, int64_t kv_heads, int64_t group,
                           int64_t head_dim, float* summed, cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_PREPARE_KERNELS_H_
