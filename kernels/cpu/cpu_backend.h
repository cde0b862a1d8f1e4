// CpuBackend: the reference backend. fp32 math on host memory, OpenBLAS sgemm for Q.K^T, the
// value factors ||v T_h|| through triangular factors (cpu/triangular.h), worker threads over
// (layer, KV head) pairs with single-threaded BLAS inside. Implements LAPROX and every baseline
// policy.
#ifndef LAPROX_KERNELS_CPU_CPU_BACKEND_H_
#define LAPROX_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cpu {

class CpuPreparedModel;

class CpuBackend final : public Backend {
 public:
  // `threads` >= 1 workers per request over (layer, KV head) pairs (the calling thread and
  // threads - 1 of the backend's pool, whatever other requests run at once), each holding at most
  // `window_bytes` of LAPROX's window probabilities (BackendOptions::cpu_window_bytes), reading
  // keys and values in chunks sized for an L2 of `l2_bytes` per core (cpu/window.h's KeyChunk and
  // ValueChunk; 0: this CPU's). Sets OpenBLAS to one thread per call (a process-wide OpenBLAS
  // setting).
  explicit CpuBackend(int threads, int64_t window_bytes = int64_t{64} << 20, int64_t l2_bytes = 0);

  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string Describe() const override;
  // 2^42 work units: 24-44 s of this backend on the 2 vCPUs of bench/RESULTS.md ("Work budget").
  int64_t DefaultMaxRequestWork() const override { return int64_t{1} << 42; }
  // Every policy kind: LAPROX and the baselines.
  bool Supports(PolicyKind) const override { return true; }

 protected:
  bool CanRead(MemorySpace space) const override { return space == MemorySpace::kHost; }
  bool CanReadPaged() const override { return true; }  // cpu/rows.cc reads through the table
  bool CanReplanDecode() const override { return true; }
  absl::StatusOr<std::shared_ptr<const PreparedModel>> PrepareModelImpl(
      const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
      const PrepareOptions& options, const StopSignal* stop) override;
  absl::StatusOr<KeepPlan> ComputeKeepPlanImpl(const PreparedModel& model,
                                               const KeepPlanRequest& request,
                                               const RequestShape& shape) override;
  absl::StatusOr<std::vector<KeepPlan>> ComputeKeepPlansImpl(
      const PreparedModel& model, absl::Span<const KeepPlanRequest> requests,
      absl::Span<const RequestShape> shapes) override;
  int64_t KeepPlanWorkspaceBytes(const ModelGeometry& geometry, const RequestShape& shape,
                                 const PolicySpec& policy) const override;
  int64_t PrepareWorkspaceBytes(const ModelGeometry& geometry,
                                const PrepareOptions& options) const override;

 private:
  // Scores every (sequence, layer, KV head) in one pass over the workers, then selects every
  // sequence's plan (sequences in parallel). On failure *failed is the lowest failing sequence.
  absl::StatusOr<std::vector<KeepPlan>> RunSequences(const PreparedModel& model,
                                                     absl::Span<const KeepPlanRequest> requests,
                                                     absl::Span<const RequestShape> shapes,
                                                     int64_t* failed);

  int threads_;
  int64_t window_bytes_;
  int64_t l2_bytes_;
  // The worker threads, "laprox-cpu-<k>", joined when the backend is destroyed. Each call takes
  // threads_ workers, itself one of them; the pool grows to threads_ - 1 times the number of
  // calls ever in flight at once (laproxd's --workers plus --heavy_workers), so concurrent
  // requests do not share workers (common/parallel.h).
  WorkerPool pool_{"laprox-cpu"};
};

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_CPU_BACKEND_H_
