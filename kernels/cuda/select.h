// DeviceSelector: per-layer normalisation, budget allocation and the deterministic selection on
// the device, turning raw scores into a KeepPlan (tests/reference/SEMANTICS.md, "Selection").
//
// Produces exactly the plan kernels/policy/select.cc (SelectKeepPlan) builds from the same raw
// scores, except that the layer sums are added in a different (but fixed) order, so a
// normalised score may differ in its last bit and swap a near-tie.
#ifndef LAPROX_KERNELS_CUDA_SELECT_H_
#define LAPROX_KERNELS_CUDA_SELECT_H_

#include "absl/status/statusor.h"
#include "cuda/context.h"
#include "cuda/device_buffer.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/keep_plan.h"

namespace laprox::kernels::cuda {

enum class SelectAlgorithm {
  kRadixSort,  // gemm kernels: cub::DeviceRadixSort / DeviceSegmentedRadixSort on (score, flat
               // index)
  kHistogram,  // fused kernels: radix-histogram threshold select, ties to the lowest flat index
};

class DeviceSelector {
 public:
  // d_raw: device, [L, Hkv, n] raw scores, read only at candidate positions
  // [shape.sinks, shape.n - shape.window). Fills every KeepPlan field SelectKeepPlan fills
  // (counts, offsets, positions / bitmask / scores as `outputs` asks, layer_sums, quota,
  // selected_total, window, sinks), in host memory, and synchronises the stream. Every
  // allocation, min_per_head and head_uniform_layers are handled; a policy whose
  // max_layer_share applies is UNIMPLEMENTED (the backend selects it on the host). Layer sums are
  // fp64, reduced in a fixed order (no float atomics): the same input gives the same plan.
  // RESOURCE_EXHAUSTED when the device is full; INTERNAL for CUDA errors, and (in
  // SelectKeepPlan's words) when a candidate's raw score is NaN or infinite.
  // Not thread-safe: the selector keeps its workspace between calls.
  absl::StatusOr<KeepPlan> Select(const DeviceContext& context, const RequestShape& shape,
                                  const PolicySpec& policy, const float* d_raw,
                                  const OutputOptions& outputs, SelectAlgorithm algorithm);

 private:
  DeviceBuffer workspace_;
  DeviceBuffer sort_temp_;
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_SELECT_H_
