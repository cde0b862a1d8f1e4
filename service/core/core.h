// Core: what laproxd does, in domain types — regions, models and keep-plan requests.
//
// The gRPC layer (service/grpc/) only translates protos into these types and back. Requests
// name tensors by TensorRef (a slice of a registered region, or bytes carried in the request);
// Core resolves every reference to a kernels::TensorView, checking it against its region without
// integer overflow, before the backend reads anything.
//
// Nothing a request implies is allocated before it is sized and reserved: a keep-plan's
// workspace and plan against the request memory budget (shared by concurrent requests), a
// model's prepared factors against the model memory budget for as long as the model lives
// (MemoryBudget). Outputs written into a client region never overlap the request's inputs or
// each other, and nothing is written once the call is cancelled or past its deadline.
//
// Thread safety: every method may be called concurrently.
#ifndef LAPROX_SERVICE_CORE_CORE_H_
#define LAPROX_SERVICE_CORE_CORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "laprox/kernels/backend.h"
#include "service/core/memory_budget.h"
#include "service/core/owner.h"
#include "service/core/region_registry.h"

namespace laprox::service {

// Where a tensor's bytes are, and how to read them.
struct TensorRef {
  enum class Source { kAbsent, kRegion, kInline };
  Source source = Source::kAbsent;
  uint64_t region_id = 0;          // kRegion
  int64_t byte_offset = 0;         // kRegion: bytes from the region start to element 0
  absl::string_view inline_bytes;  // kInline: not owned, must outlive the call
  kernels::DType dtype = kernels::DType::kF32;
  kernels::Dims shape;
  kernels::Dims strides;  // elements; empty means contiguous row-major
  // Set for a paged tensor (kRegion only, strides empty): the index of its table in
  // KeepPlanCall::block_tables and the layout's strides (kernels::PagedLayout).
  struct Paged {
    uint32_t block_table = 0;
    int64_t block_stride = 0, slot_stride = 0, head_stride = 0, dim_stride = 0;
  };
  std::optional<Paged> paged;
};

// A block table as the request gives it; Core checks it once (kernels::BlockTable::Create).
struct BlockTableSpec {
  absl::Span<const int32_t> ids;  // not owned, must outlive the call
  int64_t block_size = 0;
  bool allow_repeated_ids = false;
  // Instead of `ids`: `count` int32 ids in a registered region from `byte_offset`, copied
  // before they are checked (the request memory budget covers the copy).
  struct InRegion {
    uint64_t region_id = 0;
    int64_t byte_offset = 0;
    int64_t count = 0;
  };
  std::optional<InRegion> in_region;
};

struct LayerRefs {
  TensorRef keys, values, window_queries, window_attention, window_lse;
};

struct ModelSpec {
  std::string name;  // at most 128 bytes of [A-Za-z0-9._/:-]; empty: the decimal id
  kernels::ModelGeometry geometry;
  std::vector<TensorRef> o_proj;  // one [D, H*d] per layer
  bool cross_grams = false;
  // Bytes the caller keeps for this model beside its prepared factors for as long as it is
  // registered (the gRPC layer: its metrics series), reserved with them against the model
  // memory budget.
  int64_t bookkeeping_bytes = 0;
};

// Where to write outputs in a writable region the client registered, as byte offsets; an
// output with an offset is written there (positions, bitmask and scores are then left out of the
// returned plan; counts and offsets stay in it too). A cuda_ipc region is written through
// Backend::CopyToRegion, which has finished the copy when ComputeKeepPlan returns.
using kernels::OutputDestination;

// One layer of a decode re-plan's cache (laprox.proto, DecodeCache): the entries every KV head
// holds and their token positions [Hkv, entries], not owned (must outlive the call).
struct CacheLayer {
  int64_t entries = 0;
  absl::Span<const int32_t> positions;
};

struct KeepPlanCall {
  uint64_t model_id = 0;
  int64_t n = 0;
  std::vector<LayerRefs> layers;
  kernels::PolicySpec policy;
  kernels::OutputOptions outputs;
  std::optional<OutputDestination> destination;
  std::vector<BlockTableSpec> block_tables;
  // Set: a decode re-plan of this cache (one entry per layer); the plan's positions are then
  // the token positions of the kept entries. Unset: a prefill plan.
  std::optional<std::vector<CacheLayer>> cache;
};

struct CoreLimits {
  int64_t max_regions = 1024;
  int64_t max_models = 64;
  int64_t max_tokens = int64_t{1} << 20;  // n per request
  int64_t max_batch_sequences = 256;      // sequences per ComputeKeepPlans call
  // Bytes the requests computing at once may reserve together (workspace and plans); 0: half
  // of ProcessMemoryLimit().
  int64_t max_request_memory = 0;
  // Bytes the registered models' prepared factors may hold together; 0: a quarter of
  // ProcessMemoryLimit().
  int64_t max_model_memory = 0;
  // Work units (kernels/work.h: flops plus bytes read) one call may do: a keep-plan call (a
  // batch's sequences together) or a model's preparation; 0: the backend's
  // DefaultMaxRequestWork().
  int64_t max_request_work = 0;
  // Keep-plan calls of more work than this are heavy (Core::IsHeavy: the service computes them
  // on workers of their own); 0: max_request_work / 256.
  int64_t heavy_request_work = 0;
};

// The call a request arrives with: its deadline and cancellation, checked before the compute
// starts, by the backend while it computes (kernels::StopSignal: per chunk of keys or values,
// per window row, per (layer, KV head), per selection row), and again just before any output is
// written into a client region.
struct CallContext {
  // Who asks: the model and every region the call names must be visible to it (owner.h). No
  // default: every caller says whom it acts for (Owner::Laproxd() only where laproxd itself acts).
  Owner owner;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty: never cancelled
  // When set, receives the request's memory reservation, so the caller can hold it while it
  // still keeps copies of the plan (the response being built).
  MemoryBudget::Reservation* hold_memory = nullptr;
  // When the caller began on this request (before decoding it); unset: Core's entry. The
  // plan's validate_seconds counts from here.
  std::optional<std::chrono::steady_clock::time_point> started;
};

struct CoreOptions {
  // Every caller may compute with any registered model (engines often share one model
  // registration); only the model's owner may unregister it. Regions stay private.
  bool shared_models = false;
  // The first region id and the first model id (then counting up). laproxd picks a random one
  // at every start: an id a client kept from before a restart then names nothing (NOT_FOUND)
  // instead of what another process of the same identity registered since.
  uint64_t first_id = 1;
};

struct ModelInfo {
  uint64_t id = 0;
  std::string name;
  kernels::ModelGeometry geometry;
  int64_t prepared_bytes = 0;
};

class Core {
 public:
  Core(std::unique_ptr<kernels::Backend> backend, const CoreLimits& limits,
       CoreOptions options = {});

