// The factor split of the fused scorer: each fp32 factor block M becomes U = triu(M) with
// doubled off-diagonal, scaled by a power of two and split into kFactorTerms 16-bit terms, the
// V.U input of pass 2 (LaunchSplitFactors; precision in fused_kernels.h).
#include "cuda/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/fused_block.cuh"
#include "cuda/fused_warp.cuh"
#include "cuda/load.cuh"

namespace laprox::kernels::cuda {
namespace fused {
namespace {

// One CTA per (g, block f): U = triu(M) (off-diagonal doubled) scaled by a power of two to
// max |U| in [1, 2) (bf16) or [2^14, 2^15) (fp16), split into kFactorTerms 16-bit terms.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    SplitFactorsKernel(const float* __restrict__ factors, int64_t matrix_size, int64_t row_stride,
                       int first_block, int blocks, int d, T* __restrict__ out,
                       float* __restrict__ inv_scale) {
  const int g = blockIdx.x / blocks, f = blockIdx.x % blocks;
  const float* m = factors + g * matrix_size + static_cast<int64_t>(first_block + f) * d;
  const int64_t elements = int64_t{d} * d;
  float local = 0.f;
  for (int64_t i = threadIdx.x; i < elements; i += blockDim.x) {
    const int64_t row = i / d, col = i % d;
    if (row <= col) {
      const float v = m[row * row_stride + col];
      local = fmaxf(local, fabsf(row == col ? v : 2.f * v));
    }
  }
  __shared__ float maxima[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, o));
  if (threadIdx.x % 32 == 0) maxima[threadIdx.x / 32] = local;
  __syncthreads();
  float biggest = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) biggest = fmaxf(biggest, maxima[w]);
  // fp16 has 5 exponent bits: scaled to [1, 2), the second and third terms of every element
  // below ~2^-3 fall into fp16 subnormals (absolute step 2^-24, or flushed by the MMA), which
  // caps the split at ~2^-25 absolute instead of ~2^-33 relative. Scaling max |U| to
  // [2^14, 2^15) instead (< 65504; products stay well inside fp32) keeps the significant bits of
  // all three terms normal. bf16 has fp32's exponent range: [1, 2) is fine.
  constexpr int kTop = std::is_same<T, __half>::value ? 14 : 0;
  int exponent = 0;
  // biggest in [2^e, 2^(e+1)); scaled by 2^(kTop - e); e clamped so that the scale stays a
  // finite normal float.
  if (biggest > 0.f && isfinite(biggest)) exponent = max(ilogbf(biggest), -126 + kTop) - kTop;
  const float scale = ldexpf(1.f, -exponent);
  if (threadIdx.x == 0) inv_scale[blockIdx.x] = ldexpf(1.f, exponent);
  T* dst = out + static_cast<int64_t>(blockIdx.x) * kFactorTerms * elements;
  for (int64_t i = threadIdx.x; i < elements; i += blockDim.x) {
    const int64_t row = i / d, col = i % d;
    float u = 0.f;
    if (row <= col) {
      const float v = m[row * row_stride + col];
      u = (row == col ? v : 2.f * v) * scale;  // exact: powers of two
    }
    for (int term = 0; term < kFactorTerms; ++term) {
      const T part = FromFloat<T>(u);
      dst[term * elements + i] = part;
      u -= ToFloat<T>(part);  // exact in fp32
    }
  }
}

}  // namespace
}  // namespace fused

cudaError_t LaunchSplitFactors(const float* factors, int64_t matrix_size, int64_t row_stride,
                               int first_block, int blocks, int head_dim, int num_kv_heads,
                               int dtype, void* out, float* inv_scale, cudaStream_t stream) {
  if (blocks < 1 || num_kv_heads < 1 || head_dim < 1) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(num_kv_heads) * static_cast<unsigned>(blocks);
  if (dtype == static_cast<int>(DeviceDType::kBF16)) {
    fused::SplitFactorsKernel<__nv_bfloat16><<<grid, fused::kThreads, 0, stream>>>(
        factors, matrix_size, row_stride, first_block, blocks, head_dim,
        static_cast<__nv_bfloat16*>(out), inv_scale);
  } else if (dtype == static_cast<int>(DeviceDType::kF16)) {
    fused::SplitFactorsKernel<__half><<<grid, fused::kThreads, 0, stream>>>(
        factors, matrix_size, row_stride, first_block, blocks, head_dim, static_cast<__half*>(out),
        inv_scale);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
