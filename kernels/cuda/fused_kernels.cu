// Kernels of the v1 (fused) LaProx scorer; contracts in fused_kernels.h.
//
// Layers (CUB style): launchers -> dtype / head_dim dispatch -> __global__ kernels -> warp
// helpers (ldmatrix, mma.sync m16n8k16, cp.async).
//
// Pass 2 CTA (256 threads, 8 warps) for (KV head g, token tiles blockIdx.x, +gridDim.x, ...):
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
#include <type_traits>

#include "cuda/load.cuh"

namespace laprox::kernels::cuda {
namespace {

constexpr int kTile = kFusedTileTokens;
constexpr int kThreads = kFusedThreads;
constexpr int kWarps = kThreads / 32;
static_assert(kTile == 16 * kWarps, "each warp owns 16 tokens of a tile");

// ---- warp-level helpers ----------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

__device__ __forceinline__ void Ldsm4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulation.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);

template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two packed 16-bit values (low half = lower address) as floats.
template <typename T>
__device__ __forceinline__ float2 Unpack(uint32_t v);
template <>
__device__ __forceinline__ float2 Unpack<__nv_bfloat16>(uint32_t v) {
  __nv_bfloat162 h;
  memcpy(&h, &v, sizeof(h));
  return __bfloat1622float2(h);
}
template <>
__device__ __forceinline__ float2 Unpack<__half>(uint32_t v) {
  __half2 h;
  memcpy(&h, &v, sizeof(h));
  return __half22float2(h);
}

template <typename T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// 16-byte async copy global -> shared; src_bytes 0 zero-fills the destination.
__device__ __forceinline__ void CpAsync16(void* smem, const void* global, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(smem)),
               "l"(global), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ int PaddedGroupDevice(int group) {
  int gp = 1;
  while (gp < group) gp *= 2;
  return gp;
}

// ---- block-level loads -----------------------------------------------------------------------

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

// ---- pass 2 -----------------------------------------------------------------------------------

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

// ---- pass 1 -----------------------------------------------------------------------------------

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

// ---- factor split, given LSE, pooling ----------------------------------------------------------

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
    if (pooling == 2) {
      const int64_t lo = i - half > 0 ? i - half : 0;
      const int64_t hi = i + half < len - 1 ? i + half : len - 1;
      double window_sum = 0.0;
      for (int64_t j = lo; j <= hi; ++j) window_sum += term(j);
      pooled = static_cast<float>(window_sum / static_cast<double>(kernel));
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

// ---- dispatch ---------------------------------------------------------------------------------

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

bool ValidArgs(const FusedLayerArgs& a, int ctas_per_head) {
  return (a.head_dim == 64 || a.head_dim == 128) && (a.dtype == 1 || a.dtype == 2) &&
         a.group >= 1 && a.group <= 16 && a.window >= 1 && a.window <= a.window_rows &&
         a.window <= a.n && a.num_kv_heads >= 1 && a.num_kv_heads <= 65535 && ctas_per_head >= 1;
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

size_t WindowLsePartialCount(int num_kv_heads, int ctas_per_head, int padded_rows) {
  return static_cast<size_t>(num_kv_heads) * ctas_per_head * padded_rows;
}

cudaError_t LaunchSplitFactors(const float* factors, int64_t matrix_size, int64_t row_stride,
                               int first_block, int blocks, int head_dim, int num_kv_heads,
                               int dtype, void* out, float* inv_scale, cudaStream_t stream) {
  if (blocks < 1 || num_kv_heads < 1 || head_dim < 1) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(num_kv_heads) * static_cast<unsigned>(blocks);
  if (dtype == static_cast<int>(DeviceDType::kBF16)) {
    SplitFactorsKernel<__nv_bfloat16>
        <<<grid, kThreads, 0, stream>>>(factors, matrix_size, row_stride, first_block, blocks,
                                        head_dim, static_cast<__nv_bfloat16*>(out), inv_scale);
  } else if (dtype == static_cast<int>(DeviceDType::kF16)) {
    SplitFactorsKernel<__half><<<grid, kThreads, 0, stream>>>(factors, matrix_size, row_stride,
                                                              first_block, blocks, head_dim,
                                                              static_cast<__half*>(out), inv_scale);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchLoadLse(const void* data, int dtype, int64_t head_stride, int64_t row_stride,
                          int num_kv_heads, int group, int window_rows, int window, float* lse,
                          cudaStream_t stream) {
  if (group < 1 || group > 16 || window < 1 || window > window_rows) return cudaErrorInvalidValue;
  const int rp = PaddedRows(group, window);
  const int64_t threads = int64_t{num_kv_heads} * rp;
  LoadLseKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      data, static_cast<DeviceDType>(dtype), head_stride, row_stride, num_kv_heads, group,
      PaddedGroup(group), window_rows, window, rp, lse);
  return cudaGetLastError();
}

cudaError_t LaunchWindowLse(const FusedLayerArgs& args, int ctas_per_head, float2* partials,
                            float* lse, cudaStream_t stream) {
  if (!ValidArgs(args, ctas_per_head)) return cudaErrorInvalidValue;
  const bool bf16 = args.dtype == static_cast<int>(DeviceDType::kBF16);
  if (args.head_dim == 64) {
    return bf16 ? WindowLseTyped<__nv_bfloat16, 64>(args, ctas_per_head, partials, lse, stream)
                : WindowLseTyped<__half, 64>(args, ctas_per_head, partials, lse, stream);
  }
  return bf16 ? WindowLseTyped<__nv_bfloat16, 128>(args, ctas_per_head, partials, lse, stream)
              : WindowLseTyped<__half, 128>(args, ctas_per_head, partials, lse, stream);
}

cudaError_t LaunchFusedScore(const FusedLayerArgs& args, FusedValueMode mode, const float* lse,
                             const void* factors, const float* inv_scale, int ctas_per_head,
                             float* c, float* r, cudaStream_t stream) {
  if (!ValidArgs(args, ctas_per_head)) return cudaErrorInvalidValue;
  if (args.n - args.window <= 0) return cudaSuccess;  // no candidates
  const bool bf16 = args.dtype == static_cast<int>(DeviceDType::kBF16);
  if (args.head_dim == 64) {
    return bf16 ? FusedScoreTyped<__nv_bfloat16, 64>(args, mode, lse, factors, inv_scale,
                                                     ctas_per_head, c, r, stream)
                : FusedScoreTyped<__half, 64>(args, mode, lse, factors, inv_scale, ctas_per_head, c,
                                              r, stream);
  }
  return bf16 ? FusedScoreTyped<__nv_bfloat16, 128>(args, mode, lse, factors, inv_scale,
                                                    ctas_per_head, c, r, stream)
              : FusedScoreTyped<__half, 128>(args, mode, lse, factors, inv_scale, ctas_per_head, c,
                                             r, stream);
}

cudaError_t LaunchPoolScore(const float* c, const float* r, FusedValueMode mode, bool pool_score,
                            int pooling, int kernel, int64_t n, int64_t begin, int64_t len,
                            int num_kv_heads, float* raw, cudaStream_t stream) {
  if (kernel < 1 || kernel % 2 == 0 || pooling < 0 || pooling > 2) return cudaErrorInvalidValue;
  if (begin >= len) return cudaSuccess;
  const int64_t runs = (len - begin + kPoolRun - 1) / kPoolRun;
  const int64_t threads = runs * num_kv_heads;
  const bool values = mode != FusedValueMode::kNone;  // r exists
  PoolScoreKernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      c, r, values && pool_score, values && !pool_score, pooling, kernel, n, begin, len, runs,
      num_kv_heads, raw);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
