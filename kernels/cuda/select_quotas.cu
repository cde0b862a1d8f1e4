// Per-segment quotas and per-head counts of the device selection: filling quotas, counting the
// selected candidates per head, the head_uniform_layers recount's quotas and the clearing of
// the candidates before it (LaunchFillU32, LaunchCountSelected, LaunchHeadUniformQuota,
// LaunchResetCandidates; contracts in select_kernels.h).
#include "cuda/select_kernels.h"

#include <cstdint>

#include <cub/block/block_reduce.cuh>

#include "cuda/select_keys.cuh"

namespace laprox::kernels::cuda {
namespace {

using selection::BlocksFor;
using selection::CandidateFlat;
using selection::CappedBlocks;
using selection::kThreads;

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

}  // namespace

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

}  // namespace laprox::kernels::cuda
