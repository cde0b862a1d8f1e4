#include "cpu/score.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cpu/rows.h"
#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

// Tokens per sgemm chunk. Q.K^T has a small inner dimension (d), so wide chunks amortise the
// packing of Q (SmolLM2 at 4K: 1024 ran ~15% faster than 256 in paired runs). V.M writes a
// [chunk, G*d] product that should stay in L2 (Llama: 256 x 512 fp32 = 512 KiB; 1024 was
// ~8% slower there).
constexpr int64_t kKeyChunk = 1024;
constexpr int64_t kValueChunk = 256;

// Tolerance on the row sums of a window attention row given by the engine (bf16 rows).
constexpr double kRowSumTolerance = 1e-2;

// How the attention columns of the group are summarised per token.
enum class AttentionStat {
  kGroupMean,  // ||mean_h A^h[:, i]||^2 * G^2, one value per token
  kPerHead,    // ||A^h[:, i]||^2, G values per token
  kHeadGram,   // <A^h[:, i], A^h'[:, i]> for h <= h', G diagonal then G(G-1)/2 cross
};

// How values enter the score.
enum class ValueStat {
  kNone,     // ATTENTION
  kNorm,     // ||v_i||
  kSummed,   // ||v_i sum_h W_O^h||, factor block 0
  kPerHead,  // ||v_i W_O^h||, factor blocks 1..G
  kExact,    // v_i M_h v_i^T and v_i C_hh' v_i^T, factor blocks 1..G+P (raw quadratic forms)
};

struct Modes {
  AttentionStat attention;
  ValueStat value;
  int64_t first_block;  // first factor block the value sgemm reads
  int64_t blocks;       // number of factor blocks (F)
};

Modes ChooseModes(const PolicySpec& policy, int64_t group) {
  const int64_t pairs = group * (group - 1) / 2;
  switch (policy.indicator) {
    case Indicator::kAttention:
      return {AttentionStat::kGroupMean, ValueStat::kNone, 0, 0};
    case Indicator::kAttentionXValue:
      return {AttentionStat::kGroupMean, ValueStat::kNorm, 0, 0};
    case Indicator::kAttentionXProjectedValue:
      break;
  }
  switch (policy.gqa_value) {
    case GqaValue::kMeanHeadNorm:
      return {AttentionStat::kGroupMean, ValueStat::kPerHead, 1, group};
    case GqaValue::kSummedProjection:
      return {AttentionStat::kGroupMean, ValueStat::kSummed, 0, 1};
    case GqaValue::kMeanHeadProduct:
      return {AttentionStat::kPerHead, ValueStat::kPerHead, 1, group};
    case GqaValue::kExactBlock:
      return {AttentionStat::kHeadGram, ValueStat::kExact, 1, group + pairs};
  }
  return {AttentionStat::kGroupMean, ValueStat::kNone, 0, 0};
}

template <typename T>
T* Sized(std::vector<T>& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  return v.data();
}

template <typename T>
T* Zeroed(std::vector<T>& v, int64_t size) {
  T* p = Sized(v, size);
  std::fill(p, p + size, T{0});
  return p;
}

// Fills ws.probs columns [0, prefix) and ws.row_scale with the group's window attention given
// by the engine, checking every given row of the group's heads.
absl::Status LoadGivenAttention(const PlanShape& shape, const HeadTask& task, int64_t prefix,
                                ScoreWorkspace& ws) {
  const TensorView& attention = task.inputs->window_attention;
  const int64_t n = shape.n, we = shape.window, wq = shape.window_rows, G = shape.group_size;
  const TensorName name{task.layer, "window_attention"};
  float* probs = Sized(ws.probs, G * we * n);
  float* row_scale = Sized(ws.row_scale, G * we);
  for (int64_t hi = 0; hi < G; ++hi) {
    const int64_t h = task.kv_head * G + hi;
    for (int64_t row = 0; row < wq; ++row) {
      RowBlock block;
      LAPROX_RETURN_IF_ERROR(LoadRows(attention, h, row, 1, name, ws.rows, &block));
      double sum = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        if (block.data[j] < 0.f) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", task.layer, "].window_attention has a negative value (",
                           block.data[j], ") at [", h, ", ", row, ", ", j, "]"));
        }
        sum += block.data[j];
      }
      if (std::abs(sum - 1.0) > kRowSumTolerance) {
        return absl::InvalidArgumentError(
            absl::StrCat("layers[", task.layer, "].window_attention row [", h, ", ", row,
                         "] sums to ", sum, ", not 1 (tolerance ", kRowSumTolerance, ")"));
      }
      const int64_t t = row - (wq - we);
      if (t < 0) continue;
      std::copy(block.data, block.data + prefix, probs + (hi * we + t) * n);
      row_scale[hi * we + t] = 1.f;
    }
  }
  return absl::OkStatus();
}

