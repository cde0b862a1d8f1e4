// Launchers of the device selection (DeviceSelector, cuda/select.h): per-layer sums and
// normalisation, per-segment top-k by radix sort (gemm kernels) or radix-histogram threshold select
// (fused), and the KeepPlan outputs (per-head counts, offsets, positions, bitmask). One algorithm
// per .cu file: select_normalize.cu (layer sums, scores), select_quotas.cu (quotas, counts, the
// head-uniform recount), select_radix_sort.cu (gemm), select_histogram.cu (fused),
// select_outputs.cu (offsets, positions, bitmask); the keys and launch shape they share are in
// select_keys.cuh.
//
// Every launcher works on the flat score space [L, Hkv, n] of one request, described by
// SelectGeometry. Indices: flat f = (l * Hkv + g) * n + i (< 2^32); candidate index
// j in [0, C), C = L * Hkv * m, enumerates the candidates (l, g, i), i in [sinks, sinks + m), in
// flat order: row = j / m, f = row * n + sinks + j % m.
//
// Common contract: all pointers are device memory (d_ prefix) unless stated; work is enqueued on
// `stream` and nothing synchronises; the return value is the first CUDA error of the enqueue
// (cudaGetLastError after each launch, or the CUB call's error). Launchers with nothing to do
// (zero elements) launch nothing. Every launcher is deterministic: no floating-point atomics;
// integer atomics only where the result is an exact count. Not thread-safe with respect to the
// buffers passed in.
#ifndef LAPROX_KERNELS_CUDA_SELECT_KERNELS_H_
#define LAPROX_KERNELS_CUDA_SELECT_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// Shape of the flat score space. Precondition of every launcher: rows() * n < 2^32 and
// sinks + candidates <= n.
struct SelectGeometry {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t n = 0;
  uint32_t sinks = 0;       // se: candidates start at position se
  uint32_t candidates = 0;  // m: candidates per (layer, head)

  uint64_t rows() const { return uint64_t{num_layers} * num_kv_heads; }
  uint64_t total() const { return rows() * n; }                     // N
  uint64_t candidate_total() const { return rows() * candidates; }  // C
  uint64_t layer_candidates() const { return uint64_t{num_kv_heads} * candidates; }
};

// Partial sums per layer: the layer's candidates are split into this many contiguous chunks,
// each summed by one block in a fixed order; the chunk sums are then added in chunk order.
inline constexpr uint32_t kLayerSumSlots = 64;

// Layer sums S_l = sum over the layer's candidates of double(raw), l in [0, L).
// d_raw: [L, Hkv, n] fp32, read at candidate positions only. d_partials: [L * kLayerSumSlots]
// scratch. d_layer_sums: [L] output. Deterministic: a fixed partition and a fixed reduction
// tree independent of the device, so the same input gives bit-identical sums.
cudaError_t LaunchLayerSums(const SelectGeometry& geometry, const float* d_raw, double* d_partials,
                            double* d_layer_sums, cudaStream_t stream);

// Competing scores and the initial kept mask, elementwise over [L, Hkv, n]:
// candidates get s = raw (raw_scores, GLOBAL_RAW), else float(double(raw) / S_l), or
// float(1.0 / (Hkv * m)) when S_l is not > 0 or not finite (uniform layer); d_kept = 0.
// Sinks and window positions get s = +inf and d_kept = 1. Exactly SelectKeepPlan's arithmetic
// (IEEE double division, round-to-nearest conversion to float).
// d_scores: [N] fp32 output; d_kept: [N] bytes output (0/1). *d_first_non_finite = min(itself,
// flat index) over the candidates whose raw score is NaN or infinite (integer atomicMin; the
// caller initialises it, e.g. to all ones): SelectKeepPlan's INTERNAL check.
cudaError_t LaunchNormalizeScores(const SelectGeometry& geometry, const float* d_raw,
                                  const double* d_layer_sums, bool raw_scores, float* d_scores,
                                  uint8_t* d_kept, unsigned long long* d_first_non_finite,
                                  cudaStream_t stream);

// d_values[0, count) = value.
cudaError_t LaunchFillU32(uint32_t* d_values, uint64_t count, uint32_t value, cudaStream_t stream);

// d_selected[row] = number of candidates of (layer, head) row with d_kept != 0, row in [0, L*Hkv).
// Integer reduction (exact).
cudaError_t LaunchCountSelected(const SelectGeometry& geometry, const uint8_t* d_kept,
                                uint32_t* d_selected, cudaStream_t stream);

// head_uniform_layers quotas: T_l = sum_g d_selected[l * Hkv + g];
// d_k[l * Hkv + g] = T_l / Hkv + (g < T_l % Hkv ? 1 : 0). d_selected and d_k: [L * Hkv].
cudaError_t LaunchHeadUniformQuota(const SelectGeometry& geometry, const uint32_t* d_selected,
                                   uint32_t* d_k, cudaStream_t stream);