  const kernels::Backend& backend() const { return *backend_; }
  // The limits as configured, with every 0 ("derived") resolved.
  const CoreLimits& limits() const { return limits_; }
  // The regions clients registered: shared memory, and CUDA IPC allocations opened through the
  // backend (read in place as device memory by requests).
  RegionRegistry& regions() { return regions_; }
  const MemoryBudget& request_memory() const { return request_memory_; }
  const MemoryBudget& model_memory() const { return model_memory_; }

  // Prepares the model's factors (the o_proj tensors are read during this call only).
  // INVALID_ARGUMENT for a bad name or geometry; INVALID_ARGUMENT / NOT_FOUND / OUT_OF_RANGE for
  // bad references (naming "o_proj[l]"); RESOURCE_EXHAUSTED past max_models or when the
  // prepared factors do not fit the model memory budget (or their preparation the request
  // memory budget, or the preparation's work (kernels::PrepareWork) exceeds max_request_work);
  // FAILED_PRECONDITION when a region read is shrunk by its client; CANCELLED /
  // DEADLINE_EXCEEDED when the call stops during the preparation; and whatever
  // Backend::PrepareModel returns. The model belongs to context.owner, and the o_proj regions
  // must be visible to it.
  absl::StatusOr<ModelInfo> RegisterModel(const ModelSpec& spec, const CallContext& context);
  absl::StatusOr<ModelInfo> RegisterModel(const ModelSpec& spec, const Owner& owner);
  // INVALID_ARGUMENT for id 0, NOT_FOUND for an unknown id or another owner's model (shared
  // models included). Requests already using the model finish with it; its memory returns to
  // the budget when the last of them ends.
  absl::Status UnregisterModel(uint64_t id, const Owner& owner);

