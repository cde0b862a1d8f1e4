// Backend: the one interface every compute backend (CPU, CUDA) implements.
//
// A backend turns a model's output projections into prepared per-head factors once
// (PrepareModel), then answers keep-plan requests against them (ComputeKeepPlan). The public
// methods are non-virtual: they validate everything that can be checked without reading tensor
// data (shapes, strides, dtypes, memory spaces, options, integer overflow) and then call the
// protected ...Impl methods with those preconditions guaranteed. The Impl methods check what
// needs the data itself (NaN/Inf, probability rows) while they read it.
//
// The CPU backend is the reference: it computes tests/reference/SEMANTICS.md's algorithm, and
// tests/reference holds its plans to the float64 oracle. Another backend (CUDA) computes the
// same algorithm in fp32 in another order, so its plan may differ from the CPU plan for the same
// inputs as much as tests/cuda/cuda_backend_test.cc allows: candidate scores within 1e-4 relative
// (plus 1e-6 of the largest score), layer sums within 1e-4, the same number of kept tokens, and
// kept sets equal except for swaps of near-ties, tokens whose CPU scores lie within a relative
// 1e-5 of the selection threshold of their competition (with head_uniform_layers, also a layer's
// share moved by one token, so that the boundary ranks of its heads differ).
//
// Thread safety: a Backend may be used from several threads at once; a PreparedModel is
// immutable after PrepareModel returns and may be shared by concurrent requests.
#ifndef LAPROX_KERNELS_BACKEND_H_
#define LAPROX_KERNELS_BACKEND_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "laprox/kernels/device.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"
#include "laprox/kernels/stop.h"
#include "laprox/kernels/tensor_view.h"
#include "laprox/kernels/work.h"

namespace laprox::kernels {

enum class BackendKind { kCpu, kCuda };
absl::string_view BackendKindName(BackendKind kind);

struct PrepareOptions {
  // Also precompute the cross-Grams W_O^h W_O^h'^T within each KV group, which the EXACT_BLOCK
  // gqa_value needs: (G-1)/2 times more memory than the per-head factors.
  bool cross_grams = false;
  // Also keep each layer's o_proj.weight in fp32 (L * D * H * d * 4 bytes: 2 GiB for
  // Llama-3.1-8B, 40 MiB for SmolLM2-135M), which CRITICALKV and CRITICAL_ADAKV need for
  // ||v W_O^h||_1 (an L1 norm has no d x d shortcut). Without it those policies are
  // FAILED_PRECONDITION.
  bool output_projection = true;
};

// A model's per-head factors, prepared by one backend and usable only with that backend.
class PreparedModel {
 public:
  virtual ~PreparedModel() = default;
  PreparedModel(const PreparedModel&) = delete;
  PreparedModel& operator=(const PreparedModel&) = delete;

  const ModelGeometry& geometry() const { return geometry_; }
  const PrepareOptions& options() const { return options_; }
  BackendKind backend() const { return backend_; }
  // Bytes the prepared factors occupy (host or device memory of the backend).
  virtual int64_t ByteSize() const = 0;

 protected:
  PreparedModel(const ModelGeometry& geometry, const PrepareOptions& options, BackendKind backend)
      : geometry_(geometry), options_(options), backend_(backend) {}

 private:
  ModelGeometry geometry_;
  PrepareOptions options_;
  BackendKind backend_;
};

// The tensors of one layer. Shapes are logical; strides may be anything non-negative, so
// [1, Hkv, n, d] and [n, Hkv, d] engine layouts both fit without a copy.
struct LayerInputs {
  TensorView keys;              // [Hkv, n, d], post-RoPE
  TensorView values;            // [Hkv, n, d]
  TensorView window_queries;    // [H, wq, d], post-RoPE queries of the last wq positions, or
  TensorView window_attention;  // [H, wq, n], softmax rows of those queries (give one of the two)
  TensorView window_lse;        // optional [H, wq], natural-log normaliser of each query row
};

struct KeepPlanRequest {
  int64_t n = 0;                    // prompt tokens, 1 <= n <= kMaxTokens
  std::vector<LayerInputs> layers;  // one per model layer
  // A decode re-plan (tests/reference/SEMANTICS.md, "Decode re-plans"): n_l, the entries every
  // KV head of layer l holds now, keys and values [Hkv, n_l, d], the window rows the last wq
  // entries of every layer; n must be the largest. Empty: a prefill, every layer n entries.
  // Each layer is scored as a prefill of n_l tokens; one selection spans all of them. Plan
  // positions are entry indices (the service maps them to the engine's token positions).
  std::vector<int64_t> layer_entries;
  PolicySpec policy;
  OutputOptions outputs;
  // When the caller began checking this request (decoding it, resolving its regions). The
  // plan's timing.validate_seconds runs from here to the end of the backend's own checks, so
  // it is measured once, here, for every layer above; unset: from ComputeKeepPlan's entry.
  std::optional<std::chrono::steady_clock::time_point> checks_started;
  // When set, the computation stops at its next check once `stop` says so (stop.h: per chunk
  // of keys or values, per window row, per (layer, KV head), per sequence, per selection row)
  // and the call returns the signal's CANCELLED or DEADLINE_EXCEEDED, nothing else. Not owned;
  // must outlive the call. A batch's requests may share one signal.
  const StopSignal* stop = nullptr;

