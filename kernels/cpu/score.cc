#include "cpu/score.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "common/status_macros.h"
#include "cpu/rows.h"
#include "cpu/triangular.h"
#include "cpu/vector_ops.h"
#include "policy/magnitude.h"
#include "policy/score_modes.h"

namespace laprox::kernels::cpu {
namespace {

// fp32 values a value chunk holds per row (ValueChunk): the row, and EXACT_BLOCK's products v C_hh'
// with the cross-Grams.
int64_t ValueFloats(const ScoreModes& modes, int64_t d, int64_t G) {
  return modes.value == ValueStat::kExact ? (1 + modes.factor_blocks - G) * d : d;
}

// The exponent k of the scale 2^k that AttentionStatistics multiplies the probabilities by.
// Unscaled, a window row's attention below ~1e-19 has a square below fp32's smallest normal
// (1.2e-38) and flushes towards 0, and tokens whose every row is that small tie at 0 and are
// picked by position (SEMANTICS.md, "Precision limits"). Scaled, the squares stay normal for
// attention down to 2^(-63-k) (2^-121 = 4e-37 at G = 4, we = 32), while the largest possible sum,
// we rows of the square of a group sum of G probabilities of at most 1.01, stays below 2^126.
// Scaling costs nothing in the loops (it is folded into the row scales) and keeps them fp32.
int AttentionScaleExponent(int64_t we, int64_t G) {
  const double top = std::log2(1.03 * static_cast<double>(std::max<int64_t>(we, 1)) *
                               static_cast<double>(G) * static_cast<double>(G));
  return static_cast<int>(std::floor((126.0 - top) / 2.0));
}

// The number of attention statistics per token (blocks of ws.attention).
int64_t AttentionStatisticCount(AttentionStat stat, int64_t G) {
  switch (stat) {
    case AttentionStat::kGroupMean:
      return 1;
    case AttentionStat::kPerHead:
      return G;
    case AttentionStat::kHeadGram:
      break;
  }
  return G * (G + 1) / 2;
}

// Adds the window rows `rows` (computed into ws.probs by WindowAttention) to the per-token
// attention statistics over the prefix [0, prefix) in ws.attention, times 2^(2k) with
// k = AttentionScaleExponent (fp32: at most 2^126). Each statistic adds its window rows in
// increasing t, so computing the rows in several ranges gives the same sums.
// Checks `stop` once per window row.
absl::Status AttentionStatistics(const RequestShape& shape, AttentionStat stat, WindowRows rows,
                                 int64_t prefix, int k, const StopSignal* stop,
                                 ScoreWorkspace& ws) {
  const int64_t n = shape.n, G = shape.group_size, count = rows.count();
  const float* probs = ws.probs.data();
  const float* row_scale = ws.row_scale.data();
  float* acc = ws.attention.data();
  // The row scales times 2^k (exact: a power of two; at most 2^k, as a row scale is at most 1).
  float* scale = Sized(ws.scaled_row_scale, G * count);
  for (int64_t r = 0; r < G * count; ++r) scale[r] = std::ldexp(row_scale[r], k);
  // Row t of query head hi of the group in ws.probs and `scale`.
  const auto at = [&](int64_t hi, int64_t t) { return hi * count + t - rows.begin; };
  switch (stat) {
    case AttentionStat::kGroupMean: {
      std::vector<const float*> heads(G);
      std::vector<float> scales(G);
      for (int64_t t = rows.begin; t < rows.end; ++t) {
        LAPROX_RETURN_IF_ERROR(CheckStop(stop));
        for (int64_t hi = 0; hi < G; ++hi) {
          heads[hi] = probs + at(hi, t) * n;
          scales[hi] = scale[at(hi, t)];
        }
        AccumulateSquaredSum(heads.data(), scales.data(), static_cast<int>(G), prefix, acc);
      }
      break;
    }
    case AttentionStat::kPerHead:
      for (int64_t hi = 0; hi < G; ++hi) {
        for (int64_t t = rows.begin; t < rows.end; ++t) {
          LAPROX_RETURN_IF_ERROR(CheckStop(stop));
          const float* row = probs + at(hi, t) * n;
          AccumulateSquaredSum(&row, &scale[at(hi, t)], 1, prefix, acc + hi * prefix);
        }
      }
      break;
    case AttentionStat::kHeadGram:
      for (int64_t t = rows.begin; t < rows.end; ++t) {
        LAPROX_RETURN_IF_ERROR(CheckStop(stop));
        int64_t pair = G;
        for (int64_t a = 0; a < G; ++a) {
          const float* ra = probs + at(a, t) * n;
          const float sa = scale[at(a, t)];
          AccumulateSquaredSum(&ra, &sa, 1, prefix, acc + a * prefix);
          for (int64_t b = a + 1; b < G; ++b, ++pair) {
            const float* rb = probs + at(b, t) * n;
            AccumulateProduct(ra, rb, sa * scale[at(b, t)], prefix, acc + pair * prefix);
          }
        }
      }
      break;
  }
  return absl::OkStatus();
}

// Per-token value statistics over the prefix into ws.value ([F, prefix]); checks every value
// row of the head, window rows included, and that the values cannot overflow the scores
// (policy::CheckValueMagnitude; the statistics are then discarded).
absl::Status ValueStatistics(const RequestShape& shape, const PolicySpec& policy,
                             const HeadTask& task, const ScoreModes& modes, int64_t prefix,
                             ScoreWorkspace& ws) {
  const TensorView& values = task.inputs->values;
  const TensorName name{task.layer, "values"};
  const int64_t d = shape.head_dim, F = modes.factor_blocks, G = shape.group_size;
  if (modes.value == ValueStat::kNone) {
    return CheckRowsFinite(values, task.kv_head, 0, shape.n, name, ws.rows, nullptr, task.stop);
  }
  float max_values = 0.f;
  float* out = Sized(ws.value, std::max<int64_t>(F, 1) * prefix);
  // EXACT_BLOCK's cross forms v C_hh' (the other modes need no product buffer).
  const int64_t chunk = ValueChunk(task.l2_bytes, ValueFloats(modes, d, G));
  float* projected =
      modes.value == ValueStat::kExact ? Sized(ws.projected, chunk * F * d) : nullptr;
  // ||v T_f||^2 of the triangular blocks (factors.h): all F of them, or EXACT_BLOCK's G diagonal
  // forms v M_h v^T, packed once per task for the kernel.
  const int64_t triangles = modes.value == ValueStat::kExact ? G : F;
  float* packed = nullptr;
  if (modes.value_product()) {
    packed = Sized(ws.triangles, triangles * PackedTriangleSize(d));
    PackTriangles(task.factors + modes.first_block * d, task.factor_ld, d, triangles, packed);
  }
  for (int64_t i0 = 0; i0 < prefix; i0 += chunk) {
    LAPROX_RETURN_IF_ERROR(CheckStop(task.stop));
    const int64_t count = std::min(chunk, prefix - i0);
    RowBlock v;
    LAPROX_RETURN_IF_ERROR(
        LoadRows(values, task.kv_head, i0, count, name, ws.rows, &v, &max_values));
    if (modes.value == ValueStat::kNorm) {
      for (int64_t j = 0; j < count; ++j) {
        const float* row = v.data + j * v.ld;
        out[i0 + j] = std::sqrt(Dot(row, row, d));
      }
      continue;
    }
    // The triangular forms, then EXACT_BLOCK's cross forms v C_hh' v^T through the full
    // cross-Grams (one sgemm over their column range, a dot each). EXACT_BLOCK so costs G^2 d^2 / 2
    // multiply-adds per row: G d(d+1)/2 for the diagonal, G(G-1)/2 d^2 for the cross forms,
    // against G(G+1) d^2 / 2 when every form was a full d x d product.
    TriangularSquaredNorms(v.data, v.ld, count, d, packed, triangles, out + i0, prefix);
    if (modes.value != ValueStat::kExact) {
      for (int64_t f = 0; f < F; ++f) {
        float* norms = out + f * prefix + i0;
        for (int64_t j = 0; j < count; ++j) norms[j] = std::sqrt(norms[j]);
      }
      continue;
    }
    const int64_t cross = F - G;
    if (cross == 0) continue;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(count),
                static_cast<int>(cross * d), static_cast<int>(d), 1.f, v.data,
                static_cast<int>(v.ld), task.factors + (modes.first_block + G) * d,
                static_cast<int>(task.factor_ld), 0.f, projected, static_cast<int>(cross * d));
    for (int64_t j = 0; j < count; ++j) {
      const float* row = v.data + j * v.ld;
      for (int64_t p = 0; p < cross; ++p) {
        out[(G + p) * prefix + i0 + j] = Dot(projected + (j * cross + p) * d, row, d);
      }
    }
  }
  LAPROX_RETURN_IF_ERROR(CheckRowsFinite(values, task.kv_head, prefix, shape.n - prefix, name,
                                         ws.rows, &max_values, task.stop));
  return policy::CheckValueMagnitude(shape, policy, task.hidden_size, task.layer, task.kv_head,
                                     max_values, task.max_o_proj);
}

// r_i of the group-mean modes: mean_h ||v_i W_O^h|| (kPerHead), the one value statistic (||v_i||
// or ||v_i sum_h W_O^h||), or 1 without values.
float GroupValueFactor(ValueStat value, const float* val, int64_t prefix, int64_t G, int64_t i) {
  switch (value) {
    case ValueStat::kNone:
      return 1.f;
    case ValueStat::kPerHead: {
      float r = 0.f;
      for (int64_t h = 0; h < G; ++h) r += val[h * prefix + i];
      return r * (1.f / static_cast<float>(G));
    }
    case ValueStat::kNorm:
    case ValueStat::kSummed:
    case ValueStat::kExact:
      break;
  }
  return val[i];
}

// pool(c^h) for each head h of the group, c^h = ||A^h[:, i]|| * 2^k from the per-head diagonal
// statistics (blocks 0..G-1 of ws.attention): ws.head_pooled [G, prefix], valid in [begin,
// prefix) of each row (pool_target ATTENTION with per-head statistics).
const float* PoolPerHead(const PolicySpec& policy, int64_t G, int64_t prefix, int64_t begin,
                         ScoreWorkspace& ws) {
  const float* att = ws.attention.data();
  float* x = Sized(ws.pre_pool, prefix);
  float* pooled = Sized(ws.head_pooled, G * prefix);
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t i = 0; i < prefix; ++i) x[i] = std::sqrt(att[h * prefix + i]);
    Pool(policy.pooling, policy.pool_kernel, x, prefix, begin, pooled + h * prefix, ws.pool_sums);
  }
  return pooled;
}

}  // namespace

