#include "cuda/scorer.h"

namespace laprox::kernels::cuda {
namespace {

class ScorerV0 final : public Scorer {
 public:
  absl::string_view name() const override { return "v0"; }
  bool Supports(const PlanShape&, const PolicySpec&,
                const std::vector<LayerInputs>&) const override {
    return true;
  }
  absl::Status Score(const DeviceContext&, const CudaPreparedModel&,
                     const std::vector<LayerInputs>&, const PlanShape&, const PolicySpec&,
                     float*) override {
    return absl::UnimplementedError("ScorerV0: not written yet");
  }
};

}  // namespace

std::unique_ptr<Scorer> NewScorerV0() { return std::make_unique<ScorerV0>(); }

}  // namespace laprox::kernels::cuda
