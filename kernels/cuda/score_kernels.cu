#include <cstdint>

#include "cuda/load.cuh"
#include "cuda/score_kernels.h"

namespace laprox::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a power of two (BlockReduce)
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ int Lane() { return static_cast<int>(threadIdx.x % 32); }
__device__ __forceinline__ int64_t GlobalWarp() {
  return int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
}
__device__ __forceinline__ int64_t WarpCount() { return int64_t{gridDim.x} * kWarpsPerBlock; }
__device__ __forceinline__ int64_t GlobalThread() {
  return int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t ThreadCount() { return int64_t{gridDim.x} * blockDim.x; }

// Butterfly sum over the warp: every lane gets the same value, in a fixed order.
__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Fixed-shape tree reduction over the block (blockDim.x == kThreads); every thread gets the
// result, and `shared` may be reused right after.
template <typename T, typename Op>
__device__ T BlockReduce(T value, T* shared, Op op) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] = op(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const T result = shared[0];
  __syncthreads();
  return result;
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ double operator()(double a, double b) const { return a + b; }
};

// One warp per output row (a, b), lanes along c.
__global__ void GatherKernel(DeviceView t, int64_t row0, int64_t col0, int64_t count1,
                             int64_t count2, int64_t rows, float scale, float* out, int64_t out_s0,
                             int64_t out_s1) {
  for (int64_t row = GlobalWarp(); row < rows; row += WarpCount()) {
    const int64_t a = row / count1, b = row % count1;
    float* dst = out + a * out_s0 + b * out_s1;
    for (int64_t c = Lane(); c < count2; c += 32) dst[c] = LoadAt(t, a, row0 + b, col0 + c) * scale;
  }
}

// One block per window row.
__global__ void RowSoftmaxStatsKernel(const float* logits, int64_t rows, int64_t ld, int64_t col0,
                                      int64_t count, int64_t visible_base, int64_t window,
                                      bool first, float* row_max, double* row_sum,
                                      float* row_scale) {
  __shared__ float max_scratch[kThreads];
  __shared__ double sum_scratch[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // Keys j <= visible_base + t are visible: columns [0, visible) of this chunk. The bound is
    // the same for the whole block, so the skip below does not split the block.
    const int64_t last = visible_base + r % window;  // last visible key
    const int64_t visible = min(count, last + 1 - col0);
    if (visible <= 0) continue;
    const float* row = logits + r * ld;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < visible; j += kThreads) m = fmaxf(m, row[j]);
    m = BlockReduce(m, max_scratch, MaxOp());
    double s = 0.0;
    for (int64_t j = threadIdx.x; j < visible; j += kThreads) {
      s += static_cast<double>(expf(row[j] - m));
    }
    s = BlockReduce(s, sum_scratch, SumOp());
    if (threadIdx.x == 0) {
      if (first) {
        row_max[r] = m;
        row_sum[r] = s;
      } else {
        const float old_max = row_max[r];
        const float new_max = fmaxf(old_max, m);
        row_sum[r] = row_sum[r] * exp(static_cast<double>(old_max) - new_max) +
                     s * exp(static_cast<double>(m) - new_max);
        row_max[r] = new_max;
      }
      row_scale[r] = static_cast<float>(1.0 / row_sum[r]);
    }
  }
}

__global__ void ExpRowsKernel(float* x, int64_t rows, int64_t ld, int64_t count, const float* shift,
                              const float* scale) {
  const int64_t total = rows * count;
  for (int64_t e = GlobalThread(); e < total; e += ThreadCount()) {
    const int64_t r = e / count, j = e % count;
    float* p = x + r * ld + j;
    // At most 1 before the scale: an engine LSE below a logit cannot overflow (the CPU's rule).
    *p = expf(fminf(*p - shift[r], 0.f)) * (scale != nullptr ? scale[r] : 1.f);
  }
}