absl::Status ScoreHead(const RequestShape& shape, const PolicySpec& policy, const HeadTask& task,
                       ScoreWorkspace& ws, float* raw) {
  const int64_t G = shape.group_size;
  const int64_t prefix = shape.n - shape.window;  // pooled range: sinks and candidates
  const ScoreModes modes = ChooseScoreModes(policy, G);

  // The window rows in ranges (WindowRowsPerRange), so that ws.probs stays within
  // task.window_bytes; the first range comes before the value statistics, as the checks of the
  // attention inputs come before those of the values.
  const int64_t we = shape.window;
  const int64_t per_range = WindowRowsPerRange(shape, task.window_bytes);
  const int k = AttentionScaleExponent(we, G);
  Zeroed(ws.attention, AttentionStatisticCount(modes.attention, G) * prefix);
  for (int64_t t0 = 0; t0 < std::max<int64_t>(we, 1); t0 += per_range) {
    const WindowRows rows = {t0, std::min(we, t0 + per_range)};
    LAPROX_RETURN_IF_ERROR(WindowAttention(shape, task, rows, ws));
    if (t0 == 0) LAPROX_RETURN_IF_ERROR(ValueStatistics(shape, policy, task, modes, prefix, ws));
    if (prefix > 0) {
      LAPROX_RETURN_IF_ERROR(
          AttentionStatistics(shape, modes.attention, rows, prefix, k, task.stop, ws));
    }
  }
  if (prefix == 0) return absl::OkStatus();

  // The statistics are 2^(2k) times their value: combined in fp64 (a scaled statistic times a
  // value factor may exceed fp32) and unscaled by 2^-k after the square root.
  const float* att = ws.attention.data();
  const float* val = ws.value.data();
  float* x = Sized(ws.pre_pool, prefix);
  const int64_t begin = shape.sinks;
  const double unscale = std::ldexp(1.0, -k);
  const double group = static_cast<double>(G);
  const bool pool_attention = policy.EffectivePoolTarget() == PoolTarget::kAttention;
  switch (modes.attention) {
    case AttentionStat::kGroupMean: {
      // ATTENTION: pool the attention factor c, then multiply by the value factor r; SCORE:
      // pool c * r (the same without values).
      const bool multiply_after = pool_attention && modes.value != ValueStat::kNone;
      for (int64_t i = 0; i < prefix; ++i) {
        const double c = std::sqrt(double{att[i]}) * unscale / group;
        x[i] = static_cast<float>(
            multiply_after ? c : c * GroupValueFactor(modes.value, val, prefix, G, i));
      }
      Pool(policy.pooling, policy.pool_kernel, x, prefix, begin, raw, ws.pool_sums);
      if (multiply_after) {
        for (int64_t i = begin; i < prefix; ++i) {
          raw[i] *= GroupValueFactor(modes.value, val, prefix, G, i);
        }
      }
      return absl::OkStatus();
    }
    case AttentionStat::kPerHead:
      if (pool_attention) {
        // mean_h pool(||A^h col||) * ||v W_O^h||.
        const float* pooled = PoolPerHead(policy, G, prefix, begin, ws);
        for (int64_t i = begin; i < prefix; ++i) {
          double sum = 0.0;
          for (int64_t h = 0; h < G; ++h) {
            sum += double{pooled[h * prefix + i]} * val[h * prefix + i];
          }
          raw[i] = static_cast<float>(sum * unscale / group);
        }
        return absl::OkStatus();
      }
      // mean_h ||A^h col|| * ||v W_O^h||, then pool.
      for (int64_t i = 0; i < prefix; ++i) {
        double sum = 0.0;
        for (int64_t h = 0; h < G; ++h) {
          sum += std::sqrt(double{att[h * prefix + i]}) * val[h * prefix + i];
        }
        x[i] = static_cast<float>(sum * unscale / group);
      }
      break;
    case AttentionStat::kHeadGram:
      if (pool_attention) {
        // <A^h col, A^h' col> = rho_hh' c^h c^h' with c^h pooled and the correlation rho kept:
        // sum_h pool(c^h)^2 v M_h v^T + 2 sum_{h<h'} rho_hh' pool(c^h) pool(c^h') v C_hh' v^T.
        const float* pooled = PoolPerHead(policy, G, prefix, begin, ws);
        for (int64_t i = begin; i < prefix; ++i) {
          double sum = 0.0;
          for (int64_t h = 0; h < G; ++h) {
            const double c = pooled[h * prefix + i];
            sum += c * c * val[h * prefix + i];
          }
          for (int64_t a = 0, p = G; a < G; ++a) {
            for (int64_t b = a + 1; b < G; ++b, ++p) {
              const double norms = std::sqrt(double{att[a * prefix + i]} * att[b * prefix + i]);
              if (norms == 0.0) continue;  // rho = 0
              sum += 2.0 * (att[p * prefix + i] / norms) * pooled[a * prefix + i] *
                     pooled[b * prefix + i] * val[p * prefix + i];
            }
          }
          raw[i] = static_cast<float>(std::sqrt(std::max(sum, 0.0)) * unscale);
        }
        return absl::OkStatus();
      }
      // ||sum_h A^h col (outer) v W_O^h||_F^2 = sum_{h,h'} <A^h col, A^h' col> v C_hh' v^T.
      for (int64_t i = 0; i < prefix; ++i) {
        double sum = 0.0;
        for (int64_t h = 0; h < G; ++h) sum += double{att[h * prefix + i]} * val[h * prefix + i];
        for (int64_t p = G; p < modes.factor_blocks; ++p) {
          sum += 2.0 * att[p * prefix + i] * val[p * prefix + i];
        }
        x[i] = static_cast<float>(std::sqrt(std::max(sum, 0.0)) * unscale);
      }
      break;
  }
  Pool(policy.pooling, policy.pool_kernel, x, prefix, begin, raw, ws.pool_sums);
  return absl::OkStatus();
}

}  // namespace laprox::kernels::cpu
