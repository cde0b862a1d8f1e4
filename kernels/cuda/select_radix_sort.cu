// The top-k of the device selection with the gemm kernels: per segment, a radix sort of unique
// (score, index) keys (cub::DeviceRadixSort for one segment, DeviceSegmentedRadixSort in batches
// otherwise), then the first k of every segment marked (RadixSortSelectTempBytes,
// LaunchRadixSortSelect; contracts in select_kernels.h).
#include "cuda/select_kernels.h"

#include <climits>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/util_type.cuh>

#include "cuda/select_keys.cuh"

namespace laprox::kernels::cuda {
namespace {

using selection::BlocksFor;
using selection::CandidateFlat;
using selection::IndexBits;
using selection::kSentinel;
using selection::kThreads;
using selection::SelectionKey;

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

}  // namespace

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

}  // namespace laprox::kernels::cuda
