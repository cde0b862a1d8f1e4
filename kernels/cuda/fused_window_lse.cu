// The window rows' log-sum-exp of the fused scorer: pass 1 (LaunchWindowLse: a partial
// (max, sum) per CTA from Q.K^T, combined in CTA order in fp64) or the engine's own LSE
// (LaunchLoadLse), both as padded fp32 rows (fused_kernels.h).
#include "cuda/fused_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "cuda/fused_block.cuh"
#include "cuda/fused_warp.cuh"
#include "cuda/load.cuh"

namespace laprox::kernels::cuda {
namespace fused {
namespace {

// Online (max, sum) merge of (m2, s2) into (m, s); s2 == 0 means empty.
__device__ __forceinline__ void MergeMaxSum(float& m, float& s, float m2, float s2) {
  if (s2 == 0.f) return;
  if (s == 0.f) {
    m = m2;
    s = s2;
  } else if (m2 > m) {
    s = s * expf(m - m2) + s2;
    m = m2;
  } else {
    s += s2 * expf(m2 - m);
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    WindowLseKernel(FusedLayerArgs a, float2* __restrict__ partials) {
  constexpr int kRow = kD + 8;
  const int g = blockIdx.y;
  const int gp = PaddedGroupDevice(a.group);
  const int rp = static_cast<int>((int64_t{gp} * a.window + 15) / 16 * 16);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kts = qs + static_cast<size_t>(rp) * kRow;
  float2* running = reinterpret_cast<float2*>(kts + kTile * kRow);  // [rp]
  float2* warp_part = running + rp;                                 // [kWarps][rp]

  LoadQueries<T, kD>(qs, a, g, gp, rp);
  for (int r = threadIdx.x; r < rp; r += kThreads) running[r] = make_float2(0.f, 0.f);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tq = lane & 3;
  const int64_t n = a.n;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const T* keys = static_cast<const T*>(a.keys);

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t tok0 = tile * kTile;
    __syncthreads();  // kts and warp_part of the previous tile are consumed
    IssueTile<T, kD>(kts, keys, g * a.key_head_stride, a.key_token_stride, tok0, n);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();

    uint32_t kb[kD / 16][4];
    LoadKeyFragments<kD>(kb, kts, warp, lane);
    for (int rt = 0; rt < rp / 16; ++rt) {
      float acc[2][4];
      RowTileLogits<T, kD>(acc, qs, rt, lane, kb);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = rt * 16 + gid + 8 * half;
        const int t = r / gp;
        // Row t sees keys j <= n - we + t; padding rows see none.
        const int64_t visible_end =
            (t < a.window && r % gp < a.group) ? n - a.window + t + 1 : int64_t{0};
        float x[4];
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int64_t token = tok0 + warp * 16 + nt * 8 + 2 * tq + j;
            const float logit = acc[nt][2 * half + j] * a.scale;
            x[2 * nt + j] = token < visible_end ? logit : -INFINITY;
            m = fmaxf(m, x[2 * nt + j]);
          }
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        float s = 0.f;
        if (m != -INFINITY) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s += x[e] == -INFINITY ? 0.f : expf(x[e] - m);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (tq == 0) warp_part[warp * rp + r] = make_float2(m, s);
      }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rp; r += kThreads) {
      float2 run = running[r];
      for (int w = 0; w < kWarps; ++w) {
        const float2 part = warp_part[w * rp + r];
        MergeMaxSum(run.x, run.y, part.x, part.y);
      }
      running[r] = run;
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rp; r += kThreads) {
    partials[(static_cast<int64_t>(g) * gridDim.x + blockIdx.x) * rp + r] = running[r];
  }
}

// lse[g * rp + r] from the CTAs' partials, in CTA order, in fp64; +inf on padding rows.
__global__ void CombineLseKernel(const float2* __restrict__ partials, int ctas, int rp,
                                 int num_kv_heads, int group, int gp, int window,
                                 float* __restrict__ lse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t{num_kv_heads} * rp) return;
  const int g = static_cast<int>(idx / rp), r = static_cast<int>(idx % rp);
  double m = -INFINITY, s = 0.0;
  for (int c = 0; c < ctas; ++c) {
    const float2 part = partials[(static_cast<int64_t>(g) * ctas + c) * rp + r];
    if (part.y == 0.f) continue;
    const double pm = part.x, ps = part.y;
    if (s == 0.0) {
      m = pm;
      s = ps;
    } else if (pm > m) {
      s = s * exp(m - pm) + ps;
      m = pm;
    } else {
      s += ps * exp(pm - m);
    }
  }
  const bool padding = r / gp >= window || r % gp >= group;
  lse[idx] = (padding || s == 0.0) ? INFINITY : static_cast<float>(m + log(s));
}

__global__ void LoadLseKernel(const void* data, DeviceDType dtype, int64_t head_stride,
                              int64_t row_stride, int num_kv_heads, int group, int gp,
                              int window_rows, int window, int rp, float* __restrict__ lse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t{num_kv_heads} * rp) return;
  const int g = static_cast<int>(idx / rp), r = static_cast<int>(idx % rp);
  const int t = r / gp, h = r % gp;
  float value = INFINITY;
  if (t < window && h < group) {
    const int64_t head = int64_t{g} * group + h;
    const int64_t row = int64_t{window_rows} - window + t;
    value = LoadAsFloat(data, dtype, head * head_stride + row * row_stride);
  }
  lse[idx] = value;
}

template <typename T, int kD>
cudaError_t WindowLseTyped(const FusedLayerArgs& a, int ctas, float2* partials, float* lse,
                           cudaStream_t stream) {
  const int rp = PaddedRows(a.group, a.window);
  const dim3 grid(ctas, a.num_kv_heads);
  cudaError_t error =
      LaunchWithSmem(WindowLseKernel<T, kD>, grid, WindowLseSmemBytes(kD, rp), stream, a, partials);
  if (error != cudaSuccess) return error;
  const int64_t threads = int64_t{a.num_kv_heads} * rp;
  CombineLseKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      partials, ctas, rp, a.num_kv_heads, a.group, PaddedGroup(a.group), a.window, lse);
  return cudaGetLastError();
}

}  // namespace
}  // namespace fused

