// GemmScorer: per layer, cuBLAS GEMMs for Q.K^T and V.[factor blocks] and the simple kernels of
// score_kernels.h, on dense fp32 copies of whatever the engine's tensors look like.
//
// Per layer (one at a time, on context.stream, no synchronisation):
//   1. window attention statistics: the queries (last we rows, times the softmax scale) into
//      dense fp32; logits [H, we, chunk] = Q.K^T for chunks of key columns (strided-batched
//      GEMM per KV group: the group's G*we query rows are one matrix); the row normaliser over
//      all n keys (running max / fp64 sum merged chunk by chunk, causal) unless the window LSE
//      is given; probabilities in place over the candidate prefix [0, n - we); the per-token
//      statistics of score_kernels.h. With window_attention given, its last we rows are
//      gathered into the same buffer instead. When the logits of all needed keys fit the
//      budget (n <= 256K at H*we = 1024), they are computed once; otherwise the normaliser
//      pass and the probability pass each compute them (the GEMM twice).
//   2. value statistics: V (chunks of tokens) times the mode's factor blocks, then quadratic
//      forms per token; or ||v|| for ATTENTION_X_VALUE.
//   3. the pooled raw scores, exactly as kernels/cpu/score.cc combines them (pool_target
//      ATTENTION with per-head statistics: each query head's attention norm pooled apart, then
//      combined per token).
// fp32 K / V with unit innermost stride are read in place by cuBLAS; other dtypes and strides
// are first gathered into a dense fp32 scratch (one extra read of the input and a write plus a
// read of 4 bytes per element: for bf16 K and V that is about 5x the bytes of the inputs).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/device_util.h"
#include "cuda/score_kernels.h"
#include "cuda/scorer.h"
#include "policy/score_modes.h"

