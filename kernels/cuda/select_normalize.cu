// The layer sums (fp64, reduced in a fixed order: per-block partials, then the blocks in order)
// and the competing scores of the device selection (LaunchLayerSums, LaunchNormalizeScores;
// contracts in select_kernels.h).
#include "cuda/select_kernels.h"

#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include "cuda/select_keys.cuh"

namespace laprox::kernels::cuda {
namespace {

using selection::BlocksFor;
using selection::CappedBlocks;
using selection::kThreads;
using selection::Min64;

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

}  // namespace laprox::kernels::cuda
