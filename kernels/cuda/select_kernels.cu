// Kernels and launchers of the device selection; contracts in select_kernels.h.
//
// Index arithmetic: flat indices and candidate indices are < 2^32 (select_kernels.h), so they
// are computed in uint32; loop counters are uint64 so that `i += stride` cannot wrap.
#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/util_type.cuh>

#include "cuda/select_kernels.h"

namespace laprox::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 1u << 16;  // grid-stride loops cover the rest
constexpr uint64_t kSentinel = ~uint64_t{0};
constexpr uint32_t kHistogramTile = 4096;  // candidates per block and histogram pass

// kThreshold: select the eligible keys whose bits at and above `shift` are <= the prefix's.
enum SelectMode : int32_t { kSearching = 0, kNone = 1, kThreshold = 2 };

unsigned BlocksFor(uint64_t items) {
  const uint64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

unsigned CappedBlocks(uint64_t blocks) {
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

// Bits needed for values 0..value (value >= 1 gives >= 1).
int BitWidth(uint64_t value) {
  int bits = 0;
  while (value != 0) {
    ++bits;
    value >>= 1;
  }
  return bits;
}

// The key index field: strictly more bits than needed for j < C, so that a real key is never
// all-ones in its low bits (the sort path's sentinel stays strictly last).
int IndexBits(uint64_t candidate_total) { return BitWidth(candidate_total); }

// The histogram select resolves 8 bits per pass: the index field is rounded up to whole bytes.
int HistogramIndexBits(uint64_t candidate_total) {
  return (IndexBits(candidate_total) + 7) / 8 * 8;
}

__device__ __forceinline__ uint64_t Min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// Flat index of candidate j.
__device__ __forceinline__ uint32_t CandidateFlat(const SelectGeometry& g, uint32_t j) {
  const uint32_t row = j / g.candidates;
  return row * g.n + g.sinks + (j - row * g.candidates);
}

// Unsigned key whose ascending order is the descending order of `score`; -0 and +0 map to the
// same key (they compare equal on the CPU).
__device__ __forceinline__ uint32_t DescendingScoreKey(float score) {
  uint32_t bits = __float_as_uint(score);
  if (score == 0.0f) bits = 0;
  const uint32_t ascending = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// Unique selection key of candidate j: ascending key order = score descending, then j (= flat
// index) ascending. index_bits <= 32.
__device__ __forceinline__ uint64_t SelectionKey(float score, uint32_t j, int index_bits) {
  return (static_cast<uint64_t>(DescendingScoreKey(score)) << index_bits) | j;
}

// Whether the bits of `key` at and above `bit` equal / are <= those of `prefix`.
__device__ __forceinline__ bool HighBitsEqual(uint64_t key, uint64_t prefix, int bit) {
  return bit >= 64 || (key >> bit) == (prefix >> bit);
}
__device__ __forceinline__ bool HighBitsAtMost(uint64_t key, uint64_t prefix, int bit) {
  return bit >= 64 || (key >> bit) <= (prefix >> bit);
}

// ---- Layer sums and scores ----------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    LayerPartialSumsKernel(SelectGeometry g, const float* __restrict__ raw,
                           double* __restrict__ partials) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const uint64_t per_layer = uint64_t{g.num_kv_heads} * g.candidates;
  const uint64_t chunk = (per_layer + kLayerSumSlots - 1) / kLayerSumSlots;
  const uint64_t slots = uint64_t{g.num_layers} * kLayerSumSlots;
  for (uint64_t v = blockIdx.x; v < slots; v += gridDim.x) {
    const uint32_t layer = static_cast<uint32_t>(v / kLayerSumSlots);
    const uint64_t slot = v % kLayerSumSlots;
    const uint64_t begin = Min64(per_layer, slot * chunk);
    const uint64_t end = Min64(per_layer, begin + chunk);
    double sum = 0.0;
    for (uint64_t jl = begin + threadIdx.x; jl < end; jl += kThreads) {
      const uint32_t j = static_cast<uint32_t>(jl);  // < per_layer <= C < 2^32
      const uint32_t head = j / g.candidates;
      const uint32_t row = layer * g.num_kv_heads + head;
      const uint32_t flat = row * g.n + g.sinks + (j - head * g.candidates);
      sum += static_cast<double>(raw[flat]);
    }
    const double block_sum = Reduce(temp).Sum(sum);
    if (threadIdx.x == 0) partials[v] = block_sum;
    __syncthreads();  // temp is reused by the next slot
  }
}

__global__ void LayerSumsKernel(uint32_t num_layers, const double* __restrict__ partials,
                                double* __restrict__ layer_sums) {
  for (uint64_t l = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; l < num_layers;
       l += uint64_t{gridDim.x} * blockDim.x) {
    double sum = 0.0;
    for (uint32_t s = 0; s < kLayerSumSlots; ++s) sum += partials[l * kLayerSumSlots + s];
    layer_sums[l] = sum;
  }
}

__global__ void __launch_bounds__(kThreads)
    NormalizeScoresKernel(SelectGeometry g, const float* __restrict__ raw,
                          const double* __restrict__ layer_sums, bool raw_scores,
                          float* __restrict__ scores, uint8_t* __restrict__ kept,
                          unsigned long long* __restrict__ first_non_finite) {
  const uint64_t total = uint64_t{g.num_layers} * g.num_kv_heads * g.n;
  unsigned long long bad = ~0ull;  // this thread's lowest non-finite candidate (visited in order)
  const double uniform_score =
      g.candidates > 0 ? 1.0 / static_cast<double>(uint64_t{g.num_kv_heads} * g.candidates) : 0.0;
  for (uint64_t f64 = blockIdx.x * uint64_t{kThreads} + threadIdx.x; f64 < total;
       f64 += uint64_t{gridDim.x} * kThreads) {
    const uint32_t f = static_cast<uint32_t>(f64);
    const uint32_t row = f / g.n;
    const uint32_t pos = f - row * g.n;
    if (pos < g.sinks || pos - g.sinks >= g.candidates) {
      scores[f] = __int_as_float(0x7f800000);  // +inf
      kept[f] = 1;
      continue;
    }
    kept[f] = 0;
    const float r = raw[f];
    if (!isfinite(r) && bad == ~0ull) bad = f;
    float s;
    if (raw_scores) {
      s = r;
    } else {
      const double sum = layer_sums[row / g.num_kv_heads];
      const bool uniform = !(sum > 0.0) || !isfinite(sum);
      s = uniform ? static_cast<float>(uniform_score)
                  : static_cast<float>(static_cast<double>(r) / sum);
    }
    scores[f] = s;
  }
  if (bad != ~0ull) atomicMin(first_non_finite, bad);
}

// ---- Small helpers ------------------------------------------------------------------------

__global__ void FillU32Kernel(uint32_t* __restrict__ values, uint64_t count, uint32_t value) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count;
       i += uint64_t{gridDim.x} * blockDim.x) {
    values[i] = value;
  }
}