namespace laprox::kernels::cuda {
namespace {

// Bound on the logits [H * we, chunk] of one layer (Llama-3.1-8B, we = 32: 256K keys).
constexpr int64_t kLogitBudgetBytes = int64_t{1} << 30;
// Bound on the dense fp32 copy of a chunk of keys [Hkv, chunk, d] (Llama: 16K keys).
constexpr int64_t kKeyScratchBytes = int64_t{64} << 20;
// Bound on V times the factor blocks [Hkv, chunk, F * d] (Llama, MEAN_HEAD_NORM: 8K tokens).
constexpr int64_t kProjectedBudgetBytes = int64_t{128} << 20;

PoolKind ToPoolKind(Pooling pooling) {
  switch (pooling) {
    case Pooling::kAvg:
      return PoolKind::kAvg;
    case Pooling::kMax:
      return PoolKind::kMax;
    case Pooling::kAvgPeak:
      return PoolKind::kAvgPeak;
    case Pooling::kNone:
      break;
  }
  return PoolKind::kNone;
}

bool FitsInt(int64_t value) { return value >= 0 && value <= INT_MAX; }

// Whether cuBLAS can read the [Hkv, n, d] view in place: fp32, unit innermost stride, rows
// apart by at least d with a leading dimension that fits cuBLAS's int.
bool UsableInPlace(const TensorView& view, int64_t d) {
  return view.dtype() == DType::kF32 && view.stride(2) == 1 && view.stride(1) >= d &&
         FitsInt(view.stride(1));
}

// Row-major rows of a [Hkv, rows, d] fp32 matrix set as cuBLAS sees them.
struct Rows {
  const float* data = nullptr;
  int64_t ld = 0;           // floats between rows
  int64_t head_stride = 0;  // floats between KV heads
};

// Strided-batched fp32 GEMM over the KV heads (column-major, cuBLAS's conventions).
absl::Status Gemm(const DeviceContext& context, cublasOperation_t op_a, cublasOperation_t op_b,
                  int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, int64_t stride_a,
                  const float* b, int64_t ldb, int64_t stride_b, float* c, int64_t ldc,
                  int64_t stride_c, int64_t batch, absl::string_view what) {
  const float one = 1.f, zero = 0.f;
  return CublasStatus(
      cublasGemmStridedBatchedEx(
          context.cublas, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
          &one, a, CUDA_R_32F, static_cast<int>(lda), stride_a, b, CUDA_R_32F,
          static_cast<int>(ldb), stride_b, &zero, c, CUDA_R_32F, static_cast<int>(ldc), stride_c,
          static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      what);
}

class GemmScorer final : public Scorer {
 public:
  bool Supports(const RequestShape&, const PolicySpec&,
                const std::vector<LayerInputs>&) const override {
    return true;
  }
  absl::Status Score(const DeviceContext& context, const CudaPreparedModel& model,
                     const std::vector<LayerInputs>& layers, const RequestShape& shape,
                     const PolicySpec& policy, float* d_raw) override;

 private:
  // Sizes of one request, fixed before the layer loop.
  struct Plan {
    int64_t kv_heads, group, heads, d, n, window, window_rows, begin, prefix, rows;
    bool given, use_lse;
    int64_t chunk;        // logit columns per chunk (nc)
    int64_t key_chunk;    // keys per gathered K chunk (kc)
    int64_t value_chunk;  // tokens per value GEMM (vc)
    ScoreModes modes;
    int64_t stats;  // S, attention statistics per token (ScoreModes::attention_stats)
    int64_t forms;  // F, value statistics per token (ScoreModes::value_forms)
    bool value_gemm;
    PoolPlacement placement;
    bool pool_heads;  // kAttention placement with per-head statistics: one pool per query head
  };
  // Device arrays carved out of workspace_.
  struct Arrays {
    float* queries;    // [H, we, d], scaled
    float* shift;      // [H * we] row max (or the LSE)
    double* row_sum;   // [H * we]
    float* row_scale;  // [H * we], 1 / row_sum
    float* logits;     // [H, we, chunk]
    float* keys;       // [Hkv, key_chunk, d]
    float* values;     // [Hkv, value_chunk, d]
    float* projected;  // [Hkv, value_chunk, F * d]
    double* att;       // [Hkv, S, prefix]
    float* val;        // [Hkv, max(F, 1), prefix]
    float* x;          // [Hkv, prefix], or [Hkv, G, prefix] with pool_heads
    float* pooled;     // pool_heads: [Hkv, G, prefix]
  };

  absl::Status ComputeLogits(const DeviceContext& context, const Plan& p, const Arrays& a,
                             const TensorView& keys, int64_t col0, int64_t count);
  absl::Status AttentionStatistics(const DeviceContext& context, const Plan& p, const Arrays& a,
                                   const LayerInputs& in, float scale);
  absl::Status ValueStatistics(const DeviceContext& context, const Plan& p, const Arrays& a,
                               const CudaPreparedModel& model, int64_t layer,
                               const TensorView& values);

  DeviceBuffer workspace_;
};

absl::Status GemmScorer::ComputeLogits(const DeviceContext& context, const Plan& p, const Arrays& a,
                                       const TensorView& keys, int64_t col0, int64_t count) {
  const bool in_place = UsableInPlace(keys, p.d);
  for (int64_t j0 = col0; j0 < col0 + count; j0 += p.key_chunk) {
    const int64_t keys_now = std::min(p.key_chunk, col0 + count - j0);
    Rows k;
    if (in_place) {
      k = {static_cast<const float*>(keys.data()) + j0 * keys.stride(1), keys.stride(1),
           keys.stride(0)};
    } else {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchGather(ToKernelTensor(keys), j0, 0, p.kv_heads, keys_now, p.d, 1.f,
                                  a.keys, keys_now * p.d, p.d, context.stream),
                     "gathering keys"));
      k = {a.keys, p.d, keys_now * p.d};
    }
    // Row-major logits[g*G*we + r][j - col0] = Q_g[r] . K_g[j]: in column-major terms
    // C (keys x G*we, ldc = chunk) = K^T (keys x d) * Q_g^T (d x G*we).
    const int64_t group_rows = p.group * p.window;
    LAPROX_RETURN_IF_ERROR(Gemm(context, CUBLAS_OP_T, CUBLAS_OP_N, keys_now, group_rows, p.d,
                                k.data, k.ld, k.head_stride, a.queries, p.d, group_rows * p.d,
                                a.logits + (j0 - col0), p.chunk, group_rows * p.chunk, p.kv_heads,
                                "Q.K^T (cublasGemmStridedBatchedEx)"));
  }
  return absl::OkStatus();
}

absl::Status GemmScorer::AttentionStatistics(const DeviceContext& context, const Plan& p,
                                             const Arrays& a, const LayerInputs& in, float scale) {
  cudaStream_t stream = context.stream;
  const int64_t first_row = p.window_rows - p.window;  // the last we of the wq given rows
  if (p.window == 0) {
    return CudaStatus(
        cudaMemsetAsync(a.att, 0,
                        static_cast<size_t>(p.kv_heads * p.stats * p.prefix) * sizeof(double),
                        stream),
        "clearing attention statistics");
  }
  if (p.given) {
    for (int64_t c0 = 0; c0 < p.prefix; c0 += p.chunk) {
      const int64_t count = std::min(p.chunk, p.prefix - c0);
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchGather(ToKernelTensor(in.window_attention), first_row, c0, p.heads, p.window, count,
                       1.f, a.logits, p.window * p.chunk, p.chunk, stream),
          "gathering window_attention"));
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchAttentionStatistics(a.logits, p.chunk, p.kv_heads, p.group, p.window, c0,
                                               count, p.modes.attention, a.att, p.prefix, stream),
                     "attention statistics"));
    }
    return absl::OkStatus();
  }

  LAPROX_RETURN_IF_ERROR(
      CudaStatus(LaunchGather(ToKernelTensor(in.window_queries), first_row, 0, p.heads, p.window,
                              p.d, scale, a.queries, p.window * p.d, p.d, stream),
                 "gathering window_queries"));
  bool resident = false;  // logits of every needed key already in a.logits
  if (p.use_lse) {
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(LaunchGather(ToKernelTensor(in.window_lse), first_row, 0, p.heads, p.window, 1,
                                1.f, a.shift, p.window, 1, stream),
                   "gathering window_lse"));
  } else {
    // The normaliser over every key a window row sees (window keys included).
    for (int64_t c0 = 0; c0 < p.n; c0 += p.chunk) {
      const int64_t count = std::min(p.chunk, p.n - c0);
      LAPROX_RETURN_IF_ERROR(ComputeLogits(context, p, a, in.keys, c0, count));
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchRowSoftmaxStats(a.logits, p.rows, p.chunk, c0, count, p.n - p.window, p.window,
                                c0 == 0, a.shift, a.row_sum, a.row_scale, stream),
          "softmax normaliser"));
    }
    resident = p.n <= p.chunk;
  }
  // Probabilities of the candidate prefix (every window row sees all of it) and their
  // per-token statistics.
  for (int64_t c0 = 0; c0 < p.prefix; c0 += p.chunk) {
    const int64_t count = std::min(p.chunk, p.prefix - c0);
    if (!resident) LAPROX_RETURN_IF_ERROR(ComputeLogits(context, p, a, in.keys, c0, count));
    LAPROX_RETURN_IF_ERROR(CudaStatus(LaunchExpRows(a.logits, p.rows, p.chunk, count, a.shift,
                                                    p.use_lse ? nullptr : a.row_scale, stream),
                                      "softmax"));
    LAPROX_RETURN_IF_ERROR(
        CudaStatus(LaunchAttentionStatistics(a.logits, p.chunk, p.kv_heads, p.group, p.window, c0,
                                             count, p.modes.attention, a.att, p.prefix, stream),
                   "attention statistics"));
  }
  return absl::OkStatus();
}

