// CudaBackend: keep-plans on the GPU that holds the engine's KV cache.
//
// Status: skeleton. It discovers the device and reports itself, and answers UNIMPLEMENTED for
// PrepareModel and ComputeKeepPlan until the kernels land (issue "CUDA backend and CUDA IPC
// regions"). The CPU backend is the reference it will be tested against.
#ifndef LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_
#define LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

class CudaBackend final : public Backend {
 public:
  // UNAVAILABLE when `device` does not exist or cannot run a kernel.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string Describe() const override;
  // LAPROX only; the baselines are UNIMPLEMENTED here (use the CPU backend).
  bool Supports(PolicyKind kind) const override { return kind == PolicyKind::kLaprox; }

 protected:
  bool CanRead(MemorySpace) const override { return true; }
  absl::StatusOr<std::shared_ptr<const PreparedModel>> PrepareModelImpl(
      const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
      const PrepareOptions& options) override;
  absl::StatusOr<KeepPlan> ComputeKeepPlanImpl(const PreparedModel& model,
                                               const KeepPlanRequest& request,
                                               const PlanShape& shape) override;

 private:
  explicit CudaBackend(int device) : device_(device) {}
  int device_;
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_
