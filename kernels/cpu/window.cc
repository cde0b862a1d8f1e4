#include "cpu/window.h"

#include <algorithm>
#include <cmath>

#include <unistd.h>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cpu/logits.h"
#include "cpu/rows.h"
#include "cpu/vector_ops.h"
#include "policy/magnitude.h"

namespace laprox::kernels::cpu {
namespace {

// Tolerance on the row sums of a window attention row given by the engine (bf16 rows).
constexpr double kRowSumTolerance = 1e-2;

// Fills ws.probs columns [0, prefix) and ws.row_scale with the window rows `range` of the group's
// attention given by the engine, checking those rows of the group's heads and, with the first
// range, the rows before the window.
absl::Status LoadGivenAttention(const RequestShape& shape, const HeadTask& task, WindowRows range,
                                int64_t prefix, ScoreWorkspace& ws) {
  const TensorView& attention = task.inputs->window_attention;
  const int64_t n = shape.n, we = shape.window, wq = shape.window_rows, G = shape.group_size;
  const int64_t count = range.count();
  const TensorName name{task.layer, "window_attention"};
  float* probs = Sized(ws.probs, G * count * n);
  float* row_scale = Sized(ws.row_scale, G * count);
  const int64_t first_row = range.begin == 0 ? 0 : wq - we + range.begin;
  for (int64_t hi = 0; hi < G; ++hi) {
    const int64_t h = task.kv_head * G + hi;
    for (int64_t row = first_row; row < wq - we + range.end; ++row) {
      LAPROX_RETURN_IF_ERROR(CheckStop(task.stop));
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
      if (t < range.begin) continue;
      const int64_t r = hi * count + t - range.begin;
      std::copy(block.data, block.data + prefix, probs + r * n);
      row_scale[r] = 1.f;
    }
  }
  return absl::OkStatus();
}

// KVPRESS_COMPAT rounds the logits q . k to the model dtype, where finite inputs may overflow
// (fp16 ends at 65504): INVALID_ARGUMENT naming the first infinite logit of window row t of
// query head hi of the group.
absl::Status CompatLogitOverflow(const RequestShape& shape, const HeadTask& task, int64_t hi,
                                 int64_t t, const float* row, int64_t visible) {
  const int64_t h = task.kv_head * shape.group_size + hi;
  const int64_t query_row = shape.window_rows - shape.window + t;
  int64_t j = 0;
  while (j + 1 < visible && std::isfinite(row[j])) ++j;
  return absl::InvalidArgumentError(absl::StrCat(
      "layers[", task.layer, "].keys: the logit q . k of window_queries [", h, ", ", query_row,
      "] and keys [", task.kv_head, ", ", j, "] is beyond the range of ",
      DTypeName(task.compat_dtype),
      " (KVPRESS_COMPAT computes the logits in the keys' dtype): keys and window_queries are "
      "finite but too large"));
}

// Computes the window rows `range` of the group's attention from queries and keys into ws.probs
// (unnormalised, columns [0, prefix) valid) and ws.row_scale. Every query, key and LSE value is
// checked whatever the range, so that each range refuses bad inputs alike.
absl::Status ComputeAttention(const RequestShape& shape, const HeadTask& task, WindowRows range,
                              int64_t prefix, ScoreWorkspace& ws) {
  const LayerInputs& in = *task.inputs;
  const int64_t n = shape.n, d = shape.head_dim, we = shape.window, wq = shape.window_rows,
                G = shape.group_size, count = range.count(), rows = G * count;
  float* queries = Sized(ws.queries, rows * d);
  float max_queries = 0.f, max_keys = 0.f;  // for the logit bound
  for (int64_t hi = 0; hi < G; ++hi) {
    const int64_t h = task.kv_head * G + hi;
    RowBlock block;
    LAPROX_RETURN_IF_ERROR(LoadRows(in.window_queries, h, 0, wq, {task.layer, "window_queries"},
                                    ws.rows, &block, &max_queries));
    for (int64_t t = range.begin; t < range.end; ++t) {
      const float* src = block.data + (wq - we + t) * block.ld;
      float* dst = queries + (hi * count + t - range.begin) * d;
      if (task.kvpress_compat) {
        std::copy(src, src + d, dst);  // scaled after the logits are rounded
      } else {
        for (int64_t k = 0; k < d; ++k) dst[k] = src[k] * task.scale;
      }
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
        if (t >= range.begin && t < range.end) lse[hi * count + t - range.begin] = v;
      }
    }
  }

