// CudaBackend: keep-plans on the GPU that holds the engine's KV cache (docs/design.md §5).
//
// Reads keys, values and window queries straight from device memory (cuda_ipc regions the
// service imported through ImportCudaIpc), or stages host views (shm regions, inline bytes) to
// the device first. Every stage runs on one stream of the chosen device:
//   InputChecker (check.h)   NaN/Inf and probability-row checks, the CPU backend's messages,
//                            and the inputs' maxima for the magnitude checks (policy/magnitude.h)
//   Scorer (scorer.h)        raw scores p: gemm (cuBLAS + simple kernels) or fused (one kernel)
//   DeviceSelector (select.h) normalisation, allocation, selection, compaction
// Implements LAPROX only; the baseline policies are UNIMPLEMENTED here (the CPU backend has
// them). Requests are serialised by a mutex: one request uses the whole GPU.
//
// A device error never aborts the process: it becomes INTERNAL (or RESOURCE_EXHAUSTED when the
// device is full). An error that leaves the CUDA context unusable (illegal address, launch
// failure, ...) is sticky: Health() then reports UNAVAILABLE and every later request fails.
#ifndef LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_
#define LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cuda/check.h"
#include "cuda/context.h"
#include "cuda/device_buffer.h"
#include "cuda/scorer.h"
#include "cuda/select.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

// Which kernels compute plans (--cuda_kernels): gemm (cuBLAS, radix sort) or fused (fused kernel,
// histogram select; requests the fused kernel cannot take — MEAN_HEAD_PRODUCT (the default
// gqa_value) or EXACT_BLOCK, fp32 inputs, given window attention — run on gemm).
enum class CudaKernels { kGemm, kFused };

class CudaBackend final : public Backend {
 public:
  // UNAVAILABLE when `device` does not exist or cannot run a kernel; INTERNAL when the stream
  // or the cuBLAS handle cannot be created.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device, CudaKernels kernels);
  ~CudaBackend() override;

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string Describe() const override;
  // 2^50 work units: the H200-class GPUs this backend targets run ~1e13-1e14 units a second
  // (work.h); not measured yet (no GPU has run this backend).
  int64_t DefaultMaxRequestWork() const override { return int64_t{1} << 50; }
  // LAPROX only; the baselines are UNIMPLEMENTED here (use the CPU backend).
  bool Supports(PolicyKind kind) const override { return kind == PolicyKind::kLaprox; }
  std::vector<DeviceDescription> Devices() const override;
  absl::Status CopyToRegion(void* dst, MemorySpace space, const void* src, int64_t bytes) override;
  absl::Status Health() const override;

 protected:
  bool CanRead(MemorySpace) const override { return true; }
  absl::StatusOr<std::shared_ptr<const PreparedModel>> PrepareModelImpl(
      const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
      const PrepareOptions& options, const StopSignal* stop) override;
  absl::StatusOr<KeepPlan> ComputeKeepPlanImpl(const PreparedModel& model,
                                               const KeepPlanRequest& request,
                                               const RequestShape& shape) override;
  absl::StatusOr<std::unique_ptr<ImportedRegion>> ImportCudaIpcImpl(
      const CudaIpcRegionSpec& spec) override;

 private:
  CudaBackend(DeviceContext context, CudaKernels kernels);

  // Copies every host view of `views` to staging_ and rewrites it as a device view (device
  // views are left as they are). Synchronous.
  absl::Status StageToDevice(std::vector<TensorView*> views) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers `status` as the sticky failure when the CUDA context no longer works, and returns
  // it (with the sticky cause added) either way.
  absl::Status Track(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DeviceContext context_;
  const CudaKernels kernels_;
  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer staging_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer raw_ ABSL_GUARDED_BY(mu_);
  InputChecker checker_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Scorer> gemm_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Scorer> fused_ ABSL_GUARDED_BY(mu_);
  DeviceSelector selector_ ABSL_GUARDED_BY(mu_);
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CUDA_BACKEND_H_