// One thread per (group, token); window rows and heads in a fixed order. Squares and products
// in fp64 (attention below ~1e-19 would square to 0 in fp32), as the CPU backend.
__global__ void AttentionStatisticsKernel(const float* probs, int64_t ld, int64_t kv_heads,
                                          int64_t group, int64_t window, int64_t col0,
                                          int64_t count, AttentionStat kind, double* att,
                                          int64_t att_ld) {
  const int64_t stats = kind == AttentionStat::kGroupMean ? 1
                        : kind == AttentionStat::kPerHead ? group
                                                          : group * (group + 1) / 2;
  const int64_t total = kv_heads * count;
  for (int64_t e = GlobalThread(); e < total; e += ThreadCount()) {
    const int64_t g = e / count, j = e % count;
    // Row (h * window + t) of the group, column j.
    const float* p = probs + g * group * window * ld + j;
    double* out = att + g * stats * att_ld + col0 + j;
    if (kind == AttentionStat::kGroupMean) {
      double acc = 0.0;
      for (int64_t t = 0; t < window; ++t) {
        double s = 0.0;
        for (int64_t h = 0; h < group; ++h) s += p[(h * window + t) * ld];
        acc += s * s;
      }
      out[0] = acc;
      continue;
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* ph = p + h * window * ld;
      double acc = 0.0;
      for (int64_t t = 0; t < window; ++t) {
        const double v = ph[t * ld];
        acc += v * v;
      }
      out[h * att_ld] = acc;
    }
    if (kind != AttentionStat::kHeadGram) continue;
    int64_t pair = group;
    for (int64_t a = 0; a < group; ++a) {
      const float* pa = p + a * window * ld;
      for (int64_t b = a + 1; b < group; ++b, ++pair) {
        const float* pb = p + b * window * ld;
        double acc = 0.0;
        for (int64_t t = 0; t < window; ++t) acc += double{pa[t * ld]} * pb[t * ld];
        out[pair * att_ld] = acc;
      }
    }
  }
}

// One warp per (group, token).
__global__ void ValueNormsKernel(DeviceView v, int64_t kv_heads, int64_t count, float* out,
                                 int64_t out_ld) {
  const int64_t d = v.shape[2];
  for (int64_t item = GlobalWarp(); item < kv_heads * count; item += WarpCount()) {
    const int64_t g = item / count, i = item % count;
    float s = 0.f;
    for (int64_t k = Lane(); k < d; k += 32) {
      const float x = LoadAt(v, g, i, k);
      s += x * x;
    }
    s = WarpSum(s);
    if (Lane() == 0) out[g * out_ld + i] = sqrtf(s);
  }
}

// One warp per (group, token), the forms in turn.
__global__ void QuadraticFormsKernel(const float* projected, int64_t projected_head_stride,
                                     const float* v, int64_t v_ld, int64_t v_head_stride,
                                     int64_t kv_heads, int64_t col0, int64_t count, int64_t forms,
                                     int64_t d, bool raw, float* out, int64_t out_ld) {
  for (int64_t item = GlobalWarp(); item < kv_heads * count; item += WarpCount()) {
    const int64_t g = item / count, j = item % count;
    const float* pj = projected + g * projected_head_stride + j * forms * d;
    const float* vj = v + g * v_head_stride + j * v_ld;
    for (int64_t f = 0; f < forms; ++f) {
      float s = 0.f;
      for (int64_t k = Lane(); k < d; k += 32) s += pj[f * d + k] * vj[k];
      s = WarpSum(s);
      // Quadratic forms of PSD matrices are >= 0 up to rounding; cross terms may be negative.
      if (Lane() == 0) out[(g * forms + f) * out_ld + col0 + j] = raw ? s : sqrtf(fmaxf(s, 0.f));
    }
  }
}