absl::Status GemmScorer::ValueStatistics(const DeviceContext& context, const Plan& p,
                                         const Arrays& a, const CudaPreparedModel& model,
                                         int64_t layer, const TensorView& values) {
  cudaStream_t stream = context.stream;
  if (p.modes.value == ValueStat::kNone) return absl::OkStatus();
  if (p.modes.value == ValueStat::kNorm) {
    return CudaStatus(
        LaunchValueNorms(ToKernelTensor(values), p.kv_heads, p.prefix, a.val, p.prefix, stream),
        "value norms");
  }
  const int64_t F = p.forms, Fd = F * p.d;
  const bool in_place = UsableInPlace(values, p.d);
  for (int64_t i0 = 0; i0 < p.prefix; i0 += p.value_chunk) {
    const int64_t count = std::min(p.value_chunk, p.prefix - i0);
    Rows v;
    if (in_place) {
      v = {static_cast<const float*>(values.data()) + i0 * values.stride(1), values.stride(1),
           values.stride(0)};
    } else {
      LAPROX_RETURN_IF_ERROR(
          CudaStatus(LaunchGather(ToKernelTensor(values), i0, 0, p.kv_heads, count, p.d, 1.f,
                                  a.values, count * p.d, p.d, stream),
                     "gathering values"));
      v = {a.values, p.d, count * p.d};
    }
    // Row-major projected[g][j] = v_j [factor blocks first_block .. + F) ([d, F*d] with the
    // factor row stride): column-major C (F*d x count) = B (F*d x d) * V^T (d x count).
    LAPROX_RETURN_IF_ERROR(Gemm(context, CUBLAS_OP_N, CUBLAS_OP_N, Fd, count, p.d,
                                model.factors(layer, 0) + p.modes.first_block * p.d,
                                model.row_stride(), model.matrix_size(), v.data, v.ld,
                                v.head_stride, a.projected, Fd, count * Fd, p.kv_heads,
                                "V.factors (cublasGemmStridedBatchedEx)"));
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchQuadraticForms(a.projected, count * Fd, v.data, v.ld, v.head_stride, p.kv_heads, i0,
                             count, F, p.d, p.modes.value == ValueStat::kExact, a.val, p.prefix,
                             stream),
        "quadratic forms"));
  }
  return absl::OkStatus();
}

