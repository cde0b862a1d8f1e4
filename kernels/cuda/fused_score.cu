// Pass 2 of the fused scorer: per (KV head, token tile) the attention factor c and the
// value factor r from one read of the K and V tiles on tensor cores (LaunchFusedScore; contract
// in fused_kernels.h).
//
// Layers (CUB style): launcher -> dtype / head_dim dispatch -> __global__ kernel -> block loads
// (fused_block.cuh) -> warp helpers (fused_warp.cuh: ldmatrix, mma.sync m16n8k16, cp.async).
//
// CTA (256 threads, 8 warps) for (KV head g, token tiles blockIdx.x, +gridDim.x, ...):
//   smem: Q [Rp][d+8], K tile [128][d+8], V tile [128][d+8], factor term [2][d][d+8] (16-bit),
//         lse [Rp] fp32. The +8 padding makes every ldmatrix phase conflict-free (row stride
//         d*2+16 bytes = 4 banks apart for 8 rows).
//   phase A: warp w owns tokens [16w, 16w+16) of the tile; keeps its K fragments in registers
//            and walks all Rp/16 row tiles of Q: logits -> p -> group sum (shuffles) -> squares.
//   phase B: warp w owns the same 16 tokens as the M side of V.U (V fragments in registers);
//            the 3 * blocks factor terms stream through a cp.async double buffer.
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

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    FusedScoreKernel(FusedLayerArgs a, FusedValueMode mode, const float* __restrict__ lse,
                     const T* __restrict__ factors, const float* __restrict__ inv_scale,
                     float* __restrict__ c_out, float* __restrict__ r_out) {
  constexpr int kRow = kD + 8;
  const int g = blockIdx.y;
  const int gp = PaddedGroupDevice(a.group);
  const int rp = static_cast<int>((int64_t{gp} * a.window + 15) / 16 * 16);
  const bool projected = mode == FusedValueMode::kMeanHead || mode == FusedValueMode::kSummed;
  const int blocks = mode == FusedValueMode::kMeanHead ? a.group : 1;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kts = qs + static_cast<size_t>(rp) * kRow;
  T* vts = kts + kTile * kRow;
  T* ms = vts + (mode != FusedValueMode::kNone ? kTile * kRow : 0);
  float* lse_s = reinterpret_cast<float*>(ms + (projected ? 2 * kD * kRow : 0));

  LoadQueries<T, kD>(qs, a, g, gp, rp);
  for (int r = threadIdx.x; r < rp; r += kThreads) lse_s[r] = lse[int64_t{g} * rp + r];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tq = lane & 3;
  const int64_t prefix = a.n - a.window;
  const int64_t tiles = (prefix + kTile - 1) / kTile;
  const T* keys = static_cast<const T*>(a.keys);
  const T* values = static_cast<const T*>(a.values);
  const float inv_group = 1.f / static_cast<float>(a.group);
  const int chunks = projected ? blocks * kFactorTerms : 0;
  const T* head_factors = factors + static_cast<int64_t>(g) * blocks * kFactorTerms * kD * kD;

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t tok0 = tile * kTile;
    __syncthreads();  // the previous tile's readers of kts / vts / ms are done
    IssueTile<T, kD>(kts, keys, g * a.key_head_stride, a.key_token_stride, tok0, prefix);
    if (mode != FusedValueMode::kNone) {
      IssueTile<T, kD>(vts, values, g * a.value_head_stride, a.value_token_stride, tok0, prefix);
    }
    if (projected) {
      IssueFactorTerm<T, kD>(ms, head_factors);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();

    // Phase A: attention factor of the warp's 16 tokens.
    {
      uint32_t kb[kD / 16][4];
      LoadKeyFragments<kD>(kb, kts, warp, lane);
      // Squares in fp64: a group sum below ~1e-19 would square to 0 in fp32 (score.cc).
      double att[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
      for (int rt = 0; rt < rp / 16; ++rt) {
        float acc[2][4];
        RowTileLogits<T, kD>(acc, qs, rt, lane, kb);
        const float lse_lo = lse_s[rt * 16 + gid], lse_hi = lse_s[rt * 16 + gid + 8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            // Capped at 1: an engine LSE below a logit cannot overflow (the CPU's rule).
            float p_lo = expf(fminf(acc[nt][j] * a.scale - lse_lo, 0.f));
            float p_hi = expf(fminf(acc[nt][2 + j] * a.scale - lse_hi, 0.f));
            double sq;
            if (gp == 16) {
              float s = p_lo + p_hi;
              s += __shfl_xor_sync(0xffffffffu, s, 4);
              s += __shfl_xor_sync(0xffffffffu, s, 8);
              s += __shfl_xor_sync(0xffffffffu, s, 16);
              sq = gid == 0 ? double{s} * s : 0.0;
            } else {
              for (int m = 4; m < 4 * gp; m <<= 1) {
                p_lo += __shfl_xor_sync(0xffffffffu, p_lo, m);
                p_hi += __shfl_xor_sync(0xffffffffu, p_hi, m);
              }
              sq = (gid & (gp - 1)) == 0 ? double{p_lo} * p_lo + double{p_hi} * p_hi : 0.0;
            }
            att[nt][j] += sq;
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          double s = att[nt][j];
          s += __shfl_xor_sync(0xffffffffu, s, 4);
          s += __shfl_xor_sync(0xffffffffu, s, 8);
          s += __shfl_xor_sync(0xffffffffu, s, 16);
          const int64_t token = tok0 + warp * 16 + nt * 8 + 2 * tq + j;
          if (gid == 0 && token < prefix) {
            c_out[int64_t{g} * a.n + token] = static_cast<float>(sqrt(s) / a.group);
          }
        }
      }
    }

    // Phase B: value factor.
    if (mode == FusedValueMode::kNorm) {
      if (threadIdx.x < kTile) {
        const T* row = vts + threadIdx.x * kRow;
        float sum = 0.f;
        for (int k = 0; k < kD; ++k) {
          const float v = ToFloat<T>(row[k]);
          sum += v * v;
        }
        const int64_t token = tok0 + threadIdx.x;
        if (token < prefix) r_out[int64_t{g} * a.n + token] = sqrtf(sum);
      }
    } else if (projected) {
      uint32_t va[kD / 16][4];
      {
        const T* row = vts + (warp * 16 + (lane & 15)) * kRow + (lane >> 4) * 8;
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) Ldsm4(va[ks], row + ks * 16);
      }
      float acc[kD / 8][4];
      float rsum_lo = 0.f, rsum_hi = 0.f;
      for (int chunk = 0; chunk < chunks; ++chunk) {
        if (chunk + 1 < chunks) {
          T* dst = ms + ((chunk + 1) & 1) * kD * kRow;
          const T* src = head_factors + static_cast<int64_t>(chunk + 1) * kD * kD;
          IssueFactorTerm<T, kD>(dst, src);
          CpAsyncCommit();
          CpAsyncWait<1>();
        } else {
          CpAsyncWait<0>();
        }
        __syncthreads();  // chunk `chunk` is visible to every warp
        const int term = chunk % kFactorTerms;
        if (term == 0) {
#pragma unroll
          for (int nt = 0; nt < kD / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
          }
        }
        const T* mb = ms + (chunk & 1) * kD * kRow;
        const T* lane_base = mb + (((lane >> 3) & 1) * 8 + (lane & 7)) * kRow + (lane >> 4) * 8;
#pragma unroll
        for (int m = 0; m < kD / 16; ++m) {
          // Columns [16m, 16m+16) of U are zero below row 16m+16: k-steps 0..m only.
#pragma unroll
          for (int ks = 0; ks <= m; ++ks) {
            uint32_t b[4];
            Ldsm4Trans(b, lane_base + ks * 16 * kRow + 2 * m * 8);
            Mma<T>(acc[2 * m], va[ks], b[0], b[1]);
            Mma<T>(acc[2 * m + 1], va[ks], b[2], b[3]);
          }
        }
        if (term == kFactorTerms - 1) {
          // v U v^T: acc columns of n-tile nt are the V columns held in va[nt / 2] (even nt:
          // registers 0, 1; odd nt: 2, 3), rows gid and gid + 8.
          float q_lo = 0.f, q_hi = 0.f;
#pragma unroll
          for (int nt = 0; nt < kD / 8; ++nt) {
            const float2 v_lo = Unpack<T>(va[nt / 2][(nt & 1) ? 2 : 0]);
            const float2 v_hi = Unpack<T>(va[nt / 2][(nt & 1) ? 3 : 1]);
            q_lo += acc[nt][0] * v_lo.x + acc[nt][1] * v_lo.y;
            q_hi += acc[nt][2] * v_hi.x + acc[nt][3] * v_hi.y;
          }
          q_lo += __shfl_xor_sync(0xffffffffu, q_lo, 1);
          q_lo += __shfl_xor_sync(0xffffffffu, q_lo, 2);
          q_hi += __shfl_xor_sync(0xffffffffu, q_hi, 1);
          q_hi += __shfl_xor_sync(0xffffffffu, q_hi, 2);
          const float unscale = inv_scale[int64_t{g} * blocks + chunk / kFactorTerms];
          // Quadratic forms of PSD matrices are >= 0 up to rounding (as score.cc).
          rsum_lo += sqrtf(fmaxf(q_lo * unscale, 0.f));
          rsum_hi += sqrtf(fmaxf(q_hi * unscale, 0.f));
        }
        __syncthreads();  // every warp is done with buffer chunk & 1 before it is refilled
      }
      if (tq == 0) {
        const float scale = mode == FusedValueMode::kMeanHead ? inv_group : 1.f;
        const int64_t token = tok0 + warp * 16 + gid;
        if (token < prefix) r_out[int64_t{g} * a.n + token] = rsum_lo * scale;
        if (token + 8 < prefix) r_out[int64_t{g} * a.n + token + 8] = rsum_hi * scale;
      }
    }
  }
}

