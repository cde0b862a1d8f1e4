#include "cuda/scorer.h"

namespace laprox::kernels::cuda {
namespace {

class ScorerV1 final : public Scorer {
 public:
  absl::string_view name() const override { return "v1"; }
  bool Supports(const PlanShape&, const PolicySpec&,
                const std::vector<LayerInputs>&) const override {
    return false;
  }
  absl::Status Score(const DeviceContext&, const CudaPreparedModel&,
                     const std::vector<LayerInputs>&, const PlanShape&, const PolicySpec&,
                     float*) override {
    return absl::UnimplementedError("ScorerV1: not written yet");
  }
};

}  // namespace

std::unique_ptr<Scorer> NewScorerV1() { return std::make_unique<ScorerV1>(); }

}  // namespace laprox::kernels::cuda