absl::Status GemmScorer::Score(const DeviceContext& context, const CudaPreparedModel& model,
                               const std::vector<LayerInputs>& layers, const RequestShape& shape,
                               const PolicySpec& policy, float* d_raw) {
  Plan p{};
  p.kv_heads = shape.num_kv_heads;
  p.group = shape.group_size;
  p.heads = p.kv_heads * p.group;
  p.d = shape.head_dim;
  p.n = shape.n;
  p.window = shape.window;
  p.window_rows = shape.window_rows;
  p.begin = shape.sinks;
  p.prefix = p.n - p.window;
  if (p.prefix <= p.begin) return absl::OkStatus();  // no candidates: nothing to write
  p.rows = p.heads * p.window;
  p.given = shape.attention_given;
  p.use_lse = shape.lse_given && !p.given;
  p.modes = ChooseScoreModes(policy, p.group);
  p.stats = p.modes.attention_stats(p.group);
  p.forms = p.modes.value_forms();
  p.value_gemm = p.modes.value_product();
  p.placement = policy.EffectivePoolTarget() == PoolTarget::kScore ? PoolPlacement::kScore
                                                                   : PoolPlacement::kAttention;
  p.pool_heads =
      p.placement == PoolPlacement::kAttention && p.modes.attention != AttentionStat::kGroupMean;
  // Columns of logits (or given attention) needed: the candidate prefix, plus the window keys
  // when the normaliser is computed here.
  const int64_t columns = p.given || p.use_lse ? p.prefix : p.n;
  const int64_t row_bytes = std::max<int64_t>(p.rows, 1) * int64_t{sizeof(float)};
  p.chunk = std::clamp<int64_t>(kLogitBudgetBytes / row_bytes, 1, columns);
  p.key_chunk = std::clamp<int64_t>(kKeyScratchBytes / (p.kv_heads * p.d * int64_t{sizeof(float)}),
                                    1, p.chunk);
  const int64_t F = p.forms;
  p.value_chunk = p.value_gemm
                      ? std::clamp<int64_t>(
                            kProjectedBudgetBytes / (p.kv_heads * F * p.d * int64_t{sizeof(float)}),
                            1, p.prefix)
                      : 0;
  if (!FitsInt(p.kv_heads) || !FitsInt(p.group * p.window) || !FitsInt(p.chunk) ||
      !FitsInt(F * p.d) || !FitsInt(model.row_stride())) {
    return absl::InvalidArgumentError(
        absl::StrCat("request shape (Hkv ", p.kv_heads, ", G ", p.group, ", d ", p.d, ", we ",
                     p.window, ") is too large for the CUDA GEMM scorer's GEMMs"));
  }

  bool gather_keys = false, gather_values = false;
  for (const LayerInputs& in : layers) {
    gather_keys |= !p.given && !UsableInPlace(in.keys, p.d);
    gather_values |= p.value_gemm && !UsableInPlace(in.values, p.d);
  }
  const auto count = [](int64_t n) { return static_cast<size_t>(n); };
  WorkspaceLayout layout;
  const size_t queries_at = layout.Add<float>(count(p.given ? 0 : p.rows * p.d));
  const size_t shift_at = layout.Add<float>(count(p.rows));
  const size_t row_sum_at = layout.Add<double>(count(p.rows));
  const size_t row_scale_at = layout.Add<float>(count(p.rows));
  const size_t logits_at = layout.Add<float>(count(p.rows * p.chunk));
  const size_t keys_at = layout.Add<float>(count(gather_keys ? p.kv_heads * p.key_chunk * p.d : 0));
  const size_t values_at =
      layout.Add<float>(count(gather_values ? p.kv_heads * p.value_chunk * p.d : 0));
  const size_t projected_at = layout.Add<float>(count(p.kv_heads * p.value_chunk * F * p.d));
  const size_t att_at = layout.Add<double>(count(p.kv_heads * p.stats * p.prefix));
  const size_t val_at = layout.Add<float>(count(p.kv_heads * std::max<int64_t>(F, 1) * p.prefix));
  const int64_t pool_rows = p.kv_heads * (p.pool_heads ? p.group : 1);
  const size_t x_at = layout.Add<float>(count(pool_rows * p.prefix));
  const size_t pooled_at = layout.Add<float>(count(p.pool_heads ? pool_rows * p.prefix : 0));
  LAPROX_RETURN_IF_ERROR(
      CudaStatus(workspace_.Reserve(layout.total()), "allocating the GEMM scorer workspace"));
  std::byte* base = workspace_.as<std::byte>();
  const auto floats = [base](size_t at) { return reinterpret_cast<float*>(base + at); };
  const Arrays a{.queries = floats(queries_at),
                 .shift = floats(shift_at),
                 .row_sum = reinterpret_cast<double*>(base + row_sum_at),
                 .row_scale = floats(row_scale_at),
                 .logits = floats(logits_at),
                 .keys = floats(keys_at),
                 .values = floats(values_at),
                 .projected = floats(projected_at),
                 .att = reinterpret_cast<double*>(base + att_at),
                 .val = floats(val_at),
                 .x = floats(x_at),
                 .pooled = floats(pooled_at)};

  const float scale = model.geometry().EffectiveScale();
  for (int64_t l = 0; l < shape.num_layers; ++l) {
    const LayerInputs& in = layers[l];
    LAPROX_RETURN_IF_ERROR(AttentionStatistics(context, p, a, in, scale));
    LAPROX_RETURN_IF_ERROR(ValueStatistics(context, p, a, model, l, in.values));
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchPrePool(a.att, a.val, p.kv_heads, p.group, p.stats, F, p.prefix, p.modes.attention,
                      p.modes.value, p.placement, a.x, context.stream),
        "pre-pool scores"));
    float* raw = d_raw + l * p.kv_heads * p.n;
    const PoolKind pool = ToPoolKind(policy.pooling);
    if (p.pool_heads) {
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchPoolScore(a.x, nullptr, pool_rows, p.group, F, p.prefix, p.begin, pool,
                          policy.pool_kernel, ValueStat::kNone, a.pooled, p.prefix, context.stream),
          "pooled head norms"));
      LAPROX_RETURN_IF_ERROR(CudaStatus(
          LaunchCombinePooledHeads(a.pooled, a.att, a.val, p.kv_heads, p.group, p.stats, F,
                                   p.prefix, p.begin, p.modes.attention, raw, p.n, context.stream),
          "pooled scores"));
      continue;
    }
    // The group-mean modes multiply by the value factor after pooling the attention factor.
    const bool value_after = p.placement == PoolPlacement::kAttention;
    LAPROX_RETURN_IF_ERROR(CudaStatus(
        LaunchPoolScore(a.x, a.val, p.kv_heads, p.group, F, p.prefix, p.begin, pool,
                        policy.pool_kernel, value_after ? p.modes.value : ValueStat::kNone, raw,
                        p.n, context.stream),
        "pooled scores"));
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Scorer> NewGemmScorer() { return std::make_unique<GemmScorer>(); }

}  // namespace laprox::kernels::cuda
