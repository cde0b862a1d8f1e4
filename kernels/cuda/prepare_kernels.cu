#include <cstdint>

#include "cuda/load.cuh"
#include "cuda/prepare_kernels.h"

namespace laprox::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned long long kNone = ~0ull;

// One warp per row, lanes along the row (coalesced when col_stride == 1).
__global__ void ConvertProjectionKernel(DeviceView w, int64_t rows, int64_t cols, float* dense,
                                        unsigned long long* first_bad, unsigned int* max_abs_bits) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  unsigned long long bad = kNone;
  unsigned int max_bits = 0;  // bits of the largest finite |v| (they order like the values)
  for (int64_t r = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; r < rows; r += warps) {
    for (int64_t c = lane; c < cols; c += 32) {
      const float v = LoadAt(w, 0, r, c);
      dense[r * cols + c] = v;
      if (isfinite(v)) {
        max_bits = max(max_bits, __float_as_uint(v) & 0x7fffffffu);
      } else if (bad == kNone) {
        bad = static_cast<unsigned long long>(r * cols + c);
      }
    }
  }
  // Each thread visits its elements in increasing order, so its first bad one is its minimum.
  if (bad != kNone) atomicMin(first_bad, bad);
  for (int offset = 16; offset > 0; offset /= 2) {
    max_bits = max(max_bits, __shfl_xor_sync(0xffffffffu, max_bits, offset));
  }
  if (lane == 0 && max_bits != 0) atomicMax(max_abs_bits, max_bits);
}

__global__ void GroupSumKernel(const float* dense, int64_t rows, int64_t kv_heads, int64_t group,
                               int64_t head_dim, float* summed) {
  const int64_t cols = kv_heads * group * head_dim;
  const int64_t total = kv_heads * rows * head_dim;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t k = e % head_dim;
    const int64_t r = (e / head_dim) % rows;
    const int64_t g = e / (head_dim * rows);
    const float* src = dense + r * cols + g * group * head_dim + k;
    float sum = 0.f;
    for (int64_t a = 0; a < group; ++a) sum += src[a * head_dim];
    summed[e] = sum;
  }
}

}  // namespace

cudaError_t LaunchConvertProjection(const void* w, int dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t col_stride, float* dense,
                                    unsigned long long* first_bad, unsigned int* max_abs_bits,
                                    cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  DeviceView view;
  view.data = w;
  view.dtype = static_cast<DeviceDType>(dtype);
  view.shape[0] = 1;
  view.shape[1] = rows;
  view.shape[2] = cols;
  view.strides[0] = 0;
  view.strides[1] = row_stride;
  view.strides[2] = col_stride;
  ConvertProjectionKernel<<<GridBlocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
      view, rows, cols, dense, first_bad, max_abs_bits);
  return cudaGetLastError();
}

cudaError_t LaunchGroupSum(const float* dense, int64_t rows, int64_t kv_heads, int64_t group,
                           int64_t head_dim, float* summed, cudaStream_t stream) {
  const int64_t total = kv_heads * rows * head_dim;
  if (total <= 0) return cudaSuccess;
  GroupSumKernel<<<GridBlocks(total, kThreads), kThreads, 0, stream>>>(dense, rows, kv_heads, group,
                                                                       head_dim, summed);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
