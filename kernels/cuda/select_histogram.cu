// The top-k of the device selection with the fused kernels: a radix-histogram threshold select, 8
// key bits per pass, that finds each segment's k-th key and marks the keys at or before it, ties
// going to the lowest flat index (LaunchHistogramSelect; contract in select_kernels.h).
#include "cuda/select_kernels.h"

#include <cstdint>

#include "cuda/select_keys.cuh"

namespace laprox::kernels::cuda {
namespace {

using selection::BlocksFor;
using selection::CandidateFlat;
using selection::CappedBlocks;
using selection::HighBitsAtMost;
using selection::HighBitsEqual;
using selection::HistogramIndexBits;
using selection::kHistogramTile;
using selection::kNone;
using selection::kSearching;
using selection::kThreads;
using selection::kThreshold;
using selection::Min64;
using selection::SelectionKey;

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

}  // namespace

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

}  // namespace laprox::kernels::cuda
