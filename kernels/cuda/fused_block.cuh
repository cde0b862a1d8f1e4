// Block-level pieces of the fused scorer's two passes: the CTA shape (kThreads threads, 16
// tokens per warp, kTile tokens per tile), the cp.async loads of key / value tiles, factor terms
// and window queries into shared memory, the per-warp key fragments and the Q.K^T logits of one
// row tile; and, on the host, the launch with dynamic shared memory and the argument check both
// passes share. Layouts in fused_kernels.h. Included only from the fused_*.cu files.
#ifndef LAPROX_KERNELS_CUDA_FUSED_BLOCK_CUH_
#define LAPROX_KERNELS_CUDA_FUSED_BLOCK_CUH_

#include <cstdint>

#include "cuda/fused_kernels.h"
#include "cuda/fused_warp.cuh"

namespace laprox::kernels::cuda::fused {

constexpr int kTile = kFusedTileTokens;
constexpr int kThreads = kFusedThreads;
constexpr int kWarps = kThreads / 32;
static_assert(kTile == 16 * kWarps, "each warp owns 16 tokens of a tile");

// Rows [tok0, tok0 + kTile) of head `head` of a [Hkv, n, d] tensor into smem [kTile][kD+8]; rows
// at or past `limit` are zero-filled (the source pointer is then the tensor base, not read).
template <typename T, int kD>
__device__ __forceinline__ void IssueTile(T* smem, const T* base, int64_t head_offset,
                                          int64_t token_stride, int64_t tok0, int64_t limit) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < kTile * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const int64_t token = tok0 + row;
    const bool inside = token < limit;
    const T* src = inside ? base + head_offset + token * token_stride + chunk * 8 : base;
    CpAsync16(smem + row * (kD + 8) + chunk * 8, src, inside ? 16 : 0);
  }
}

// One factor term [kD][kD] (global, contiguous) into smem [kD][kD+8]; the 16x16 blocks below the
// diagonal are zero and never read by the MMA loop, so they are not copied.
template <typename T, int kD>
__device__ __forceinline__ void IssueFactorTerm(T* smem, const T* term) {
  constexpr int kChunks = kD / 8;
  for (int idx = threadIdx.x; idx < kD * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    if (row / 16 > chunk / 2) continue;  // block (row / 16, column block chunk / 2) below diagonal
    CpAsync16(smem + row * (kD + 8) + chunk * 8, term + row * kD + chunk * 8, 16);
  }
}

// Queries of KV group g into smem [Rp][kD+8] in the padded t-major row layout (zeros on padding).
template <typename T, int kD>
__device__ void LoadQueries(T* qs, const FusedLayerArgs& a, int g, int gp, int rp) {
  const T* q = static_cast<const T*>(a.queries);
  for (int idx = threadIdx.x; idx < rp * kD; idx += kThreads) {
    const int r = idx / kD, col = idx % kD;
    const int t = r / gp, h = r % gp;
    T value = FromFloat<T>(0.f);
    if (t < a.window && h < a.group) {
      const int64_t head = int64_t{g} * a.group + h;
      const int64_t row = int64_t{a.window_rows} - a.window + t;
      value = q[head * a.query_head_stride + row * a.query_row_stride + col * a.query_col_stride];
    }
    qs[r * (kD + 8) + col] = value;
  }
}

// Per-warp K fragments of tokens [16w, 16w+16) for all k-steps: kb[ks][0..1] n-tile 0 (tokens
// 0-7), kb[ks][2..3] n-tile 1 (tokens 8-15).
template <int kD, typename T>
__device__ __forceinline__ void LoadKeyFragments(uint32_t (&kb)[kD / 16][4], const T* ks_smem,
                                                 int warp, int lane) {
  const int token = warp * 16 + (lane >> 4) * 8 + (lane & 7);
  const int col = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) Ldsm4(kb[ks], ks_smem + token * (kD + 8) + ks * 16 + col);
}

// Logits (unscaled q.k) of row tile rt against the warp's 16 tokens: acc[nt][0..1] row gid,
// acc[nt][2..3] row gid + 8, columns nt * 8 + 2 * (lane % 4) + {0, 1}.
template <typename T, int kD>
__device__ __forceinline__ void RowTileLogits(float (&acc)[2][4], const T* qs, int rt, int lane,
                                              const uint32_t (&kb)[kD / 16][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  }
  const T* row = qs + (rt * 16 + (lane & 15)) * (kD + 8) + (lane >> 4) * 8;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    uint32_t qa[4];
    Ldsm4(qa, row + ks * 16);
    Mma<T>(acc[0], qa, kb[ks][0], kb[ks][1]);
    Mma<T>(acc[1], qa, kb[ks][2], kb[ks][3]);
  }
}

// Shared-memory opt-in, then the launch; returns the first error.
template <typename Kernel, typename... Args>
cudaError_t LaunchWithSmem(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream,
                           Args... args) {
  if (smem > kFusedMaxSmemBytes) return cudaErrorInvalidValue;
  const cudaError_t error = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  return cudaGetLastError();
}

inline bool ValidArgs(const FusedLayerArgs& a, int ctas_per_head) {
  return (a.head_dim == 64 || a.head_dim == 128) && (a.dtype == 1 || a.dtype == 2) &&
         a.group >= 1 && a.group <= 16 && a.window >= 1 && a.window <= a.window_rows &&
         a.window <= a.n && a.num_kv_heads >= 1 && a.num_kv_heads <= 65535 && ctas_per_head >= 1;
}

}  // namespace laprox::kernels::cuda::fused

#endif  // LAPROX_KERNELS_CUDA_FUSED_BLOCK_CUH_