// Computes the group's window attention from queries and keys into ws.probs (unnormalised,
// columns [0, prefix) valid) and ws.row_scale.
absl::Status ComputeAttention(const PlanShape& shape, const HeadTask& task, int64_t prefix,
                              ScoreWorkspace& ws) {
  const LayerInputs& in = *task.inputs;
  const int64_t n = shape.n, d = shape.head_dim, we = shape.window, wq = shape.window_rows,
                G = shape.group_size, rows = G * we;
  float* queries = Sized(ws.queries, rows * d);
  for (int64_t hi = 0; hi < G; ++hi) {
    const int64_t h = task.kv_head * G + hi;
    RowBlock block;
    LAPROX_RETURN_IF_ERROR(
        LoadRows(in.window_queries, h, 0, wq, {task.layer, "window_queries"}, ws.rows, &block));
    for (int64_t t = 0; t < we; ++t) {
      const float* src = block.data + (wq - we + t) * block.ld;
      float* dst = queries + (hi * we + t) * d;
      for (int64_t k = 0; k < d; ++k) dst[k] = src[k] * task.scale;
    }
  }

  std::vector<float> lse;
  if (shape.lse_given) {
    const TensorView& view = in.window_lse;
    lse.resize(rows);
    for (int64_t hi = 0; hi < G; ++hi) {
      const int64_t h = task.kv_head * G + hi;
      for (int64_t row = 0; row < wq; ++row) {
        const float v = view.LoadAsFloat(h * view.stride(0) + row * view.stride(1));
        if (!std::isfinite(v)) {
          return absl::InvalidArgumentError(absl::StrCat("layers[", task.layer,
                                                         "].window_lse has a non-finite value (", v,
                                                         ") at [", h, ", ", row, "]"));
        }
        const int64_t t = row - (wq - we);
        if (t >= 0) lse[hi * we + t] = v;
      }
    }
  }

  // Logits of every key a window row may see; with the engine's LSE only the prefix is needed
  // (window keys are still checked for NaN/Inf).
  const int64_t key_end = shape.lse_given ? prefix : n;
  float* probs = Sized(ws.probs, rows * n);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyChunk) {
    const int64_t count = std::min(kKeyChunk, key_end - j0);
    RowBlock keys;
    LAPROX_RETURN_IF_ERROR(
        LoadRows(in.keys, task.kv_head, j0, count, {task.layer, "keys"}, ws.rows, &keys));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                static_cast<int>(count), static_cast<int>(d), 1.f, queries, static_cast<int>(d),
                keys.data, static_cast<int>(keys.ld), 0.f, probs + j0, static_cast<int>(n));
  }
  if (key_end < n) {
    LAPROX_RETURN_IF_ERROR(CheckRowsFinite(in.keys, task.kv_head, key_end, n - key_end,
                                           {task.layer, "keys"}, ws.rows));
  }

  float* row_scale = Sized(ws.row_scale, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % we;
    float* row = probs + r * n;
    if (shape.lse_given) {
      ExpInPlace(row, prefix, lse[r]);
      row_scale[r] = 1.f;
    } else {
      // Causal: window row t sees keys j <= n - we + t.
      const double sum = ExpShiftedInPlace(row, n - we + t + 1);
      row_scale[r] = static_cast<float>(1.0 / sum);
    }
  }
  return absl::OkStatus();
}

