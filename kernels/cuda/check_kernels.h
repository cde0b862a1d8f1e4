// Kernels of InputChecker (check.cc): finding the first NaN / Inf of a strided tensor and the
// first bad window attention row, each as the minimum of an integer key (atomicMin), so the
// result does not depend on the schedule.
//
// Launchers enqueue on `stream`, never synchronise, and return the launch error
// (cudaGetLastError); cudaSuccess without launching when the tensor is empty. All pointers are
// device memory. The caller initialises every *first_bad, e.g. to all ones (nothing found).
#ifndef LAPROX_KERNELS_CUDA_CHECK_KERNELS_H_
#define LAPROX_KERNELS_CUDA_CHECK_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/kernel_tensor.h"

namespace laprox::kernels::cuda {

// *first_bad = min(*first_bad, (a * dims[1] + b) * dims[2] + c) over the elements (a, b, c) that
// are NaN or infinite: the lowest bad element in row-major order of the logical shape. With
// max_abs_bits set (dims[0] entries, initialised by the caller, e.g. to 0), also
// max_abs_bits[a] = max(max_abs_bits[a], bits of |x|) over the finite elements of each a: for
// non-negative floats the bit patterns order like the values, so after the launch
// max_abs_bits[a] holds the largest finite |x| of slice a (an integer atomicMax: exact).
cudaError_t LaunchFindNonFinite(const KernelTensor& tensor, unsigned long long* first_bad,
                                unsigned int* max_abs_bits, cudaStream_t stream);

// Window attention rows [H, wq, n] = dims. For every row (h, t) (all wq of them):
// row_sums[h * wq + t] = the fp64 sum of the row (fixed reduction order), and
// *first_bad = min(*first_bad, key) with key = ((h * wq + t) * 3 + kind) * n + j for
//   kind 0: the row's lowest j whose element is NaN or infinite;
//   kind 1: else the row's lowest j whose element is negative (< 0);
//   kind 2 (j = 0): else when |sum - 1| > tolerance.
// So the minimum names the first bad row and, within it, what the CPU backend reports first.
// Precondition: H * wq * 3 * n < 2^64 - 1.
cudaError_t LaunchCheckAttentionRows(const KernelTensor& attention, double tolerance,
                                     unsigned long long* first_bad, double* row_sums,
                                     cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CHECK_KERNELS_H_