__global__ void __launch_bounds__(kThreads)
    CountSelectedKernel(SelectGeometry g, const uint8_t* __restrict__ kept,
                        uint32_t* __restrict__ selected) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const uint64_t rows = uint64_t{g.num_layers} * g.num_kv_heads;
  for (uint64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint8_t* p = kept + row * g.n + g.sinks;
    uint32_t count = 0;
    for (uint64_t i = threadIdx.x; i < g.candidates; i += kThreads) count += p[i] != 0 ? 1 : 0;
    const uint32_t block_count = Reduce(temp).Sum(count);
    if (threadIdx.x == 0) selected[row] = block_count;
    __syncthreads();
  }
}

__global__ void HeadUniformQuotaKernel(SelectGeometry g, const uint32_t* __restrict__ selected,
                                       uint32_t* __restrict__ k) {
  const uint64_t rows = uint64_t{g.num_layers} * g.num_kv_heads;
  for (uint64_t row = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; row < rows;
       row += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t layer = row / g.num_kv_heads;
    const uint64_t head = row % g.num_kv_heads;
    uint64_t total = 0;
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) total += selected[layer * g.num_kv_heads + h];
    const uint64_t per_head = total / g.num_kv_heads;
    const uint64_t extra = total % g.num_kv_heads;
    k[row] = static_cast<uint32_t>(per_head + (head < extra ? 1 : 0));  // <= m
  }
}