// d_kept = 0 at every candidate position (forced positions unchanged).
cudaError_t LaunchResetCandidates(const SelectGeometry& geometry, uint8_t* d_kept,
                                  cudaStream_t stream);

// ---- Top-k per segment -------------------------------------------------------------------
// Both select algorithms below compute the same thing. The candidates are cut into
// C / segment_size segments of `segment_size` consecutive candidate indices (segment_size is m
// for per-head, Hkv * m for per-layer, C for one model-wide competition; it must divide C).
// Eligible: a candidate with d_kept == 0. Each segment s marks (d_kept = 1) its best
// min(d_k[s], eligible in s) eligible candidates in the order score descending (d_scores,
// -0 == +0), then flat index ascending — SelectKeepPlan's Take. d_k: [C / segment_size].
// Scores must not be NaN (the order is then still total and memory-safe, but not the CPU's).
// Deterministic: the selected set is unique under this strict total order.

// gemm kernels: 64-bit keys (descending-order score bits << b | j, b = bit width of C) are built
// with ineligible candidates as all-ones sentinels, sorted with cub::DeviceRadixSort::SortKeys (one
// segment) or cub::DeviceSegmentedRadixSort::SortKeys (batches of segments of at most 2^31 - 1
// keys), and rank < d_k within each segment marks. d_keys_a, d_keys_b: [C] uint64 scratch.
// d_segment_offsets: [C / segment_size + 1] int scratch (only used when there is more than one
// segment). d_temp: temp_bytes of scratch, at least what RadixSortSelectTempBytes reports for the
// same geometry and segment_size.
cudaError_t RadixSortSelectTempBytes(const SelectGeometry& geometry, uint64_t segment_size,
                                     size_t* temp_bytes);
cudaError_t LaunchRadixSortSelect(const SelectGeometry& geometry, const float* d_scores,
                                  uint64_t segment_size, const uint32_t* d_k, uint64_t* d_keys_a,
                                  uint64_t* d_keys_b, int* d_segment_offsets, void* d_temp,
                                  size_t temp_bytes, uint8_t* d_kept, cudaStream_t stream);

// Per-segment state of the histogram select (opaque to callers; sized per segment).
struct RadixSelectState {
  uint64_t prefix = 0;     // key bits resolved so far (bits >= shift)
  uint32_t remaining = 0;  // rank (1-based) of the wanted key among keys matching prefix
  int32_t shift = 0;       // lowest resolved bit
  int32_t mode = 0;        // searching / none / threshold (select_histogram.cu)
  int32_t unused = 0;
};

// fused kernels: radix select on the same keys without sorting: per segment, passes of 8 bits from
// the top build a 256-bin histogram of the eligible keys that match the resolved prefix
// (block-shared integer histograms flushed with integer atomics: exact counts), one thread per
// segment then picks the bin holding the k-th key, and a segment stops as soon as the k-th key
// closes a bin. Finally every eligible key <= the k-th key is marked. At most 8 passes over the
// candidates; no sort, no scan. d_histograms: [C / segment_size * 256] uint32 scratch; d_states: [C
// / segment_size] scratch.
cudaError_t LaunchHistogramSelect(const SelectGeometry& geometry, const float* d_scores,
                                  uint64_t segment_size, const uint32_t* d_k,
                                  uint32_t* d_histograms, RadixSelectState* d_states,
                                  uint8_t* d_kept, cudaStream_t stream);

// ---- Outputs -----------------------------------------------------------------------------

// Offsets of the kept positions: d_offsets[row] = sum over rows r < row of
// (forced + d_selected[r]), row in [0, L*Hkv]; d_offsets: [L*Hkv + 1] int64. Uses
// cub::DeviceScan::ExclusiveSum in place (exact integer scan). d_temp: temp_bytes of scratch, at
// least what RowOffsetsTempBytes reports.
cudaError_t RowOffsetsTempBytes(const SelectGeometry& geometry, size_t* temp_bytes);
cudaError_t LaunchRowOffsets(const SelectGeometry& geometry, const uint32_t* d_selected,
                             uint32_t forced, int64_t* d_offsets, void* d_temp, size_t temp_bytes,
                             cudaStream_t stream);

// Kept positions (int32, ascending) of each row, written at d_positions[d_offsets[row] ...]
// (one block per row, block-wide scans). Writes at or past `capacity` elements are dropped
// (the caller checks the total afterwards).
cudaError_t LaunchCompactPositions(const SelectGeometry& geometry, const uint8_t* d_kept,
                                   const int64_t* d_offsets, uint64_t capacity,
                                   int32_t* d_positions, cudaStream_t stream);

// d_bitmask: [L*Hkv, ceil(n / 8)] bytes, bit i % 8 of byte i / 8 set when d_kept[row, i] != 0.
cudaError_t LaunchPackBitmask(const SelectGeometry& geometry, const uint8_t* d_kept,
                              uint8_t* d_bitmask, cudaStream_t stream);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_SELECT_KERNELS_H_