// Per-token attention statistics over the prefix [0, prefix) into ws.attention.
void AttentionStatistics(const PlanShape& shape, AttentionStat stat, int64_t prefix,
                         ScoreWorkspace& ws) {
  const int64_t n = shape.n, we = shape.window, G = shape.group_size;
  const float* probs = ws.probs.data();
  const float* scale = ws.row_scale.data();
  switch (stat) {
    case AttentionStat::kGroupMean: {
      float* acc = Zeroed(ws.attention, prefix);
      std::vector<const float*> rows(G);
      std::vector<float> scales(G);
      for (int64_t t = 0; t < we; ++t) {
        for (int64_t hi = 0; hi < G; ++hi) {
          rows[hi] = probs + (hi * we + t) * n;
          scales[hi] = scale[hi * we + t];
        }
        AccumulateSquaredSum(rows.data(), scales.data(), static_cast<int>(G), prefix, acc);
      }
      break;
    }
    case AttentionStat::kPerHead: {
      float* acc = Zeroed(ws.attention, G * prefix);
      for (int64_t hi = 0; hi < G; ++hi) {
        for (int64_t t = 0; t < we; ++t) {
          const float* row = probs + (hi * we + t) * n;
          AccumulateSquaredSum(&row, &scale[hi * we + t], 1, prefix, acc + hi * prefix);
        }
      }
      break;
    }
    case AttentionStat::kHeadGram: {
      const int64_t stats = G * (G + 1) / 2;
      float* acc = Zeroed(ws.attention, stats * prefix);
      for (int64_t t = 0; t < we; ++t) {
        int64_t pair = G;
        for (int64_t a = 0; a < G; ++a) {
          const float* ra = probs + (a * we + t) * n;
          const float sa = scale[a * we + t];
          AccumulateSquaredSum(&ra, &sa, 1, prefix, acc + a * prefix);
          for (int64_t b = a + 1; b < G; ++b, ++pair) {
            const float* rb = probs + (b * we + t) * n;
            AccumulateProduct(ra, rb, sa * scale[b * we + t], prefix, acc + pair * prefix);
          }
        }
      }
      break;
    }
  }
}

// Per-token value statistics over the prefix into ws.value ([F, prefix]); checks every value
// row of the head, window rows included.
absl::Status ValueStatistics(const PlanShape& shape, const HeadTask& task, const Modes& modes,
                             int64_t prefix, ScoreWorkspace& ws) {
  const TensorView& values = task.inputs->values;
  const TensorName name{task.layer, "values"};
  const int64_t d = shape.head_dim, F = modes.blocks;
  if (modes.value == ValueStat::kNone) {
    return CheckRowsFinite(values, task.kv_head, 0, shape.n, name, ws.rows);
  }
  float* out = Sized(ws.value, std::max<int64_t>(F, 1) * prefix);
  float* projected = Sized(ws.projected, kValueChunk * F * d);
  for (int64_t i0 = 0; i0 < prefix; i0 += kValueChunk) {
    const int64_t count = std::min(kValueChunk, prefix - i0);
    RowBlock v;
    LAPROX_RETURN_IF_ERROR(LoadRows(values, task.kv_head, i0, count, name, ws.rows, &v));
    if (modes.value == ValueStat::kNorm) {
      for (int64_t j = 0; j < count; ++j) {
        const float* row = v.data + j * v.ld;
        out[i0 + j] = std::sqrt(Dot(row, row, d));
      }
      continue;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(count),
                static_cast<int>(F * d), static_cast<int>(d), 1.f, v.data, static_cast<int>(v.ld),
                task.factors + modes.first_block * d, static_cast<int>(task.factor_ld), 0.f,
                projected, static_cast<int>(F * d));
    for (int64_t j = 0; j < count; ++j) {
      const float* row = v.data + j * v.ld;
      for (int64_t f = 0; f < F; ++f) {
        const float q = Dot(projected + (j * F + f) * d, row, d);
        // Quadratic forms of PSD matrices are >= 0 up to rounding; cross terms may be negative.
        out[f * prefix + i0 + j] =
            modes.value == ValueStat::kExact ? q : std::sqrt(std::max(q, 0.f));
      }
    }
  }
  return CheckRowsFinite(values, task.kv_head, prefix, shape.n - prefix, name, ws.rows);
}

