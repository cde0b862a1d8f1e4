// Kernels of the GEMM scorer (gemm_scorer.cc): gathering strided inputs into dense fp32, the
// softmax normaliser of the window rows, per-token attention statistics, quadratic forms of the
// value factors, and pooling into raw scores. The GEMMs (Q.K^T, V.[factor blocks]) are cuBLAS
// calls issued by gemm_scorer.cc. Each kernel computes what kernels/cpu/score.cc and window.cc
// compute, in fp32 (normaliser sums, attention statistics and average pooling in fp64).
//
// Launchers enqueue on `stream`, never synchronise, and return the launch error
// (cudaGetLastError); cudaSuccess without launching when there is nothing to do. All pointers are
// device memory. Every reduction has a fixed order (no float atomics): results are deterministic.
#ifndef LAPROX_KERNELS_CUDA_SCORE_KERNELS_H_
#define LAPROX_KERNELS_CUDA_SCORE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/kernel_tensor.h"
#include "policy/score_modes.h"

namespace laprox::kernels::cuda {

// The statistics of kernels/policy/score_modes.h (AttentionStat, ValueStat), as the launchers
// store them. Attention: S statistics per (group, token), stored [group][S][token]:
//   kGroupMean  S = 1: sum_t (sum_h A^h[t, i])^2
//   kPerHead    S = G: sum_t A^h[t, i]^2
//   kHeadGram   S = G(G+1)/2: G diagonal terms as kPerHead, then sum_t A^a[t, i] A^b[t, i] for
//               a < b in (0,1),(0,2),..,(1,2),.. order
// Values: F value statistics per (group, token), stored [group][F][token]: kNone F = 0; kNorm,
// kSummed F = 1; kPerHead F = G; kExact F = G(G+1)/2.

// Pooling along tokens (SEMANTICS.md "pool"): the values of laprox::kernels::Pooling.
enum class PoolKind : int { kAvg = 0, kMax = 1, kNone = 2, kAvgPeak = 3 };

// Where pooling applies (SEMANTICS.md "pool_target"): the values of laprox::kernels::PoolTarget.
enum class PoolPlacement : int { kAttention = 0, kScore = 1 };

// out[a * out_s0 + b * out_s1 + c] = scale * t(a, row0 + b, col0 + c) in fp32 for a < count0,
// b < count1, c < count2. Preconditions: the read range is inside t.dims.
cudaError_t LaunchGather(const KernelTensor& t, int64_t row0, int64_t col0, int64_t count0,
                         int64_t count1, int64_t count2, float scale, float* out, int64_t out_s0,
                         int64_t out_s1, cudaStream_t stream);

// Softmax normaliser of window rows, one chunk of key columns at a time. Row r (< rows) of
// `logits` (leading dimension ld) holds the logits of keys [col0, col0 + count) in columns
// [0, count); window row t = r % window sees keys j <= visible_base + t (visible_base = n - we).
// Over the visible keys of the chunk it computes m = max and s = sum_j exp(x_j - m) (expf, fp64
// sum, fixed block reduction) and merges them into the running (row_max[r], row_sum[r]) so
// that afterwards row_sum[r] = sum_j exp(x_j - row_max[r]) over every chunk so far, and
// row_scale[r] = (float)(1.0 / row_sum[r]); first = true starts afresh. Call it for chunks in
// increasing col0, the first with col0 = 0 and first = true (every row sees key 0).
cudaError_t LaunchRowSoftmaxStats(const float* logits, int64_t rows, int64_t ld, int64_t col0,
                                  int64_t count, int64_t visible_base, int64_t window, bool first,
                                  float* row_max, double* row_sum, float* row_scale,
                                  cudaStream_t stream);

// x[r * ld + j] = expf(min(x[r * ld + j] - shift[r], 0)) * scale[r] for r < rows, j < count;
// scale null means 1 (shift = the window LSE, so a probability is capped at 1 as on the CPU).
cudaError_t LaunchExpRows(float* x, int64_t rows, int64_t ld, int64_t count, const float* shift,
                          const float* scale, cudaStream_t stream);

// Attention statistics (AttentionStat) of tokens [col0, col0 + count). `probs` row
// (g * group + h) * window + t, column j (leading dimension ld) is A^{g*group+h}[t, col0 + j];
// writes att[(g * S + s) * att_ld + col0 + j] for g < kv_heads, j < count. Sums, squares and
// products in fp64 (no underflow for probabilities down to fp32's smallest normal).
cudaError_t LaunchAttentionStatistics(const float* probs, int64_t ld, int64_t kv_heads,
                                      int64_t group, int64_t window, int64_t col0, int64_t count,
                                      AttentionStat kind, double* att, int64_t att_ld,
                                      cudaStream_t stream);

// out[g * out_ld + i] = ||v(g, i, :)||_2 (fp32) for g < kv_heads, i < count; v is [Hkv, n, d].
cudaError_t LaunchValueNorms(const KernelTensor& v, int64_t kv_heads, int64_t count, float* out,
                             int64_t out_ld, cudaStream_t stream);

// Quadratic forms of tokens [col0, col0 + count): q = sum_k projected[g * projected_head_stride
// + j * forms * d + f * d + k] * v[g * v_head_stride + j * v_ld + k] (fp32), written to
// out[(g * forms + f) * out_ld + col0 + j] as q when raw, else sqrtf(max(q, 0)), for
// g < kv_heads, j < count, f < forms.
cudaError_t LaunchQuadraticForms(const float* projected, int64_t projected_head_stride,
                                 const float* v, int64_t v_ld, int64_t v_head_stride,
                                 int64_t kv_heads, int64_t col0, int64_t count, int64_t forms,
                                 int64_t d, bool raw, float* out, int64_t out_ld,
                                 cudaStream_t stream);

// The array the pool runs over (score.cc ScoreHead), for i < prefix, in fp64 and rounded to
// fp32 once. With placement kScore, or kGroupMean attention, one row per KV head,
// x[g * prefix + i]:
//   kGroupMean  sqrt(att[g][0][i]) / G, times the value factor r (as LaunchPoolScore) for kScore
//   kPerHead    (sum_h sqrt(att[g][h][i]) * val[g][h][i]) / G
//   kHeadGram   sqrt(max(sum_h att*val [diagonal] + sum_p 2 * att*val [pairs], 0))
// With placement kAttention and kPerHead or kHeadGram attention, one row per query head of each
// group, x[(g * G + h) * prefix + i] = sqrt(att[g][h][i]) (each head's attention norm).
// att is [Hkv][stats][prefix] (fp64), val [Hkv][forms][prefix].
cudaError_t LaunchPrePool(const double* att, const float* val, int64_t kv_heads, int64_t group,
                          int64_t stats, int64_t forms, int64_t prefix, AttentionStat kind,
                          ValueStat value, PoolPlacement placement, float* x, cudaStream_t stream);

// out[r * out_stride + i] for r < rows, i in [begin, prefix) = pool(x[r])_i over x[r][0, prefix)
// (pool kernel `kernel`, odd; AVG sums in fp64 and divides by kernel), times the value factor
// of KV head r (rows = Hkv then): (sum_h val[r][h][i]) / G for kPerHead values, val[r][0][i]
// for kNorm / kSummed, nothing for kNone (val may be null then).
cudaError_t LaunchPoolScore(const float* x, const float* val, int64_t rows, int64_t group,
                            int64_t forms, int64_t prefix, int64_t begin, PoolKind pool,
                            int64_t kernel, ValueStat value, float* out, int64_t out_stride,
                            cudaStream_t stream);

// Placement kAttention with kPerHead or kHeadGram attention: raw[g * raw_head_stride + i] for
// g < kv_heads, i in [begin, prefix) from the pooled head norms P_h = pooled[(g * G + h) *
// prefix + i] (LaunchPoolScore over LaunchPrePool's rows), in fp64, rounded to fp32 once:
//   kPerHead    (sum_h P_h * val[g][h][i]) / G
//   kHeadGram   sqrt(max(sum_h P_h^2 val_h + sum_{a<b} 2 rho_ab P_a P_b val_ab, 0)) with
//               rho_ab = att_ab / sqrt(att_aa * att_bb) (0 where that is 0), pairs in att's order
cudaError_t LaunchCombinePooledHeads(const float* pooled, const double* att, const float* val,
                                     int64_t kv_heads, int64_t group, int64_t stats, int64_t forms,
                                     int64_t prefix, int64_t begin, AttentionStat kind, float* raw,
                                     int64_t raw_head_stride, cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_SCORE_KERNELS_H_