size_t WindowLsePartialCount(int num_kv_heads, int ctas_per_head, int padded_rows) {
  return static_cast<size_t>(num_kv_heads) * ctas_per_head * padded_rows;
}

cudaError_t LaunchLoadLse(const void* data, int dtype, int64_t head_stride, int64_t row_stride,
                          int num_kv_heads, int group, int window_rows, int window, float* lse,
                          cudaStream_t stream) {
  if (group < 1 || group > 16 || window < 1 || window > window_rows) return cudaErrorInvalidValue;
  const int rp = PaddedRows(group, window);
  const int64_t threads = int64_t{num_kv_heads} * rp;
  fused::LoadLseKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      data, static_cast<DeviceDType>(dtype), head_stride, row_stride, num_kv_heads, group,
      PaddedGroup(group), window_rows, window, rp, lse);
  return cudaGetLastError();
}

cudaError_t LaunchWindowLse(const FusedLayerArgs& args, int ctas_per_head, float2* partials,
                            float* lse, cudaStream_t stream) {
  if (!fused::ValidArgs(args, ctas_per_head)) return cudaErrorInvalidValue;
  const bool bf16 = args.dtype == static_cast<int>(DeviceDType::kBF16);
  if (args.head_dim == 64) {
    return bf16 ? fused::WindowLseTyped<__nv_bfloat16, 64>(args, ctas_per_head, partials, lse,
                                                           stream)
                : fused::WindowLseTyped<__half, 64>(args, ctas_per_head, partials, lse, stream);
  }
  return bf16
             ? fused::WindowLseTyped<__nv_bfloat16, 128>(args, ctas_per_head, partials, lse, stream)
             : fused::WindowLseTyped<__half, 128>(args, ctas_per_head, partials, lse, stream);
}

}  // namespace laprox::kernels::cuda