  // Logits of every key a window row may see; with the engine's LSE only the prefix is needed
  // (window keys are still checked for NaN/Inf).
  const bool use_lse = shape.lse_given && !task.kvpress_compat;
  const int64_t key_end = use_lse ? prefix : n;
  float* probs = Sized(ws.probs, rows * n);
  const int64_t key_chunk = KeyChunk(task.l2_bytes, d);
  for (int64_t j0 = 0; j0 < key_end; j0 += key_chunk) {
    LAPROX_RETURN_IF_ERROR(CheckStop(task.stop));
    const int64_t chunk = std::min(key_chunk, key_end - j0);
    RowBlock keys;
    LAPROX_RETURN_IF_ERROR(LoadRows(in.keys, task.kv_head, j0, chunk, {task.layer, "keys"}, ws.rows,
                                    &keys, &max_keys));
    if (rows == 0) continue;  // no window (STREAMING_LLM): the keys are only checked
    if (!QueryKeyLogits(queries, d, rows, keys.data, keys.ld, chunk, d, probs + j0, n,
                        ws.packed_keys)) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(chunk), static_cast<int>(d), 1.f, queries, static_cast<int>(d),
                  keys.data, static_cast<int>(keys.ld), 0.f, probs + j0, static_cast<int>(n));
    }
  }
  if (key_end < n) {
    LAPROX_RETURN_IF_ERROR(CheckRowsFinite(in.keys, task.kv_head, key_end, n - key_end,
                                           {task.layer, "keys"}, ws.rows, &max_keys, task.stop));
  }
  if (rows == 0) return absl::OkStatus();
  // Finite queries and keys can still give infinite logits: refuse before the softmax reads them.
  const double logit_scale =
      task.kvpress_compat ? 1.0 / std::sqrt(static_cast<double>(d)) : double{task.scale};
  LAPROX_RETURN_IF_ERROR(
      policy::CheckLogitMagnitude(task.layer, task.kv_head, d, logit_scale, max_queries, max_keys));

  float* row_scale = Sized(ws.row_scale, rows);
  // kvpress: matmul(q, k^T) / math.sqrt(head_dim), each op's output in the model dtype.
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(d)));
  for (int64_t r = 0; r < rows; ++r) {
    LAPROX_RETURN_IF_ERROR(CheckStop(task.stop));
    const int64_t t = range.begin + r % count;
    float* row = probs + r * n;
    if (use_lse) {
      ExpInPlace(row, prefix, lse[r]);
      row_scale[r] = 1.f;
    } else {
      // Causal: window row t sees keys j <= n - we + t.
      const int64_t visible = n - we + t + 1;
      if (task.kvpress_compat) {
        RoundTo(task.compat_dtype, row, visible);
        if (!AllFinite(row, visible)) {
          return CompatLogitOverflow(shape, task, r / count, t, row, visible);
        }
        for (int64_t j = 0; j < visible; ++j) row[j] /= sqrt_d;
        RoundTo(task.compat_dtype, row, visible);
      }
      const double sum = ExpShiftedInPlace(row, visible);
      row_scale[r] = static_cast<float>(1.0 / sum);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WindowAttention(const RequestShape& shape, const HeadTask& task, WindowRows rows,
                             ScoreWorkspace& ws) {
  const int64_t prefix = shape.n - shape.window;
  if (!shape.attention_given) return ComputeAttention(shape, task, rows, prefix, ws);
  LAPROX_RETURN_IF_ERROR(LoadGivenAttention(shape, task, rows, prefix, ws));
  // Keys are not needed with the engine's attention, but a NaN/Inf in any input rejects the
  // request (docs/design.md §13), as the CUDA backend's input check does: once, with the first
  // range.
  if (rows.begin > 0) return absl::OkStatus();
  return CheckRowsFinite(task.inputs->keys, task.kv_head, 0, shape.n, {task.layer, "keys"}, ws.rows,
                         nullptr, task.stop);
}

int64_t L2CacheBytes() {
  const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? bytes : int64_t{1} << 20;
}

namespace {

// The largest power of two <= max(x, 1).
int64_t FloorPowerOfTwo(int64_t x) {
  int64_t p = 1;
  while (p <= x / 2) p *= 2;
  return p;
}

// Rows of `floats` fp32 values each that fill at most 1/16 of L2, a power of two in [lo, hi].
int64_t ChunkRows(int64_t l2_bytes, int64_t floats, int64_t lo, int64_t hi) {
  return std::clamp(FloorPowerOfTwo(l2_bytes / (16 * 4 * std::max<int64_t>(floats, 1))), lo, hi);
}

}  // namespace

int64_t KeyChunk(int64_t l2_bytes, int64_t d) {
  // The SmolLM2 4K sgemm path on the 2026-11-30 machine (512 KiB L2): 1024 keys ~15% faster
  // than 256.
  const int64_t least = UseAvx512() ? 128 : 1024;
  return ChunkRows(l2_bytes, d, least, 4096);
}

int64_t ValueChunk(int64_t l2_bytes, int64_t value_floats) {
  return ChunkRows(l2_bytes, value_floats, 32, 2048);
}

int64_t WindowRowsPerRange(const RequestShape& shape, int64_t window_bytes) {
  const int64_t we = std::max<int64_t>(shape.window, 1);
  const int64_t per_row = 4 * int64_t{shape.group_size} * std::max<int64_t>(shape.n, 1);
  const int64_t fit = std::clamp<int64_t>(window_bytes / per_row, 1, we);
  const int64_t ranges = (we + fit - 1) / fit;
  return (we + ranges - 1) / ranges;
}

void RoundTo(DType dtype, float* x, int64_t count) {
  if (dtype == DType::kBF16) RoundToBf16(x, count);
  if (dtype == DType::kF16) RoundToF16(x, count);
}

// out[i] for i in [begin, len) = pool(x)_i over x[0, len) (SEMANTICS.md, "pool").
void Pool(Pooling kind, int64_t kernel, const float* x, int64_t len, int64_t begin, float* out,
          std::vector<double>& sums) {
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
    case Pooling::kAvg:
    case Pooling::kAvgPeak: {
      // Window sums without a subtraction (van Herk / Gil-Werman blocks, as for a running max):
      // cut the zero-padded array y[p] = x[p - half] into blocks of `kernel` positions. The window
      // of output i is y[i, i + kernel): it starts in some block and, unless it is that block,
      // ends in the next one, so its sum is the sum of y from i to the end of i's block plus the
      // sum of y from the start of the next block to i + kernel - 1. Both come from running sums
      // inside one block, so every window adds only its own terms.
      const int64_t padded = len + 2 * half;
      double* y = Sized(sums, 3 * padded);
      double* prefix = y + padded;
      double* suffix = prefix + padded;
      std::fill(y, y + half, 0.0);
      for (int64_t i = 0; i < len; ++i) y[half + i] = x[i];
      std::fill(y + half + len, y + padded, 0.0);
      for (int64_t b0 = 0; b0 < padded; b0 += kernel) {
        const int64_t b1 = std::min(padded, b0 + kernel);
        double run = 0.0;
        for (int64_t p = b0; p < b1; ++p) prefix[p] = run += y[p];
        run = 0.0;
        for (int64_t p = b1 - 1; p >= b0; --p) suffix[p] = run += y[p];
      }
      const double k = static_cast<double>(kernel);
      const bool peak = kind == Pooling::kAvgPeak;
      for (int64_t i = begin; i < len; ++i) {
        const double sum = suffix[i] + (i % kernel == 0 ? 0.0 : prefix[i + kernel - 1]);
        const float avg = static_cast<float>(sum / k);
        out[i] = peak ? std::max(avg, x[i]) : avg;
      }
      break;
    }
  }
}

}  // namespace laprox::kernels::cpu
