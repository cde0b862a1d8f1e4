// Launchers of the fused LaProx scorer's kernels, used by fused_scorer.cc. One algorithm per
// .cu file: fused_split_factors.cu, fused_window_lse.cu (pass 1 and the engine's LSE),
// fused_score.cu (pass 2), fused_pool.cu; the warp-level (fused_warp.cuh) and block-level
// (fused_block.cuh) pieces the passes share are headers.
//
// Per layer, on one stream:
//   LaunchSplitFactors  fp32 factor blocks -> upper-triangular 3-term 16-bit split (V.M input)
//   LaunchLoadLse       the engine's window LSE -> padded fp32 rows       (window_lse given), or
//   LaunchWindowLse     pass 1: LSE of every window row from Q.K^T        (window_lse absent)
//   LaunchFusedScore    pass 2: per (KV head, token tile) the attention factor c and the value
//                       factor r from one read of the K and V tiles (tensor cores)
//   LaunchPoolScore     raw p = pool(c) * r (or pool(c * r)) at the candidates
//
// Window rows. The G query heads of a KV group and the `we` window rows are laid out t-major with
// the group padded to a power of two Gp = PaddedGroup(G) <= 16: row r = t * Gp + h (t window
// row, h head in the group), Rp = PaddedRows(G, we) rows (a multiple of 16). Padding rows
// (h >= G or t >= we) carry lse = +inf, so their probabilities are exactly 0. With this layout
// the heads of one window row sit in neighbouring rows of an m16 MMA tile and the group sum is a
// fixed butterfly of warp shuffles.
//
// Precision. Q, K and V enter the MMAs exactly (bf16 / fp16 inputs). Logits are fp32 dot products
// times the softmax scale (the CPU scales q first; the difference is a rounding). The factor
// matrices are not rounded: each block M (fp32) becomes U = triu(M) with doubled off-diagonal
// (v U v^T = v M v^T, and the zero 16x16 blocks below the diagonal are skipped: 36 of 64 are
// used at d = 128), scaled by a power of two so that max |U| is in [1, 2) (bf16) or
// [2^14, 2^15) (fp16, whose narrow exponent range would otherwise push the second and third
// terms into subnormals), and split into three 16-bit terms U1 + U2 + U3 (relative
// representation error < 2^-24 for bf16); all products accumulate
// in fp32. Softmax and square roots are fp32, the squares of the group sums and their sums over
// the window rows fp64 (no underflow down to fp32's smallest normal probability), pool sums fp64
// (each window's own terms), as on the CPU. Why tensor cores and not fp32 CUDA cores for v M v^T:
// at Llama-3.1-8B geometry (L32 Hkv8 G4 d128, n = 128K, w = 64) K and V are 2 * 32 * 8 * 128K * 128
// * 2 B = 17.2 GB (3.6 ms at 4.8 TB/s), Q.K^T is 2.2 TFLOP and the G quadratic forms 4.4 TFLOP
// dense, 2.5 TFLOP triangular; fp32 CUDA cores (~67 TFLOP/s) would need > 35 ms, bf16 tensor cores
// with the 3-term split ~7.4 TFLOP + 2.2 = 9.6 TFLOP, ~10 ms at the 990 TFLOP/s peak (mma.sync
// reaches less; pass 1 adds another 2.2 TFLOP without window_lse). So this scorer is compute bound
// at that geometry, not bandwidth bound. A 2-term split (element error < 2^-17; in a numpy
// emulation at d = 128, D = 4096 the worst relative error of sqrt(v M v^T) over 2000 rows was 5e-7
// with 2 terms, 2e-15 with 3, 1.2e-7 for fp32 sgemm-like arithmetic) would cut the V.M work by a
// third: set kFactorTerms = 2 once the GPU comparison confirms it.
//
// Memory traffic (HBM): K read twice without window_lse (pass 1 over [0, n), pass 2 over the
// candidates [0, n - we)), once with it; V once; everything else is small: Q once per CTA, c and
// r 8 B per token (written once, read once by the pool kernel), p 4 B per token, the split
// factors 3 * blocks * d^2 * 2 B per (layer, KV head) (3 MB per Llama layer). Relative to the
// floor (K + V once, 17.2 GB at Llama geometry / 128K): ~1.0x with window_lse, ~1.5x without.
// L2 -> SM: every CTA streams the upper-triangular blocks of the split factor terms for every
// 128-token tile (G * 3 * 0.56 * d^2 * 2 B = 221 KB per tile at Llama geometry, 3.4x the tile's
// K + V bytes); with the FLOPs above this makes the fused scorer compute / L2 bound, not HBM bound,
// at that geometry (estimate ~10-15 ms at 128K vs the 3.6 ms floor; unmeasured).
//
// Determinism: no atomics; every reduction has a fixed order for a given grid, and the grid
// depends only on the shapes and the device's SM count (same device, same bits).
//
// Pointers are device pointers unless stated; every launcher enqueues on `stream`, does not
// synchronise, and returns the launch's cudaError_t (cudaGetLastError after the launch).
#ifndef LAPROX_KERNELS_CUDA_FUSED_KERNELS_H_
#define LAPROX_KERNELS_CUDA_FUSED_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// Tokens per CTA tile in passes 1 and 2, threads per CTA, and the largest dynamic shared memory
// a CTA may use on sm_90.
inline constexpr int kFusedTileTokens = 128;
inline constexpr int kFusedThreads = 256;
inline constexpr size_t kFusedMaxSmemBytes = 227 * 1024;
// Terms of the 16-bit split of the factor blocks.
inline constexpr int kFactorTerms = 3;