template <typename T, int kD>
cudaError_t FusedScoreTyped(const FusedLayerArgs& a, FusedValueMode mode, const float* lse,
                            const void* factors, const float* inv_scale, int ctas, float* c,
                            float* r, cudaStream_t stream) {
  const int rp = PaddedRows(a.group, a.window);
  const dim3 grid(ctas, a.num_kv_heads);
  return LaunchWithSmem(FusedScoreKernel<T, kD>, grid, FusedSmemBytes(kD, rp, mode), stream, a,
                        mode, lse, static_cast<const T*>(factors), inv_scale, c, r);
}

}  // namespace
}  // namespace fused

cudaError_t LaunchFusedScore(const FusedLayerArgs& args, FusedValueMode mode, const float* lse,
                             const void* factors, const float* inv_scale, int ctas_per_head,
                             float* c, float* r, cudaStream_t stream) {
  if (!fused::ValidArgs(args, ctas_per_head)) return cudaErrorInvalidValue;
  if (args.n - args.window <= 0) return cudaSuccess;  // no candidates
  const bool bf16 = args.dtype == static_cast<int>(DeviceDType::kBF16);
  if (args.head_dim == 64) {
    return bf16 ? fused::FusedScoreTyped<__nv_bfloat16, 64>(args, mode, lse, factors, inv_scale,
                                                            ctas_per_head, c, r, stream)
                : fused::FusedScoreTyped<__half, 64>(args, mode, lse, factors, inv_scale,
                                                     ctas_per_head, c, r, stream);
  }
  return bf16 ? fused::FusedScoreTyped<__nv_bfloat16, 128>(args, mode, lse, factors, inv_scale,
                                                           ctas_per_head, c, r, stream)
              : fused::FusedScoreTyped<__half, 128>(args, mode, lse, factors, inv_scale,
                                                    ctas_per_head, c, r, stream);
}

}  // namespace laprox::kernels::cuda