__global__ void ResetCandidatesKernel(SelectGeometry g, uint8_t* __restrict__ kept) {
  const uint64_t count = uint64_t{g.num_layers} * g.num_kv_heads * g.candidates;
  for (uint64_t j = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; j < count;
       j += uint64_t{gridDim.x} * blockDim.x) {
    kept[CandidateFlat(g, static_cast<uint32_t>(j))] = 0;
  }
}

// ---- v0: radix sort ---------------------------------------------------------------------

__global__ void BuildSortKeysKernel(SelectGeometry g, const float* __restrict__ scores,
                                    const uint8_t* __restrict__ kept, int index_bits,
                                    uint64_t* __restrict__ keys) {
  const uint64_t count = uint64_t{g.num_layers} * g.num_kv_heads * g.candidates;
  for (uint64_t j64 = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; j64 < count;
       j64 += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t j = static_cast<uint32_t>(j64);
    const uint32_t f = CandidateFlat(g, j);
    keys[j] = kept[f] != 0 ? kSentinel : SelectionKey(scores[f], j, index_bits);
  }
}

__global__ void SegmentOffsetsKernel(int* __restrict__ offsets, uint64_t count,
                                     uint64_t segment_size) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count;
       i += uint64_t{gridDim.x} * blockDim.x) {
    offsets[i] = static_cast<int>(i * segment_size);  // caller: count - 1 segments fit in int
  }
}

// sorted: the keys of segments [first_segment, first_segment + count / segment_size), each
// sorted ascending (eligible keys first, sentinels last).
__global__ void MarkSortedKernel(SelectGeometry g, const uint64_t* __restrict__ sorted,
                                 uint64_t count, uint64_t segment_size, uint64_t first_segment,
                                 const uint32_t* __restrict__ k, int index_bits,
                                 uint8_t* __restrict__ kept) {
  const uint64_t candidate_total = uint64_t{g.num_layers} * g.num_kv_heads * g.candidates;
  const uint64_t index_mask = (uint64_t{1} << index_bits) - 1;
  for (uint64_t p = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; p < count;
       p += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t key = sorted[p];
    if (key == kSentinel) continue;
    const uint64_t local_segment = p / segment_size;
    const uint64_t rank = p - local_segment * segment_size;
    if (rank >= k[first_segment + local_segment]) continue;
    const uint64_t j = key & index_mask;
    if (j >= candidate_total) continue;  // cannot happen for keys built above
    kept[CandidateFlat(g, static_cast<uint32_t>(j))] = 1;
  }
}

// One sort call: the one segment of a single-segment select (DeviceRadixSort) or a batch of
// equal segments (DeviceSegmentedRadixSort). With d_temp == nullptr only sizes temp_bytes.
// `segmented` is decided by the select's total segment count, not by this batch's: a last
// batch of one segment must stay on the segmented sort, whose temporary storage (about none)
// is what RadixSortSelectTempBytes sized, not DeviceRadixSort's (proportional to items).
cudaError_t SortBatch(void* d_temp, size_t& temp_bytes, cub::DoubleBuffer<uint64_t>& keys,
                      uint64_t items, uint64_t segments, bool segmented, const int* d_offsets,
                      int end_bit, cudaStream_t stream) {
  if (!segmented) {
    return cub::DeviceRadixSort::SortKeys(d_temp, temp_bytes, keys, static_cast<uint32_t>(items), 0,
                                          end_bit, stream);
  }
  return cub::DeviceSegmentedRadixSort::SortKeys(d_temp, temp_bytes, keys, static_cast<int>(items),
                                                 static_cast<int>(segments), d_offsets,
                                                 d_offsets + 1, 0, end_bit, stream);
}

// Segments per sort call: all of them, or as many as fit in DeviceSegmentedRadixSort's int
// item count.
uint64_t SegmentsPerBatch(uint64_t segments, uint64_t segment_size) {
  if (segments == 1) return 1;
  const uint64_t fit = static_cast<uint64_t>(INT_MAX) / segment_size;  // >= 1: segment_size <= C/2
  return segments < fit ? segments : fit;
}

// ---- v1: radix-histogram select -----------------------------------------------------------