  static constexpr int64_t kMaxTokens = (int64_t{1} << 30);
};

// What one keep-plan request or model preparation may allocate on the host (and, for a device
// backend, device memory counts too), computed from shapes alone: nothing is read or allocated.
// An upper bound, in 64-bit arithmetic that saturates at INT64_MAX, so that a caller can
// reserve it against a memory budget before anything is allocated.
struct MemoryEstimate {
  int64_t workspace_bytes = 0;  // buffers freed before the call returns
  int64_t output_bytes = 0;     // what the call returns (the KeepPlan's vectors, the model)

  int64_t total() const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual BackendKind kind() const = 0;
  // One line for logs and GetServerInfo, e.g. "cpu: 2 threads, OpenBLAS 0.3.21".
  virtual std::string Describe() const = 0;
  // Whether ComputeKeepPlan computes plans of this policy kind (else it is UNIMPLEMENTED).
  virtual bool Supports(PolicyKind kind) const = 0;

  // Precomputes the per-head factors from each layer's o_proj.weight [D, H*d] (any dtype,
  // strides, memory space the backend reads). Blocks until done; the views are not retained.
  // INVALID_ARGUMENT: bad geometry, wrong layer count, shape or non-finite weights (naming the
  // layer), or finite weights so large that the factors could overflow fp32 ("o_proj[l]: ...",
  // tests/reference/SEMANTICS.md, "Finite inputs too large to score"); UNIMPLEMENTED: a memory
  // space this backend cannot read; RESOURCE_EXHAUSTED: no memory; CANCELLED /
  // DEADLINE_EXCEEDED once `stop` (may be null; checked per layer) says stop.
  absl::StatusOr<std::shared_ptr<const PreparedModel>> PrepareModel(
      const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
      const PrepareOptions& options = {}, const StopSignal* stop = nullptr);

  // Computes the keep-plan of one sequence. Blocks until the plan is complete; reads the input
  // views only during the call. Deterministic: the same inputs give the same plan, whatever the
  // thread count. INVALID_ARGUMENT names the field and values for every malformed input
  // (shape, stride, dtype, option, NaN/Inf, attention rows that are not probabilities, finite
  // keys, queries or values too large to score in fp32: SEMANTICS.md, "Finite inputs too large
  // to score"); no plan holds a NaN, and a non-finite score reaching the selection despite the
  // checks is INTERNAL (a broken invariant);
  // FAILED_PRECONDITION when the model was prepared by another backend, without cross-Grams
  // for EXACT_BLOCK or without the output projection for CRITICALKV / CRITICAL_ADAKV;
  // OUT_OF_RANGE when a view's extent overflows int64; UNIMPLEMENTED for a memory space the
  // backend cannot read or a policy kind it does not implement (see Supports).
  absl::StatusOr<KeepPlan> ComputeKeepPlan(const PreparedModel& model,
                                           const KeepPlanRequest& request);

  // The keep-plans of several sequences of one model in one call, e.g. the prefills an engine
  // finished in one step (each request its own n, inputs, policy, budget and outputs). Every
  // request is checked as ComputeKeepPlan checks it, all of them before any tensor data is read;
  // plans[i] equals ComputeKeepPlan(model, requests[i]) but for its timing (score and select
  // seconds are the whole batch's stages). All or nothing: the lowest-numbered failing request
  // fails the call with its status prefixed "sequences[i].", and no plan is returned.
  // INVALID_ARGUMENT for an empty batch. A backend may compute the sequences together (the CPU
  // backend spreads every (sequence, layer, KV head) over its workers).
  absl::StatusOr<std::vector<KeepPlan>> ComputeKeepPlans(
      const PreparedModel& model, absl::Span<const KeepPlanRequest> requests);

  // The most ComputeKeepPlan(model, request) allocates, after the same checks it runs before
  // reading data (and with the same errors). output_bytes bounds the KeepPlan's vectors.
  absl::StatusOr<MemoryEstimate> EstimateKeepPlanMemory(const PreparedModel& model,
                                                        const KeepPlanRequest& request) const;
  // The most PrepareModel(geometry, ..., options) allocates; output_bytes is the prepared
  // model's ByteSize(). INVALID_ARGUMENT for a bad geometry.
  absl::StatusOr<MemoryEstimate> EstimatePrepareMemory(const ModelGeometry& geometry,
                                                       const PrepareOptions& options = {}) const;

