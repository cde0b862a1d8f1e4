#include "cpu/baseline_stats.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "common/status_macros.h"
#include "cpu/rows.h"
#include "cpu/vector_ops.h"
#include "policy/magnitude.h"

namespace laprox::kernels::cpu {
namespace {

// Bytes of one [chunk, D] product V W_O^h: small enough to stay in L2 while its rows are summed.
constexpr int64_t kProjectionChunkBytes = 256 * 1024;

// CAKE's entropy guard inside the logarithm.
constexpr float kEntropyEpsilon = 1e-10f;

// Mean and, unless `var` is null, unbiased variance (0 with one row) over `we` rows (row
// stride n) of columns [0, prefix). Checks `stop` once per row.
absl::Status RowMoments(const float* rows, int64_t we, int64_t n, int64_t prefix, float* mean,
                        float* var, const StopSignal* stop) {
  std::fill(mean, mean + prefix, 0.f);
  for (int64_t t = 0; t < we; ++t) {
    LAPROX_RETURN_IF_ERROR(CheckStop(stop));
    for (int64_t i = 0; i < prefix; ++i) mean[i] += rows[t * n + i];
  }
  const float inv_rows = 1.f / static_cast<float>(we);
  for (int64_t i = 0; i < prefix; ++i) mean[i] *= inv_rows;
  if (var == nullptr) return absl::OkStatus();
  std::fill(var, var + prefix, 0.f);
  if (we < 2) return absl::OkStatus();
  for (int64_t t = 0; t < we; ++t) {
    LAPROX_RETURN_IF_ERROR(CheckStop(stop));
    for (int64_t i = 0; i < prefix; ++i) {
      const float dev = rows[t * n + i] - mean[i];
      var[i] += dev * dev;
    }
  }
  const float inv_dof = 1.f / static_cast<float>(we - 1);
  for (int64_t i = 0; i < prefix; ++i) var[i] *= inv_dof;
  return absl::OkStatus();
}

// u_i = (1/G) sum_{h in g} ||v_i W_O^h||_1 for every token i < n. An L1 norm has no d x d
// shortcut, so V W_O^h is formed, but a chunk of tokens at a time (never n x D at once).
// KVPRESS_COMPAT rounds like kvpress's vwl1norm in the model dtype: each product element, each
// head's norm and the group mean. *max_values: the largest |v| of the head.
absl::Status ProjectedValueL1(const RequestShape& shape, const HeadTask& task, ScoreWorkspace& ws,
                              float* u, float* max_values) {
  const int64_t n = shape.n, d = shape.head_dim, G = shape.group_size, D = task.hidden_size;
  const int64_t Hd = int64_t{shape.num_kv_heads} * G * d;
  const int64_t chunk = std::clamp<int64_t>(kProjectionChunkBytes / (4 * D), 8, 256);
  float* product = Sized(ws.projected, chunk * D);
  const float inv_group = 1.f / static_cast<float>(G);
  const bool compat = task.kvpress_compat;
  const DType T = task.compat_dtype;
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    LAPROX_RETURN_IF_ERROR(CheckStop(task.stop));
    const int64_t count = std::min(chunk, n - i0);
    RowBlock v;
    LAPROX_RETURN_IF_ERROR(LoadRows(task.inputs->values, task.kv_head, i0, count,
                                    {task.layer, "values"}, ws.rows, &v, max_values));
    std::fill(u + i0, u + i0 + count, 0.f);
    for (int64_t hi = 0; hi < G; ++hi) {
      // o_proj[:, h*d:(h+1)*d] is W_O^h transposed: [D, d] with leading dimension H*d.
      const float* w = task.o_proj + (task.kv_head * G + hi) * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(count),
                  static_cast<int>(D), static_cast<int>(d), 1.f, v.data, static_cast<int>(v.ld), w,
                  static_cast<int>(Hd), 0.f, product, static_cast<int>(D));
      if (compat) {
        RoundTo(T, product, count * D);
        for (int64_t j = 0; j < count; ++j) {
          float norm = AbsSum(product + j * D, D);
          RoundTo(T, &norm, 1);
          u[i0 + j] += norm;
        }
      } else {
        for (int64_t j = 0; j < count; ++j) u[i0 + j] += AbsSum(product + j * D, D);
      }
    }
    if (compat) {
      for (int64_t j = 0; j < count; ++j) u[i0 + j] /= static_cast<float>(G);
      RoundTo(T, u + i0, count);
    } else {
      for (int64_t j = 0; j < count; ++j) u[i0 + j] *= inv_group;
    }
  }
  return absl::OkStatus();
}

// The SnapKV kinds' mean over the `we` window rows (row stride n) of columns [0, prefix) in
// KVPRESS_COMPAT: fp32 sums divided by we (not times 1/we), rounded to T. Checks `stop` once per
// row.
absl::Status CompatRowMean(DType T, const float* rows, int64_t we, int64_t n, int64_t prefix,
                           float* mean, const StopSignal* stop) {
  std::fill(mean, mean + prefix, 0.f);
  for (int64_t t = 0; t < we; ++t) {
    LAPROX_RETURN_IF_ERROR(CheckStop(stop));
    for (int64_t i = 0; i < prefix; ++i) mean[i] += rows[t * n + i];
  }
  for (int64_t i = 0; i < prefix; ++i) mean[i] /= static_cast<float>(we);
  RoundTo(T, mean, prefix);
  return absl::OkStatus();
}