// The group-mean modes' value factor r of one token: v points at val[g][0][i].
__device__ __forceinline__ float ValueFactor(const float* v, int64_t prefix, int64_t group,
                                             ValueStat value) {
  switch (value) {
    case ValueStat::kNone:
      return 1.f;
    case ValueStat::kPerHead: {
      float r = 0.f;
      for (int64_t h = 0; h < group; ++h) r += v[h * prefix];
      return r * (1.f / static_cast<float>(group));
    }
    default:
      return v[0];
  }
}

// pool(x)_i over x[0, prefix) (x: one row).
__device__ __forceinline__ float PoolAt(const float* x, int64_t i, int64_t prefix, PoolKind pool,
                                        int64_t kernel) {
  const int64_t half = kernel / 2;
  const int64_t lo = max(int64_t{0}, i - half), hi = min(prefix - 1, i + half);
  switch (pool) {
    case PoolKind::kMax: {
      float best = x[i];
      for (int64_t j = lo; j <= hi; ++j) best = fmaxf(best, x[j]);
      return best;
    }
    case PoolKind::kAvg:
    case PoolKind::kAvgPeak: {
      // Zero padding counted: always divided by the kernel size (the CPU adds each window's
      // own terms in fp64 too). AVG_PEAK: never below the position's own value.
      double sum = 0.0;
      for (int64_t j = lo; j <= hi; ++j) sum += static_cast<double>(x[j]);
      const float avg = static_cast<float>(sum / static_cast<double>(kernel));
      return pool == PoolKind::kAvgPeak ? fmaxf(avg, x[i]) : avg;
    }
    case PoolKind::kNone:
      break;
  }
  return x[i];
}

// In fp64 from the fp64 attention statistics, as the CPU backend (score.cc).
__global__ void PrePoolKernel(const double* att, const float* val, int64_t kv_heads, int64_t group,
                              int64_t stats, int64_t forms, int64_t prefix, AttentionStat kind,
                              ValueStat value, PoolPlacement placement, float* x) {
  const double groups = static_cast<double>(group);
  const bool head_rows =
      placement == PoolPlacement::kAttention && kind != AttentionStat::kGroupMean;
  for (int64_t e = GlobalThread(); e < kv_heads * prefix; e += ThreadCount()) {
    const int64_t g = e / prefix, i = e % prefix;
    const double* a = att + g * stats * prefix + i;
    const float* v = val + g * forms * prefix + i;
    if (head_rows) {  // each head's attention norm, pooled apart
      for (int64_t h = 0; h < group; ++h) {
        x[(g * group + h) * prefix + i] = static_cast<float>(sqrt(a[h * prefix]));
      }
      continue;
    }
    switch (kind) {
      case AttentionStat::kGroupMean: {
        const double c = sqrt(a[0]) / groups;
        x[e] = static_cast<float>(
            placement == PoolPlacement::kScore ? c * ValueFactor(v, prefix, group, value) : c);
        break;
      }
      case AttentionStat::kPerHead: {
        double sum = 0.0;
        for (int64_t h = 0; h < group; ++h) sum += sqrt(a[h * prefix]) * v[h * prefix];
        x[e] = static_cast<float>(sum / groups);
        break;
      }
      case AttentionStat::kHeadGram: {
        // ||sum_h A^h col (outer) v W_O^h||_F^2 = sum_{h,h'} <A^h col, A^h' col> v C_hh' v^T.
        double sum = 0.0;
        for (int64_t h = 0; h < group; ++h) sum += a[h * prefix] * v[h * prefix];
        for (int64_t p = group; p < stats; ++p) sum += 2.0 * a[p * prefix] * v[p * prefix];
        x[e] = static_cast<float>(sqrt(fmax(sum, 0.0)));
        break;
      }
    }
  }
}