__global__ void InitSelectStatesKernel(RadixSelectState* __restrict__ states, uint64_t segments,
                                       const uint32_t* __restrict__ k, int key_bits) {
  for (uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; s < segments;
       s += uint64_t{gridDim.x} * blockDim.x) {
    RadixSelectState state;
    state.prefix = 0;
    state.remaining = k[s];
    state.shift = key_bits;
    state.mode = k[s] == 0 ? kNone : kSearching;
    states[s] = state;
  }
}

// Histogram of digit (key >> shift) & 255 over the eligible keys that match the resolved prefix,
// for every searching segment. Each (segment, tile) is one virtual block.
__global__ void __launch_bounds__(kThreads)
    SelectHistogramKernel(SelectGeometry g, const float* __restrict__ scores,
                          const uint8_t* __restrict__ kept, uint64_t segment_size,
                          uint64_t segments, int index_bits, int shift,
                          const RadixSelectState* __restrict__ states,
                          uint32_t* __restrict__ histograms) {
  static_assert(kThreads == 256, "one histogram bin per thread");
  __shared__ uint32_t bins[256];
  const uint64_t tiles = (segment_size + kHistogramTile - 1) / kHistogramTile;
  const uint64_t virtual_blocks = segments * tiles;
  for (uint64_t v = blockIdx.x; v < virtual_blocks; v += gridDim.x) {
    const uint64_t segment = v / tiles;
    const uint64_t tile = v - segment * tiles;
    const RadixSelectState state = states[segment];
    if (state.mode != kSearching) continue;  // uniform over the block: no barrier skipped
    bins[threadIdx.x] = 0;
    __syncthreads();
    const uint64_t segment_begin = segment * segment_size;
    const uint64_t begin = segment_begin + tile * kHistogramTile;
    const uint64_t segment_end = segment_begin + segment_size;
    const uint64_t end = Min64(begin + kHistogramTile, segment_end);
    for (uint64_t j64 = begin + threadIdx.x; j64 < end; j64 += kThreads) {
      const uint32_t j = static_cast<uint32_t>(j64);
      const uint32_t f = CandidateFlat(g, j);
      if (kept[f] != 0) continue;
      const uint64_t key = SelectionKey(scores[f], j, index_bits);
      if (!HighBitsEqual(key, state.prefix, shift + 8)) continue;
      atomicAdd(&bins[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    const uint32_t count = bins[threadIdx.x];
    if (count != 0) atomicAdd(&histograms[segment * 256 + threadIdx.x], count);
    __syncthreads();  // bins are cleared by the next virtual block
  }
}

// One thread per segment: finds the bin of the wanted key, narrows the state, clears the bins.
__global__ void SelectFindBinKernel(uint64_t segments, int shift,
                                    RadixSelectState* __restrict__ states,
                                    uint32_t* __restrict__ histograms) {
  for (uint64_t s = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; s < segments;
       s += uint64_t{gridDim.x} * blockDim.x) {
    RadixSelectState state = states[s];
    if (state.mode != kSearching) continue;  // its bins were not touched
    uint32_t* bins = histograms + s * 256;
    uint64_t total = 0;
    for (int d = 0; d < 256; ++d) total += bins[d];
    if (state.remaining >= total) {
      // Every key matching the prefix is wanted (k >= eligible on the first pass, where the
      // threshold shift is the key width: everything eligible).
      state.mode = kThreshold;
      state.shift = shift + 8;
    } else {
      uint64_t before = 0;
      for (int d = 0; d < 256; ++d) {
        const uint64_t c = bins[d];
        if (state.remaining <= before + c) {
          state.prefix |= static_cast<uint64_t>(d) << shift;
          state.remaining = static_cast<uint32_t>(state.remaining - before);
          state.shift = shift;
          // The wanted key closes its bin: every key up to this bin is taken.
          if (state.remaining == c) state.mode = kThreshold;
          break;
        }
        before += c;
      }
    }
    for (int d = 0; d < 256; ++d) bins[d] = 0;
    states[s] = state;
  }
}

__global__ void SelectMarkKernel(SelectGeometry g, const float* __restrict__ scores,
                                 uint64_t segment_size, int index_bits,
                                 const RadixSelectState* __restrict__ states,
                                 uint8_t* __restrict__ kept) {
  const uint64_t count = uint64_t{g.num_layers} * g.num_kv_heads * g.candidates;
  for (uint64_t j64 = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; j64 < count;
       j64 += uint64_t{gridDim.x} * blockDim.x) {
    const RadixSelectState state = states[j64 / segment_size];
    // kSearching cannot remain after the last pass (keys are unique); it selects nothing.
    if (state.mode != kThreshold) continue;
    const uint32_t j = static_cast<uint32_t>(j64);
    const uint32_t f = CandidateFlat(g, j);
    if (kept[f] != 0) continue;  // not eligible; only this thread touches kept[f]
    if (HighBitsAtMost(SelectionKey(scores[f], j, index_bits), state.prefix, state.shift)) {
      kept[f] = 1;
    }
  }
}

// ---- Outputs ------------------------------------------------------------------------------

__global__ void RowCountsKernel(uint64_t rows, const uint32_t* __restrict__ selected,
                                uint32_t forced, int64_t* __restrict__ counts) {
  for (uint64_t row = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; row <= rows;
       row += uint64_t{gridDim.x} * blockDim.x) {
    counts[row] = row < rows ? int64_t{forced} + selected[row] : 0;
  }
}

__global__ void __launch_bounds__(kThreads)
    CompactPositionsKernel(SelectGeometry g, const uint8_t* __restrict__ kept,
                           const int64_t* __restrict__ offsets, uint64_t capacity,
                           int32_t* __restrict__ positions) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const uint64_t rows = uint64_t{g.num_layers} * g.num_kv_heads;
  for (uint64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint8_t* p = kept + row * g.n;
    uint64_t out = static_cast<uint64_t>(offsets[row]);
    for (uint64_t base = 0; base < g.n; base += kThreads) {
      const uint64_t i = base + threadIdx.x;
      const uint32_t flag = i < g.n && p[i] != 0 ? 1 : 0;
      uint32_t prefix = 0, tile_total = 0;
      Scan(temp).ExclusiveSum(flag, prefix, tile_total);
      if (flag != 0 && out + prefix < capacity) positions[out + prefix] = static_cast<int32_t>(i);
      out += tile_total;
      __syncthreads();  // temp is reused by the next tile
    }
  }
}

__global__ void PackBitmaskKernel(SelectGeometry g, const uint8_t* __restrict__ kept,
                                  uint8_t* __restrict__ bitmask) {
  const uint64_t row_bytes = (uint64_t{g.n} + 7) / 8;
  const uint64_t total = uint64_t{g.num_layers} * g.num_kv_heads * row_bytes;
  for (uint64_t b = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; b < total;
       b += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t row = b / row_bytes;
    const uint64_t first = (b - row * row_bytes) * 8;
    const uint8_t* p = kept + row * g.n;
    uint32_t byte = 0;
    for (uint32_t bit = 0; bit < 8; ++bit) {
      if (first + bit < g.n && p[first + bit] != 0) byte |= 1u << bit;
    }
    bitmask[b] = static_cast<uint8_t>(byte);
  }
}

}  // namespace

cudaError_t LaunchLayerSums(const SelectGeometry& geometry, const float* d_raw, double* d_partials,
                            double* d_layer_sums, cudaStream_t stream) {
  if (geometry.num_layers == 0) return cudaSuccess;
  const uint64_t slots = uint64_t{geometry.num_layers} * kLayerSumSlots;
  LayerPartialSumsKernel<<<CappedBlocks(slots), kThreads, 0, stream>>>(geometry, d_raw, d_partials);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  LayerSumsKernel<<<BlocksFor(geometry.num_layers), kThreads, 0, stream>>>(
      geometry.num_layers, d_partials, d_layer_sums);
  return cudaGetLastError();
}

cudaError_t LaunchNormalizeScores(const SelectGeometry& geometry, const float* d_raw,
                                  const double* d_layer_sums, bool raw_scores, float* d_scores,
                                  uint8_t* d_kept, unsigned long long* d_first_non_finite,
                                  cudaStream_t stream) {
  if (geometry.total() == 0) return cudaSuccess;
  NormalizeScoresKernel<<<BlocksFor(geometry.total()), kThreads, 0, stream>>>(
      geometry, d_raw, d_layer_sums, raw_scores, d_scores, d_kept, d_first_non_finite);
  return cudaGetLastError();
}

cudaError_t LaunchFillU32(uint32_t* d_values, uint64_t count, uint32_t value, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  FillU32Kernel<<<BlocksFor(count), kThreads, 0, stream>>>(d_values, count, value);
  return cudaGetLastError();
}

cudaError_t LaunchCountSelected(const SelectGeometry& geometry, const uint8_t* d_kept,
                                uint32_t* d_selected, cudaStream_t stream) {
  if (geometry.rows() == 0) return cudaSuccess;
  CountSelectedKernel<<<CappedBlocks(geometry.rows()), kThreads, 0, stream>>>(geometry, d_kept,
                                                                              d_selected);
  return cudaGetLastError();
}

cudaError_t LaunchHeadUniformQuota(const SelectGeometry& geometry, const uint32_t* d_selected,
                                   uint32_t* d_k, cudaStream_t stream) {
  if (geometry.rows() == 0) return cudaSuccess;
  HeadUniformQuotaKernel<<<BlocksFor(geometry.rows()), kThreads, 0, stream>>>(geometry, d_selected,
                                                                              d_k);
  return cudaGetLastError();
}

cudaError_t LaunchResetCandidates(const SelectGeometry& geometry, uint8_t* d_kept,
                                  cudaStream_t stream) {
  if (geometry.candidate_total() == 0) return cudaSuccess;
  ResetCandidatesKernel<<<BlocksFor(geometry.candidate_total()), kThreads, 0, stream>>>(geometry,
                                                                                        d_kept);
  return cudaGetLastError();
}

cudaError_t RadixSortSelectTempBytes(const SelectGeometry& geometry, uint64_t segment_size,
                                     size_t* temp_bytes) {
  *temp_bytes = 0;
  const uint64_t candidate_total = geometry.candidate_total();
  if (candidate_total == 0 || segment_size == 0) return cudaSuccess;
  const uint64_t segments = candidate_total / segment_size;
  const uint64_t batch = SegmentsPerBatch(segments, segment_size);
  cub::DoubleBuffer<uint64_t> keys(nullptr, nullptr);
  const int end_bit = 32 + IndexBits(candidate_total);
  return SortBatch(nullptr, *temp_bytes, keys, batch * segment_size, batch, segments > 1, nullptr,
                   end_bit, nullptr);
}

cudaError_t LaunchRadixSortSelect(const SelectGeometry& geometry, const float* d_scores,
                                  uint64_t segment_size, const uint32_t* d_k, uint64_t* d_keys_a,
                                  uint64_t* d_keys_b, int* d_segment_offsets, void* d_temp,
                                  size_t temp_bytes, uint8_t* d_kept, cudaStream_t stream) {
  const uint64_t candidate_total = geometry.candidate_total();
  if (candidate_total == 0) return cudaSuccess;
  if (segment_size == 0 || candidate_total % segment_size != 0) return cudaErrorInvalidValue;
  const int index_bits = IndexBits(candidate_total);
  const int end_bit = 32 + index_bits;
  BuildSortKeysKernel<<<BlocksFor(candidate_total), kThreads, 0, stream>>>(
      geometry, d_scores, d_kept, index_bits, d_keys_a);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;

  const uint64_t segments = candidate_total / segment_size;
  const uint64_t batch = SegmentsPerBatch(segments, segment_size);
  if (segments > 1) {
    SegmentOffsetsKernel<<<BlocksFor(batch + 1), kThreads, 0, stream>>>(d_segment_offsets,
                                                                        batch + 1, segment_size);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  for (uint64_t first = 0; first < segments; first += batch) {
    const uint64_t count = segments - first < batch ? segments - first : batch;
    const uint64_t items = count * segment_size;
    cub::DoubleBuffer<uint64_t> keys(d_keys_a + first * segment_size,
                                     d_keys_b + first * segment_size);
    size_t bytes = temp_bytes;
    error = SortBatch(d_temp, bytes, keys, items, count, segments > 1, d_segment_offsets, end_bit,
                      stream);
    if (error != cudaSuccess) return error;
    MarkSortedKernel<<<BlocksFor(items), kThreads, 0, stream>>>(
        geometry, keys.Current(), items, segment_size, first, d_k, index_bits, d_kept);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t LaunchHistogramSelect(const SelectGeometry& geometry, const float* d_scores,
                                  uint64_t segment_size, const uint32_t* d_k,
                                  uint32_t* d_histograms, RadixSelectState* d_states,
                                  uint8_t* d_kept, cudaStream_t stream) {
  const uint64_t candidate_total = geometry.candidate_total();
  if (candidate_total == 0) return cudaSuccess;
  if (segment_size == 0 || candidate_total % segment_size != 0) return cudaErrorInvalidValue;
  const uint64_t segments = candidate_total / segment_size;
  const int index_bits = HistogramIndexBits(candidate_total);
  const int key_bits = 32 + index_bits;  // a multiple of 8, <= 64

  cudaError_t error = cudaMemsetAsync(d_histograms, 0, segments * 256 * sizeof(uint32_t), stream);
  if (error != cudaSuccess) return error;
  InitSelectStatesKernel<<<BlocksFor(segments), kThreads, 0, stream>>>(d_states, segments, d_k,
                                                                       key_bits);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;

  const uint64_t tiles = (segment_size + kHistogramTile - 1) / kHistogramTile;
  const unsigned histogram_blocks = CappedBlocks(segments * tiles);
  for (int shift = key_bits - 8; shift >= 0; shift -= 8) {
    SelectHistogramKernel<<<histogram_blocks, kThreads, 0, stream>>>(
        geometry, d_scores, d_kept, segment_size, segments, index_bits, shift, d_states,
        d_histograms);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    SelectFindBinKernel<<<BlocksFor(segments), kThreads, 0, stream>>>(segments, shift, d_states,
                                                                      d_histograms);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  SelectMarkKernel<<<BlocksFor(candidate_total), kThreads, 0, stream>>>(
      geometry, d_scores, segment_size, index_bits, d_states, d_kept);
  return cudaGetLastError();
}

cudaError_t RowOffsetsTempBytes(const SelectGeometry& geometry, size_t* temp_bytes) {
  *temp_bytes = 0;
  int64_t* const no_data = nullptr;
  return cub::DeviceScan::ExclusiveSum(nullptr, *temp_bytes, no_data, no_data, geometry.rows() + 1,
                                       cudaStream_t{});
}

cudaError_t LaunchRowOffsets(const SelectGeometry& geometry, const uint32_t* d_selected,
                             uint32_t forced, int64_t* d_offsets, void* d_temp, size_t temp_bytes,
                             cudaStream_t stream) {
  const uint64_t rows = geometry.rows();
  RowCountsKernel<<<BlocksFor(rows + 1), kThreads, 0, stream>>>(rows, d_selected, forced,
                                                                d_offsets);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  size_t bytes = temp_bytes;
  // In place (d_in == d_out is supported): the trailing 0 becomes the total.
  return cub::DeviceScan::ExclusiveSum(d_temp, bytes, d_offsets, d_offsets, rows + 1, stream);
}

cudaError_t LaunchCompactPositions(const SelectGeometry& geometry, const uint8_t* d_kept,
                                   const int64_t* d_offsets, uint64_t capacity,
                                   int32_t* d_positions, cudaStream_t stream) {
  if (geometry.total() == 0) return cudaSuccess;
  CompactPositionsKernel<<<CappedBlocks(geometry.rows()), kThreads, 0, stream>>>(
      geometry, d_kept, d_offsets, capacity, d_positions);
  return cudaGetLastError();
}

cudaError_t LaunchPackBitmask(const SelectGeometry& geometry, const uint8_t* d_kept,
                              uint8_t* d_bitmask, cudaStream_t stream) {
  const uint64_t bytes = geometry.rows() * ((uint64_t{geometry.n} + 7) / 8);
  if (bytes == 0) return cudaSuccess;
  PackBitmaskKernel<<<BlocksFor(bytes), kThreads, 0, stream>>>(geometry, d_kept, d_bitmask);
  return cudaGetLastError();
}

}  // namespace laprox::kernels::cuda