  // The work of ComputeKeepPlan(model, request) (work.h: flops and bytes read, from shapes),
  // after the same checks it runs before reading data, with the same errors.
  absl::StatusOr<WorkEstimate> EstimateKeepPlanWork(const PreparedModel& model,
                                                    const KeepPlanRequest& request) const;
  // The largest work a server should let one request of this backend do when its operator
  // sets no limit: tens of seconds of this backend on a small machine (the CPU backend on
  // 2 cores, a GPU for the CUDA backend; work.h).
  virtual int64_t DefaultMaxRequestWork() const = 0;

  // Opens a CUDA IPC allocation of another process on this backend's device, once; the region
  // stays open until the returned object is destroyed. INVALID_ARGUMENT: handle not exactly
  // 64 bytes, malformed UUID, negative offset or byte_size <= 0 (checked here, before the
  // backend is asked); UNIMPLEMENTED: a backend without device memory (the CPU backend);
  // NOT_FOUND: no visible device has that UUID; INVALID_ARGUMENT: the UUID names another
  // device than the one this backend computes on, or the driver refuses the handle;
  // OUT_OF_RANGE: offset + byte_size past the end of the allocation.
  absl::StatusOr<std::unique_ptr<ImportedRegion>> ImportCudaIpc(const CudaIpcRegionSpec& spec);

  // The GPUs this backend sees (empty for the CPU backend), the active one with its memory in
  // use. Queries the driver: for GetServerInfo and metric scrapes, not the hot path.
  virtual std::vector<DeviceDescription> Devices() const { return {}; }

  // Copies `bytes` host bytes to `dst` in `space` (a registered output region) and waits for
  // the copy. UNIMPLEMENTED for a space the backend cannot write; INTERNAL on a device error.
  virtual absl::Status CopyToRegion(void* dst, MemorySpace space, const void* src, int64_t bytes);

  // OK while the backend can compute; UNAVAILABLE with the cause after a sticky device error
  // (the CUDA context is unusable until the process restarts). The health service reports
  // NOT_SERVING while it is not OK.
  virtual absl::Status Health() const { return absl::OkStatus(); }

 protected:
  Backend() = default;

  virtual bool CanRead(MemorySpace space) const = 0;
  // Whether keys and values may be paged views (TensorView::Paged).
  virtual bool CanReadPaged() const { return false; }
  // Whether ComputeKeepPlan takes decode re-plans (KeepPlanRequest::layer_entries).
  virtual bool CanReplanDecode() const { return false; }
  // Preconditions: geometry valid, o_proj.size() == L, each [D, H*d] in a readable space.
  virtual absl::StatusOr<std::shared_ptr<const PreparedModel>> PrepareModelImpl(
      const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
      const PrepareOptions& options, const StopSignal* stop) = 0;
  // Preconditions: everything ComputeKeepPlan checks before it reads data (shapes, strides,
  // dtypes, readable spaces, options, the model's preparation); `shape` derived from `request`.
  virtual absl::StatusOr<KeepPlan> ComputeKeepPlanImpl(const PreparedModel& model,
                                                       const KeepPlanRequest& request,
                                                       const RequestShape& shape) = 0;
  // Preconditions: every request checked as ComputeKeepPlanImpl's, shapes[i] derived from
  // requests[i]; a failure's status names the sequence ("sequences[i].layers[0]..."). The default
  // computes the sequences one after the other with ComputeKeepPlanImpl.
  virtual absl::StatusOr<std::vector<KeepPlan>> ComputeKeepPlansImpl(
      const PreparedModel& model, absl::Span<const KeepPlanRequest> requests,
      absl::Span<const RequestShape> shapes);
  // `status` of sequence `index` of a batch: its message prefixed "sequences[index].".
  static absl::Status InSequence(size_t index, const absl::Status& status);
  // Preconditions: handle size, UUID syntax, offset and byte_size checked. The default is
  // UNIMPLEMENTED (no device memory).
  virtual absl::StatusOr<std::unique_ptr<ImportedRegion>> ImportCudaIpcImpl(
      const CudaIpcRegionSpec& spec);

  // The scratch ComputeKeepPlanImpl allocates at most for `shape`, beyond the plan it returns
  // (saturating). The default counts what a device backend keeps on the host: the raw scores
  // read back and the selection's marks.
  virtual int64_t KeepPlanWorkspaceBytes(const ModelGeometry& geometry, const RequestShape& shape,
                                         const PolicySpec& policy) const;
  // The scratch PrepareModelImpl allocates at most, beyond the prepared model (saturating).
  virtual int64_t PrepareWorkspaceBytes(const ModelGeometry& geometry,
                                        const PrepareOptions& options) const;

 private:
  // Everything ComputeKeepPlan checks before it reads any tensor data.
  absl::StatusOr<RequestShape> CheckKeepPlanRequest(const PreparedModel& model,
                                                    const KeepPlanRequest& request) const;
  // What every plan gets after its Impl: the block tables' physical ids and validate_seconds
  // (from the request's checks_started or `entered`, to `validated`).
  static void FinishPlan(const KeepPlanRequest& request,
                         std::chrono::steady_clock::time_point entered,
                         std::chrono::steady_clock::time_point validated, KeepPlan& plan);
};

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_BACKEND_H_