__global__ void PoolScoreKernel(const float* x, const float* val, int64_t rows, int64_t group,
                                int64_t forms, int64_t prefix, int64_t begin, PoolKind pool,
                                int64_t kernel, ValueStat value, float* out, int64_t out_stride) {
  const int64_t len = prefix - begin;
  for (int64_t e = GlobalThread(); e < rows * len; e += ThreadCount()) {
    const int64_t r = e / len, i = begin + e % len;
    float pooled = PoolAt(x + r * prefix, i, prefix, pool, kernel);
    if (value != ValueStat::kNone) {
      pooled *= ValueFactor(val + r * forms * prefix + i, prefix, group, value);
    }
    out[r * out_stride + i] = pooled;
  }
}

// One thread per (group, token), heads and pairs in a fixed order, fp64 as the CPU backend.
__global__ void CombinePooledHeadsKernel(const float* pooled, const double* att, const float* val,
                                         int64_t kv_heads, int64_t group, int64_t stats,
                                         int64_t forms, int64_t prefix, int64_t begin,
                                         AttentionStat kind, float* raw, int64_t raw_head_stride) {
  const int64_t len = prefix - begin;
  for (int64_t e = GlobalThread(); e < kv_heads * len; e += ThreadCount()) {
    const int64_t g = e / len, i = begin + e % len;
    const float* c = pooled + g * group * prefix + i;
    const double* a = att + g * stats * prefix + i;
    const float* v = val + g * forms * prefix + i;
    double sum = 0.0;
    if (kind == AttentionStat::kPerHead) {
      for (int64_t h = 0; h < group; ++h) sum += static_cast<double>(c[h * prefix]) * v[h * prefix];
      raw[g * raw_head_stride + i] = static_cast<float>(sum / static_cast<double>(group));
      continue;
    }
    // <A^h col, A^h' col> = rho_hh' c^h c^h' with c^h pooled and the correlation kept.
    for (int64_t h = 0; h < group; ++h) {
      const double ch = c[h * prefix];
      sum += ch * ch * v[h * prefix];
    }
    int64_t p = group;
    for (int64_t ha = 0; ha < group; ++ha) {
      for (int64_t hb = ha + 1; hb < group; ++hb, ++p) {
        const double norms = sqrt(a[ha * prefix] * a[hb * prefix]);
        if (norms == 0.0) continue;  // rho = 0
        sum += 2.0 * (a[p * prefix] / norms) * c[ha * prefix] * c[hb * prefix] * v[p * prefix];
      }
    }
    raw[g * raw_head_stride + i] = static_cast<float>(sqrt(fmax(sum, 0.0)));
  }
}

}  // namespace

cudaError_t LaunchGather(const KernelTensor& t, int64_t row0, int64_t col0, int64_t count0,
                         int64_t count1, int64_t count2, float scale, float* out, int64_t out_s0,
                         int64_t out_s1, cudaStream_t stream) {
  const int64_t rows = count0 * count1;
  if (rows <= 0 || count2 <= 0) return cudaSuccess;
  GatherKernel<<<GridBlocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
      ToDeviceView(t), row0, col0, count1, count2, rows, scale, out, out_s0, out_s1);
  return cudaGetLastError();
}

cudaError_t LaunchRowSoftmaxStats(const float* logits, int64_t rows, int64_t ld, int64_t col0,
                                  int64_t count, int64_t visible_base, int64_t window, bool first,
                                  float* row_max, double* row_sum, float* row_scale,
                                  cudaStream_t stream) {
  if (rows <= 0 || count <= 0 || window <= 0) return cudaSuccess;
  RowSoftmaxStatsKernel<<<GridBlocks(rows, 1), kThreads, 0, stream>>>(
      logits, rows, ld, col0, count, visible_base, window, first, row_max, row_sum, row_scale);
  return cudaGetLastError();
}

cudaError_t LaunchExpRows(float* x, int64_t rows, int64_t ld, int64_t count, const float* shift,
                          const float* scale, cudaStream_t stream) {
  if (rows <= 0 || count <= 0) return cudaSuccess;
  ExpRowsKernel<<<GridBlocks(rows * count, kThreads), kThreads, 0, stream>>>(x, rows, ld, count,
                                                                             shift, scale);
  return cudaGetLastError();
}

