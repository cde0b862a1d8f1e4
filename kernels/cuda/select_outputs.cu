// The KeepPlan outputs of the device selection: per-head offsets (an exclusive scan of the
// kept counts), compacted positions and the packed bitmask (RowOffsetsTempBytes,
// LaunchRowOffsets, LaunchCompactPositions, LaunchPackBitmask; contracts in select_kernels.h).
#include "cuda/select_kernels.h"

#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include "cuda/select_keys.cuh"

namespace laprox::kernels::cuda {
namespace {

using selection::BlocksFor;
using selection::CappedBlocks;
using selection::kThreads;

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
