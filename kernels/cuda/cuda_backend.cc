#include "cuda/cuda_backend.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"
#include "cuda/device_query.h"

namespace laprox::kernels::cuda {

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  LAPROX_RETURN_IF_ERROR(CudaStatus(CountDevices(&count), "cudaGetDeviceCount"));
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " devices)"));
  }
  LAPROX_RETURN_IF_ERROR(CudaStatus(ProbeDevice(device), "probing the CUDA device"));
  return std::unique_ptr<CudaBackend>(new CudaBackend(device));
}

std::string CudaBackend::Describe() const {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_) != cudaSuccess) {
    return absl::StrCat("cuda: device ", device_);
  }
  return absl::StrCat("cuda: device ", device_, " ", prop.name, " (sm_", prop.major, prop.minor,
                      ")");
}

absl::StatusOr<std::shared_ptr<const PreparedModel>> CudaBackend::PrepareModelImpl(
    const ModelGeometry&, absl::Span<const TensorView>, const PrepareOptions&) {
  return absl::UnimplementedError("the CUDA backend cannot prepare models yet; use --backend=cpu");
}

absl::StatusOr<KeepPlan> CudaBackend::ComputeKeepPlanImpl(const PreparedModel&,
                                                          const KeepPlanRequest&,
                                                          const PlanShape&) {
  return absl::UnimplementedError("the CUDA backend cannot compute keep-plans yet");
}

}  // namespace laprox::kernels::cuda
