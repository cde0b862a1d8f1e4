#include "cuda/check.h"

namespace laprox::kernels::cuda {

absl::Status InputChecker::Check(const DeviceContext&, const std::vector<LayerInputs>&,
                                 const PlanShape&) {
  return absl::UnimplementedError("InputChecker: not written yet");
}

}  // namespace laprox::kernels::cuda
