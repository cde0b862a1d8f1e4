// The only translation unit that knows whether the CUDA backend was built.
#include "laprox/kernels/registry.h"

#include "absl/strings/str_cat.h"
#include "cpu/cpu_backend.h"
#if LAPROX_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace laprox::kernels {

absl::StatusOr<std::string> CanonicalCudaKernels(absl::string_view kernels, bool* deprecated) {
  if (deprecated != nullptr) *deprecated = kernels == "v0" || kernels == "v1";
  if (kernels == "gemm" || kernels == "v0") return std::string("gemm");
  if (kernels == "fused" || kernels == "v1") return std::string("fused");
  return absl::InvalidArgumentError(
      absl::StrCat("unknown CUDA kernels \"", kernels, "\"; expected gemm or fused"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options) {
  // Checked for every kind, so a misspelt option fails where it is given, not on the GPU host.
  absl::StatusOr<std::string> kernels = CanonicalCudaKernels(options.cuda_kernels);
  if (!kernels.ok()) return kernels.status();
  switch (kind) {
    case BackendKind::kCpu:
      return std::make_unique<cpu::CpuBackend>(options.threads, options.cpu_window_bytes,
                                               options.cpu_l2_bytes);
    case BackendKind::kCuda:
#if LAPROX_HAVE_CUDA
    {
      auto backend =
          cuda::CudaBackend::Create(options.device, *kernels == "fused" ? cuda::CudaKernels::kFused
                                                                        : cuda::CudaKernels::kGemm);
      if (!backend.ok()) return backend.status();
      return std::unique_ptr<Backend>(std::move(backend).value());
    }
#else
      return absl::UnimplementedError("this build has no CUDA backend (built without nvcc)");
#endif
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name,
                                                       const BackendOptions& options) {
  if (name == "cpu") return CreateBackend(BackendKind::kCpu, options);
  if (name == "cuda") return CreateBackend(BackendKind::kCuda, options);
  if (name == "auto") {
    // The CUDA backend has not yet run on a GPU (tests/gpu/run.sh); until it has passed there,
    // "auto" means the CPU backend (docs/daemon.md, --backend).
    return CreateBackend(BackendKind::kCpu, options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend \"", name, "\"; expected auto, cpu or cuda"));
}

}  // namespace laprox::kernels
