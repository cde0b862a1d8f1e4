// The pooling step of the fused scorer: raw p = pool(c) * r, or pool(c * r), at the
// candidates, one thread per run of kPoolRun outputs of one head (LaunchPoolScore,
// fused_kernels.h).
#include "cuda/fused_kernels.h"

#include <cmath>
#include <cstdint>

namespace laprox::kernels::cuda {
namespace fused {
namespace {

// Outputs per thread.
constexpr int kPoolRun = 32;

// One thread per run of kPoolRun outputs of one head: raw[g*n + i] = pool(c)_i (* r_i), or
// pool(c * r)_i with `product`. AVG adds each window's own terms in fp64 (a sliding sum's
// subtraction would lose values far below a large one that left the window; the CPU backend adds
// only the window's terms too).
__global__ void PoolScoreKernel(const float* __restrict__ c, const float* __restrict__ r,
                                bool product, bool times_r, int pooling, int kernel, int64_t n,
                                int64_t begin, int64_t len, int64_t runs_per_head, int num_kv_heads,
                                float* __restrict__ raw) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= runs_per_head * num_kv_heads) return;
  const int64_t g = idx / runs_per_head;
  const int64_t first = begin + (idx % runs_per_head) * kPoolRun;
  const int64_t last = first + kPoolRun < len ? first + kPoolRun : len;
  const float* x = c + g * n;
  const float* y = r + g * n;
  const auto term = [&](int64_t j) { return product ? x[j] * y[j] : x[j]; };
  const int64_t half = kernel / 2;
  for (int64_t i = first; i < last; ++i) {
    float pooled;
    if (pooling == 2 || pooling == 3) {  // avg; 3: avg, never below the position's own term
      const int64_t lo = i - half > 0 ? i - half : 0;
      const int64_t hi = i + half < len - 1 ? i + half : len - 1;
      double window_sum = 0.0;
      for (int64_t j = lo; j <= hi; ++j) window_sum += term(j);
      pooled = static_cast<float>(window_sum / static_cast<double>(kernel));
      if (pooling == 3) pooled = fmaxf(pooled, term(i));
    } else if (pooling == 1) {
      const int64_t lo = i - half > 0 ? i - half : 0;
      const int64_t hi = i + half < len - 1 ? i + half : len - 1;
      pooled = term(i);
      for (int64_t j = lo; j <= hi; ++j) pooled = fmaxf(pooled, term(j));
    } else {
      pooled = term(i);
    }
    raw[g * n + i] = times_r ? pooled * y[i] : pooled;
  }
}

}  // namespace
}  // namespace fused

cudaError_t LaunchPoolScore(const float* c, const float* r, FusedValueMode mode, bool pool_score,
                            int pooling, int kernel, int64_t n, int64_t begin, int64_t len,
                            int num_kv_heads, float* raw, cudaStream_t stream) {
  if (kernel < 1 || kernel % 2 == 0 || pooling < 0 || pooling > 3) return cudaErrorInvalidValue;
  if (begin >= len) return cudaSuccess;
  const int64_t runs = (len - begin + fused::kPoolRun - 1) / fused::kPoolRun;
  const int64_t threads = runs * num_kv_heads;
  const bool values = mode != FusedValueMode::kNone;  // r exists
  fused::PoolScoreKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      c, r, values && pool_score, values && !pool_score, pooling, kernel, n, begin, len, runs,
      num_kv_heads, raw);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