// What the value factor r of a token is.
enum class FusedValueMode : int {
  kNone = 0,      // ATTENTION: p = pool(c)
  kNorm = 1,      // ATTENTION_X_VALUE: r = ||v||
  kMeanHead = 2,  // MEAN_HEAD_NORM: r = (1/G) sum_h sqrt(v M_h v^T), blocks 1..G
  kSummed = 3,    // SUMMED_PROJECTION: r = sqrt(v M_sum v^T), block 0
};

// Smallest power of two >= group (group in 1..16).
inline int PaddedGroup(int group) {
  int gp = 1;
  while (gp < group) gp *= 2;
  return gp;
}
// Rows of the padded window-row layout, a multiple of 16.
inline int PaddedRows(int group, int window) {
  const int64_t rows = int64_t{PaddedGroup(group)} * window;
  return static_cast<int>((rows + 15) / 16 * 16);
}
// Dynamic shared memory of pass 2 and pass 1 (head_dim 64 or 128).
inline size_t FusedSmemBytes(int head_dim, int padded_rows, FusedValueMode mode) {
  const size_t row = static_cast<size_t>(head_dim + 8) * 2;  // 16-bit elements, padded row
  size_t bytes = static_cast<size_t>(padded_rows) * row      // Q
                 + kFusedTileTokens * row;                   // K tile
  if (mode != FusedValueMode::kNone) bytes += kFusedTileTokens * row;  // V tile
  if (mode == FusedValueMode::kMeanHead || mode == FusedValueMode::kSummed) {
    bytes += 2 * static_cast<size_t>(head_dim) * row;  // double-buffered factor term
  }
  return bytes + static_cast<size_t>(padded_rows) * sizeof(float);  // lse
}
inline size_t WindowLseSmemBytes(int head_dim, int padded_rows) {
  const size_t row = static_cast<size_t>(head_dim + 8) * 2;
  return static_cast<size_t>(padded_rows) * row + kFusedTileTokens * row +
         static_cast<size_t>(padded_rows) * 2 * sizeof(float) *
             (1 + kFusedThreads / 32);  // running (max, sum) + per-warp partials
}

