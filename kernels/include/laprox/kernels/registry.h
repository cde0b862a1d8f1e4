// CreateBackend: the one place a backend is chosen. Only kernels/registry.cc knows whether the
// CUDA backend was built.
#ifndef LAPROX_KERNELS_REGISTRY_H_
#define LAPROX_KERNELS_REGISTRY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels {

struct BackendOptions {
  int threads = 2;  // CPU worker threads over (layer, KV head) pairs; BLAS runs single-threaded
  // CPU, LAPROX: the most bytes of window probabilities ([G * rows, n] fp32) a worker holds;
  // longer contexts compute the window rows in several passes over the keys (at 64 MiB: one
  // pass up to n = 174K at G = 3, w = 32).
  int64_t cpu_window_bytes = int64_t{64} << 20;
  // CPU: the L2 cache per core that chunks of keys and values are sized for; 0: this CPU's
  // (sysconf). The plans are the same at every value; only the time and the memory move.
  int64_t cpu_l2_bytes = 0;
  int device = 0;  // CUDA device ordinal
  // CUDA kernels, named by method: "gemm" (cuBLAS GEMMs + simple kernels, radix-sort select)
  // or "fused" (the fused kernel, histogram select; requests it cannot take run on gemm).
  // "v0" and "v1", their names before, are still taken (CanonicalCudaKernels).
  std::string cuda_kernels = "gemm";
};

// "cpu" or "cuda"; "auto" is cpu for now (docs/daemon.md: until the CUDA backend has passed
// tests/gpu/run.sh on a GPU, then cuda when built and a device is present).
// INVALID_ARGUMENT for an unknown name; UNIMPLEMENTED when cuda is asked for but not built;
// UNAVAILABLE when cuda is built but no device is usable.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name,
                                                       const BackendOptions& options = {});
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options = {});

// BackendOptions::cuda_kernels by its method's name: "gemm" or "fused" as they are, the former
// names "v0" and "v1" as "gemm" and "fused" (`deprecated` set when one was given, so that
// laproxd can say so); INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<std::string> CanonicalCudaKernels(absl::string_view kernels,
                                                 bool* deprecated = nullptr);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_REGISTRY_H_
