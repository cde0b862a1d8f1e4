#include "cuda/select.h"

namespace laprox::kernels::cuda {

absl::StatusOr<KeepPlan> DeviceSelector::Select(const DeviceContext&, const PlanShape&,
                                                const PolicySpec&, const float*,
                                                const OutputOptions&, SelectAlgorithm) {
  return absl::UnimplementedError("DeviceSelector: not written yet");
}

}  // namespace laprox::kernels::cuda