// The pooled group score over the prefix (and CAKE's sums) from the window attention in ws.
// Each query head's score is pooled before the group mean (they commute only for AVG).
// KVPRESS_COMPAT (task.kvpress_compat) rounds the row mean, the pooled score and the group mean
// to T as kvpress's bf16 tensor ops do (mean = fp32 sum / count, rounded once). Checks
// task.stop once per window row of each pass.
absl::Status WindowStatistics(const RequestShape& shape, const PolicySpec& policy,
                              const HeadTask& task, DType attention_dtype, ScoreWorkspace& ws,
                              const BaselineHeadOutput& out) {
  const StopSignal* stop = task.stop;
  const int64_t n = shape.n, we = shape.window, G = shape.group_size, prefix = n - we;
  const bool cake = policy.kind == PolicyKind::kCake;
  const bool compat = task.kvpress_compat && !cake;
  const double gamma = policy.baseline.cake_gamma;  // any finite value >= 0
  float* mean = Sized(ws.value, 2 * prefix);
  float* var = mean + prefix;
  float* head_score = Sized(ws.pre_pool, prefix);
  float* pooled = Sized(ws.pooled, prefix);
  std::fill(out.scores, out.scores + prefix, 0.f);
  double entropy = 0.0, variance = 0.0;
  for (int64_t hi = 0; hi < G; ++hi) {
    float* rows = ws.probs.data() + hi * we * n;
    for (int64_t t = 0; t < we; ++t) {
      LAPROX_RETURN_IF_ERROR(CheckStop(stop));
      float* row = rows + t * n;
      const float scale = ws.row_scale[hi * we + t];
      for (int64_t i = 0; i < prefix; ++i) row[i] *= scale;
    }
    if (cake) {
      // The layer preference uses the attention before any rounding (SEMANTICS.md, CAKE).
      LAPROX_RETURN_IF_ERROR(RowMoments(rows, we, n, prefix, mean, var, stop));
      for (int64_t t = 0; t < we; ++t) {
        LAPROX_RETURN_IF_ERROR(CheckStop(stop));
        const float* row = rows + t * n;
        float row_entropy = 0.f;
        for (int64_t i = 0; i < prefix; ++i) {
          row_entropy -= row[i] * std::log(row[i] + kEntropyEpsilon);
        }
        entropy += row_entropy;
      }
      for (int64_t i = 0; i < prefix; ++i) variance += var[i];
    }
    if (attention_dtype != DType::kF32) {
      for (int64_t t = 0; t < we; ++t) {
        LAPROX_RETURN_IF_ERROR(CheckStop(stop));
        RoundTo(attention_dtype, rows + t * n, prefix);
      }
      if (cake) LAPROX_RETURN_IF_ERROR(RowMoments(rows, we, n, prefix, mean, var, stop));
    }
    if (cake) {
      // In fp64: a huge gamma gives +inf (beyond fp32), never inf * 0 = NaN.
      for (int64_t i = 0; i < prefix; ++i) {
        head_score[i] = policy::SaturatedFloat(mean[i] + gamma * var[i]);
      }
    } else if (compat) {
      LAPROX_RETURN_IF_ERROR(
          CompatRowMean(task.compat_dtype, rows, we, n, prefix, head_score, stop));
    } else {
      LAPROX_RETURN_IF_ERROR(RowMoments(rows, we, n, prefix, head_score, nullptr, stop));
    }
    Pool(policy.pooling, policy.pool_kernel, head_score, prefix, 0, pooled, ws.pool_sums);
    if (compat) RoundTo(task.compat_dtype, pooled, prefix);
    for (int64_t i = 0; i < prefix; ++i) out.scores[i] += pooled[i];
  }
  if (compat) {
    for (int64_t i = 0; i < prefix; ++i) out.scores[i] /= static_cast<float>(G);
    RoundTo(task.compat_dtype, out.scores, prefix);
  } else {
    const float inv_group = 1.f / static_cast<float>(G);
    for (int64_t i = 0; i < prefix; ++i) out.scores[i] *= inv_group;
  }
  if (cake) {
    *out.entropy = entropy;
    *out.variance = variance;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status BaselineHead(const RequestShape& shape, const PolicySpec& policy, const HeadTask& task,
                          DType attention_dtype, ScoreWorkspace& ws,
                          const BaselineHeadOutput& out) {
  LAPROX_RETURN_IF_ERROR(WindowAttention(shape, task, AllWindowRows(shape), ws));
  if (out.value_norms != nullptr) {
    float max_values = 0.f;
    LAPROX_RETURN_IF_ERROR(ProjectedValueL1(shape, task, ws, out.value_norms, &max_values));
    LAPROX_RETURN_IF_ERROR(policy::CheckValueMagnitude(shape, policy, task.hidden_size, task.layer,
                                                       task.kv_head, max_values, task.max_o_proj));
  } else {
    LAPROX_RETURN_IF_ERROR(CheckRowsFinite(task.inputs->values, task.kv_head, 0, shape.n,
                                           {task.layer, "values"}, ws.rows, nullptr, task.stop));
  }
  if (policy.kind == PolicyKind::kStreamingLlm || shape.window == shape.n) {
    return absl::OkStatus();
  }
  return WindowStatistics(shape, policy, task, attention_dtype, ws, out);
}

}  // namespace laprox::kernels::cpu