// One layer's inputs as the kernels read them. Element strides; innermost strides are 1.
// keys / values: [Hkv, n, d], 16-byte aligned rows (data 16-byte aligned, head and token strides
// multiples of 8). queries: [H, wq, d], any strides. dtype: 1 = fp16, 2 = bf16 (DeviceDType),
// the same for all three.
struct FusedLayerArgs {
  const void* keys = nullptr;
  int64_t key_head_stride = 0;
  int64_t key_token_stride = 0;
  const void* values = nullptr;
  int64_t value_head_stride = 0;
  int64_t value_token_stride = 0;
  const void* queries = nullptr;
  int64_t query_head_stride = 0;
  int64_t query_row_stride = 0;
  int64_t query_col_stride = 0;
  int dtype = 2;
  int64_t n = 0;
  int head_dim = 0;      // 64 or 128
  int num_kv_heads = 0;  // Hkv
  int group = 0;         // G, 1..16
  int window_rows = 0;   // wq
  int window = 0;        // we, 1..wq, we <= n
  float scale = 0.f;     // softmax scale
};

// Splits the factor blocks [first_block, first_block + blocks) of every KV head of one layer.
// factors: the layer's matrices (CudaPreparedModel::factors(layer, 0)), matrix g at
// factors + g * matrix_size, row stride row_stride floats. Writes out (16-bit, dtype as above)
// [Hkv][blocks][kFactorTerms][d][d] and inv_scale [Hkv][blocks] (the power of two to multiply
// v U v^T by).
cudaError_t LaunchSplitFactors(const float* factors, int64_t matrix_size, int64_t row_stride,
                               int first_block, int blocks, int head_dim, int num_kv_heads,
                               int dtype, void* out, float* inv_scale, cudaStream_t stream);

// The engine's LSE (view [H, wq] of any dtype: data, dtype 0/1/2, strides in elements) into
// lse [Hkv][Rp] in the padded row layout (+inf on padding rows).
cudaError_t LaunchLoadLse(const void* data, int dtype, int64_t head_stride, int64_t row_stride,
                          int num_kv_heads, int group, int window_rows, int window, float* lse,
                          cudaStream_t stream);

// Pass 1: lse [Hkv][Rp] of every window row over its causal keys (row t sees j <= n - we + t),
// through `partials` (workspace, WindowLsePartialCount(...) float2 entries). `ctas_per_head`
// CTAs per KV head each keep a running (max, sum) over their tiles; a second kernel combines
// them in CTA order (fp64).
size_t WindowLsePartialCount(int num_kv_heads, int ctas_per_head, int padded_rows);
cudaError_t LaunchWindowLse(const FusedLayerArgs& args, int ctas_per_head, float2* partials,
                            float* lse, cudaStream_t stream);

// Pass 2: for every KV head g and token i in [0, n - we): c[g * n + i] = sqrt(sum_t (sum_h
// p[h, t, i])^2) / G with p = exp(min(scale * q.k - lse, 0)) (squares summed in fp64), and
// (mode != kNone) r[g * n + i] as FusedValueMode says. factors / inv_scale: LaunchSplitFactors'
// output for the mode's blocks (kMeanHead: G blocks, kSummed: 1 block; ignored otherwise). c, r:
// device [Hkv, n] floats.
cudaError_t LaunchFusedScore(const FusedLayerArgs& args, FusedValueMode mode, const float* lse,
                             const void* factors, const float* inv_scale, int ctas_per_head,
                             float* c, float* r, cudaStream_t stream);

// raw[g * n + i] for i in [begin, len), len = n - we: pool(c[g * n + .] over [0, len))_i times
// r[g * n + i] (not for kNone), or with pool_score pool(c * r) (pool_target SCORE; c alone for
// kNone). pooling: 0 none, 1 max, 2 avg, 3 avg_peak (the values of kernels::Pooling are mapped by
// the caller), odd kernel >= 1. raw points at layer l's first row (d_raw + l * Hkv * n).
cudaError_t LaunchPoolScore(const float* c, const float* r, FusedValueMode mode, bool pool_score,
                            int pooling, int kernel, int64_t n, int64_t begin, int64_t len,
                            int num_kv_heads, float* raw, cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_FUSED_KERNELS_H_