// out[i] for i in [begin, len) = pool(x)_i over x[0, len) (SEMANTICS.md, "pool").
void Pool(Pooling kind, int64_t kernel, const float* x, int64_t len, int64_t begin, float* out,
          std::vector<double>& prefix_sum) {
  const int64_t half = kernel / 2;
  switch (kind) {
    case Pooling::kNone:
      std::copy(x + begin, x + len, out + begin);
      break;
    case Pooling::kMax:
      for (int64_t i = begin; i < len; ++i) {
        float best = x[i];
        for (int64_t j = std::max<int64_t>(0, i - half); j <= std::min(len - 1, i + half); ++j) {
          best = std::max(best, x[j]);
        }
        out[i] = best;
      }
      break;
    case Pooling::kAvg: {
      double* sums = Sized(prefix_sum, len + 1);
      sums[0] = 0.0;
      for (int64_t i = 0; i < len; ++i) sums[i + 1] = sums[i] + x[i];
      for (int64_t i = begin; i < len; ++i) {
        const int64_t lo = std::max<int64_t>(0, i - half), hi = std::min(len, i + half + 1);
        out[i] = static_cast<float>((sums[hi] - sums[lo]) / static_cast<double>(kernel));
      }
      break;
    }
  }
}

}  // namespace

absl::Status ScoreHead(const PlanShape& shape, const PolicySpec& policy, const HeadTask& task,
                       ScoreWorkspace& ws, float* raw) {
  const int64_t G = shape.group_size;
  const int64_t prefix = shape.n - shape.window;  // pooled range: sinks and candidates
  const Modes modes = ChooseModes(policy, G);

  if (shape.attention_given) {
    LAPROX_RETURN_IF_ERROR(LoadGivenAttention(shape, task, prefix, ws));
  } else {
    LAPROX_RETURN_IF_ERROR(ComputeAttention(shape, task, prefix, ws));
  }
  LAPROX_RETURN_IF_ERROR(ValueStatistics(shape, task, modes, prefix, ws));
  if (prefix == 0) return absl::OkStatus();
  AttentionStatistics(shape, modes.attention, prefix, ws);

  const float* att = ws.attention.data();
  const float* val = ws.value.data();
  float* x = Sized(ws.pre_pool, prefix);
  const int64_t begin = shape.sinks;
  const float inv_group = 1.f / static_cast<float>(G);
  switch (modes.attention) {
    case AttentionStat::kGroupMean:
      // Pool the attention factor c, then multiply by the value factor.
      for (int64_t i = 0; i < prefix; ++i) x[i] = std::sqrt(att[i]) * inv_group;
      Pool(policy.pooling, policy.pool_kernel, x, prefix, begin, raw, ws.prefix_sum);
      if (modes.value == ValueStat::kPerHead) {
        for (int64_t i = begin; i < prefix; ++i) {
          float r = 0.f;
          for (int64_t h = 0; h < G; ++h) r += val[h * prefix + i];
          raw[i] *= r * inv_group;
        }
      } else if (modes.value != ValueStat::kNone) {
        for (int64_t i = begin; i < prefix; ++i) raw[i] *= val[i];
      }
      return absl::OkStatus();
    case AttentionStat::kPerHead:
      // mean_h ||A^h col|| * ||v W_O^h||, then pool.
      for (int64_t i = 0; i < prefix; ++i) {
        float sum = 0.f;
        for (int64_t h = 0; h < G; ++h) {
          sum += std::sqrt(att[h * prefix + i]) * val[h * prefix + i];
        }
        x[i] = sum * inv_group;
      }
      break;
    case AttentionStat::kHeadGram:
      // ||sum_h A^h col (outer) v W_O^h||_F^2 = sum_{h,h'} <A^h col, A^h' col> v C_hh' v^T.
      for (int64_t i = 0; i < prefix; ++i) {
        float sum = 0.f;
        for (int64_t h = 0; h < G; ++h) sum += att[h * prefix + i] * val[h * prefix + i];
        for (int64_t p = G; p < modes.blocks; ++p) {
          sum += 2.f * att[p * prefix + i] * val[p * prefix + i];
        }
        x[i] = std::sqrt(std::max(sum, 0.f));
      }
      break;
  }
  Pool(policy.pooling, policy.pool_kernel, x, prefix, begin, raw, ws.prefix_sum);
  return absl::OkStatus();
}

}  // namespace laprox::kernels::cpu
