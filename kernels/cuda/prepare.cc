#include "cuda/prepare.h"

namespace laprox::kernels::cuda {

absl::StatusOr<std::shared_ptr<CudaPreparedModel>> PrepareFactors(const DeviceContext&,
                                                                  const ModelGeometry&,
                                                                  absl::Span<const TensorView>,
                                                                  const PrepareOptions&) {
  return absl::UnimplementedError("PrepareFactors: not written yet");
}

}  // namespace laprox::kernels::cuda