cudaError_t LaunchAttentionStatistics(const float* probs, int64_t ld, int64_t kv_heads,
                                      int64_t group, int64_t window, int64_t col0, int64_t count,
                                      AttentionStat kind, double* att, int64_t att_ld,
                                      cudaStream_t stream) {
  if (kv_heads <= 0 || count <= 0) return cudaSuccess;
  AttentionStatisticsKernel<<<GridBlocks(kv_heads * count, kThreads), kThreads, 0, stream>>>(
      probs, ld, kv_heads, group, window, col0, count, kind, att, att_ld);
  return cudaGetLastError();
}

cudaError_t LaunchValueNorms(const KernelTensor& v, int64_t kv_heads, int64_t count, float* out,
                             int64_t out_ld, cudaStream_t stream) {
  if (kv_heads <= 0 || count <= 0) return cudaSuccess;
  ValueNormsKernel<<<GridBlocks(kv_heads * count, kWarpsPerBlock), kThreads, 0, stream>>>(
      ToDeviceView(v), kv_heads, count, out, out_ld);
  return cudaGetLastError();
}

cudaError_t LaunchQuadraticForms(const float* projected, int64_t projected_head_stride,
                                 const float* v, int64_t v_ld, int64_t v_head_stride,
                                 int64_t kv_heads, int64_t col0, int64_t count, int64_t forms,
                                 int64_t d, bool raw, float* out, int64_t out_ld,
                                 cudaStream_t stream) {
  if (kv_heads <= 0 || count <= 0 || forms <= 0) return cudaSuccess;
  QuadraticFormsKernel<<<GridBlocks(kv_heads * count, kWarpsPerBlock), kThreads, 0, stream>>>(
      projected, projected_head_stride, v, v_ld, v_head_stride, kv_heads, col0, count, forms, d,
      raw, out, out_ld);
  return cudaGetLastError();
}

cudaError_t LaunchPrePool(const double* att, const float* val, int64_t kv_heads, int64_t group,
                          int64_t stats, int64_t forms, int64_t prefix, AttentionStat kind,
                          ValueStat value, PoolPlacement placement, float* x, cudaStream_t stream) {
  if (kv_heads <= 0 || prefix <= 0) return cudaSuccess;
  PrePoolKernel<<<GridBlocks(kv_heads * prefix, kThreads), kThreads, 0, stream>>>(
      att, val, kv_heads, group, stats, forms, prefix, kind, value, placement, x);
  return cudaGetLastError();
}

cudaError_t LaunchPoolScore(const float* x, const float* val, int64_t rows, int64_t group,
                            int64_t forms, int64_t prefix, int64_t begin, PoolKind pool,
                            int64_t kernel, ValueStat value, float* out, int64_t out_stride,
                            cudaStream_t stream) {
  if (rows <= 0 || begin >= prefix) return cudaSuccess;
  PoolScoreKernel<<<GridBlocks(rows * (prefix - begin), kThreads), kThreads, 0, stream>>>(
      x, val, rows, group, forms, prefix, begin, pool, kernel, value, out, out_stride);
  return cudaGetLastError();
}

cudaError_t LaunchCombinePooledHeads(const float* pooled, const double* att, const float* val,
                                     int64_t kv_heads, int64_t group, int64_t stats, int64_t forms,
                                     int64_t prefix, int64_t begin, AttentionStat kind, float* raw,
                                     int64_t raw_head_stride, cudaStream_t stream) {
  if (kv_heads <= 0 || begin >= prefix) return cudaSuccess;
  CombinePooledHeadsKernel<<<GridBlocks(kv_heads * (prefix - begin), kThreads), kThreads, 0,
                             stream>>>(pooled, att, val, kv_heads, group, stats, forms, prefix,
                                       begin, kind, raw, raw_head_stride);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