  struct ModelTotals {
    int64_t count = 0;
    int64_t prepared_bytes = 0;
  };
  // The registered models, counted (for metrics).
  ModelTotals model_totals() const;

  // Resolves every reference (holding leases on the regions it names until the plan is
  // computed), reserves the request's memory, computes the plan, and writes the outputs the
  // destination names. INVALID_ARGUMENT: model or region id 0, an inline tensor whose strides
  // repeat elements (zero or overlapping strides: put such a tensor in a region); NOT_FOUND:
  // unknown model or region, or one context.owner may not see; OUT_OF_RANGE: n above max_tokens;
  // reference errors name the field
  // ("layers[3].keys"); RESOURCE_EXHAUSTED: the request's workspace and plan do not fit the
  // request memory budget now, or its work (kernels/work.h) exceeds max_request_work; CANCELLED
  // / DEADLINE_EXCEEDED when the call stops before or while it computes (the computation stops
  // at the backend's next check); then whatever Backend::ComputeKeepPlan returns.
  //
  // Outputs: every destination area is checked before the first byte is written — inside the
  // region (OUT_OF_RANGE), aligned (INVALID_ARGUMENT), not overlapping another area or any input
  // of the request in the same memory (INVALID_ARGUMENT naming both; judged on the memory, so a
  // second registration of the same object counts), the region writable (FAILED_PRECONDITION).
  // Then, if the call was cancelled (CANCELLED) or is past its deadline (DEADLINE_EXCEEDED),
  // nothing is written. A region the client shrank during the call fails it with
  // FAILED_PRECONDITION (MappedRegion::CheckIntact); if that region is the destination, the
  // areas may hold any bytes. Otherwise all areas are written, in one pass of copies, before
  // this returns OK: a client that sees any other status must not read them.
  absl::StatusOr<kernels::KeepPlan> ComputeKeepPlan(const KeepPlanCall& call,
                                                    const CallContext& context);

  // The keep-plans of a batch of sequences of one model (Backend::ComputeKeepPlans), each call
  // checked, leased and written exactly as ComputeKeepPlan does, with three differences: every
  // sequence must name the same model (INVALID_ARGUMENT otherwise); the memory of all of them is
  // reserved at once; and the calls are all or nothing: the first failing sequence fails the
  // batch, its message prefixed "sequences[i].", no plan is returned and no output written.
  // Output areas must not overlap each other or any input of any sequence of the batch.
  // INVALID_ARGUMENT for an empty batch or more than max_batch_sequences.
  absl::StatusOr<std::vector<kernels::KeepPlan>> ComputeKeepPlans(
      absl::Span<const KeepPlanCall> calls, const CallContext& context);

  // Whether keep-plan `calls` (one call, or a batch) are heavy: their estimated work, from the
  // shapes the calls state before anything is resolved or checked, exceeds
  // limits().heavy_request_work. For scheduling only: ComputeKeepPlan(s) checks the real work
  // against max_request_work. An unknown model or malformed call is not heavy (it fails fast).
  bool IsHeavy(absl::Span<const KeepPlanCall> calls, const Owner& owner) const;

 private:
  struct Model {
    MemoryBudget::Reservation memory;  // the prepared factors, against model_memory_ (released
                                       // last)
    Owner owner;
    ModelInfo info;
    std::shared_ptr<const kernels::PreparedModel> prepared;
  };

  // The registered model `id` as `owner` may use it (NOT_FOUND otherwise).
  absl::StatusOr<std::shared_ptr<const Model>> FindModel(uint64_t id, const Owner& owner) const;
  // ComputeKeepPlan (one call, batch false: messages without a sequence prefix) and
  // ComputeKeepPlans.
  absl::StatusOr<std::vector<kernels::KeepPlan>> Compute(absl::Span<const KeepPlanCall> calls,
                                                         const CallContext& context, bool batch);

  std::unique_ptr<kernels::Backend> backend_;
  const CoreLimits limits_;
  const CoreOptions options_;
  RegionRegistry regions_;
  MemoryBudget request_memory_;
  MemoryBudget model_memory_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Model>> models_ ABSL_GUARDED_BY(mu_);
  uint64_t next_model_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_CORE_H_
