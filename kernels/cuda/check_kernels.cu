#include <cstdint>

#include "cuda/check_kernels.h"
#include "cuda/load.cuh"

namespace laprox::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a power of two (BlockSum)
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned long long kNone = ~0ull;

// The warp's largest value of `bits` (every lane gets it).
__device__ __forceinline__ unsigned int WarpMax(unsigned int bits) {
  for (int offset = 16; offset > 0; offset /= 2) {
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  }
  return bits;
}

// One warp per row (a, b), lanes along c. A warp's rows are uniform across its lanes, so the
// per-slice maxima are reduced over the warp whenever its slice a changes (rarely: a slice is
// dims[1] consecutive rows) and once at the end.
__global__ void FindNonFiniteKernel(DeviceView v, unsigned long long* first_bad,
                                    unsigned int* max_abs_bits) {
  const int64_t rows = v.shape[0] * v.shape[1], cols = v.shape[2];
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  unsigned long long bad = kNone;
  int64_t slice = -1;
  unsigned int slice_max = 0;
  const auto flush = [&] {
    if (max_abs_bits == nullptr || slice < 0) return;
    const unsigned int m = WarpMax(slice_max);
    if (lane == 0 && m != 0) atomicMax(max_abs_bits + slice, m);
  };
  for (int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t a = row / v.shape[1], b = row % v.shape[1];
    if (a != slice) {
      flush();
      slice = a;
      slice_max = 0;
    }
    for (int64_t c = lane; c < cols; c += 32) {
      const float x = LoadAt(v, a, b, c);
      if (isfinite(x)) {
        slice_max = max(slice_max, __float_as_uint(x) & 0x7fffffffu);
      } else if (bad == kNone) {
        // Visited in increasing key order per thread: the first bad one is this thread's minimum.
        bad = static_cast<unsigned long long>(row * cols + c);
      }
    }
  }
  flush();
  if (bad != kNone) atomicMin(first_bad, bad);
}

// Fixed-shape tree reduction over the block (blockDim.x == kThreads); every thread gets the
// result. The order of additions depends only on kThreads: deterministic.
__device__ double BlockSum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double result = shared[0];
  __syncthreads();  // shared is reused by the next call
  return result;
}

__device__ long long BlockMin(long long value, long long* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] = min(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const long long result = shared[0];
  __syncthreads();
  return result;
}

// One block per row (h, t): threads stride along the row.
__global__ void CheckAttentionRowsKernel(DeviceView v, double tolerance,
                                         unsigned long long* first_bad, double* row_sums) {
  __shared__ double sums[kThreads];
  __shared__ long long mins[kThreads];
  const int64_t heads = v.shape[0], wq = v.shape[1], n = v.shape[2];
  constexpr long long kAbsent = 0x7fffffffffffffffll;
  for (int64_t row = blockIdx.x; row < heads * wq; row += gridDim.x) {
    const int64_t h = row / wq, t = row % wq;
    double sum = 0.0;
    long long non_finite = kAbsent, negative = kAbsent;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) {
      const float x = LoadAt(v, h, t, j);
      if (!isfinite(x)) {
        non_finite = min(non_finite, static_cast<long long>(j));
      } else if (x < 0.f) {
        negative = min(negative, static_cast<long long>(j));
      }
      sum += static_cast<double>(x);
    }
    sum = BlockSum(sum, sums);
    non_finite = BlockMin(non_finite, mins);
    negative = BlockMin(negative, mins);
    if (threadIdx.x == 0) {
      row_sums[row] = sum;
      const auto base = static_cast<unsigned long long>(row) * 3;
      const auto cols = static_cast<unsigned long long>(n);
      unsigned long long key = kNone;
      if (non_finite != kAbsent) {
        key = base * cols + static_cast<unsigned long long>(non_finite);
      } else if (negative != kAbsent) {
        key = (base + 1) * cols + static_cast<unsigned long long>(negative);
      } else if (fabs(sum - 1.0) > tolerance) {
        key = (base + 2) * cols;
      }
      if (key != kNone) atomicMin(first_bad, key);
    }
  }
}

}  // namespace

cudaError_t LaunchFindNonFinite(const KernelTensor& tensor, unsigned long long* first_bad,
                                unsigned int* max_abs_bits, cudaStream_t stream) {
  const int64_t rows = tensor.dims[0] * tensor.dims[1];
  if (rows <= 0 || tensor.dims[2] <= 0) return cudaSuccess;
  FindNonFiniteKernel<<<GridBlocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
      ToDeviceView(tensor), first_bad, max_abs_bits);
  return cudaGetLastError();
}

cudaError_t LaunchCheckAttentionRows(const KernelTensor& attention, double tolerance,
                                     unsigned long long* first_bad, double* row_sums,
                                     cudaStream_t stream) {
  const int64_t rows = attention.dims[0] * attention.dims[1];
  if (rows <= 0 || attention.dims[2] <= 0) return cudaSuccess;
  CheckAttentionRowsKernel<<<GridBlocks(rows, 1), kThreads, 0, stream>>>(
      ToDeviceView(attention), tolerance, first_bad, row_sums);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
