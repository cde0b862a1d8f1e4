#include "laprox/kernels/backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/saturating.h"
#include "common/status_macros.h"
#include "laprox/kernels/layer_tensors.h"
#include "policy/blocks.h"
#include "policy/budget.h"

namespace laprox::kernels {
namespace {

// Checks rank, shape and extent of one input view. `name` is the field path for messages,
// e.g. "layers[3].keys".
absl::Status CheckView(const std::string& name, const TensorView& view, const Dims& expected,
                       bool pageable = false) {
  if (view.empty()) return absl::InvalidArgumentError(absl::StrCat(name, " is missing"));
  if (view.paged() && !pageable) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " is paged; only keys and values may be (", view.DebugString(), ")"));
  }
  if (view.shape() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has shape ", view.DebugString(),
                                                   ", expected [", absl::StrJoin(expected, ", "),
                                                   "]"));
  }
  int64_t extent;
  absl::Status status = view.ElementExtent(&extent);
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat(name, ": ", status.message()));
  return absl::OkStatus();
}

// The block size of a block-shaped plan (policy.block_size, else the block size of the table
// layers[0].keys is read through) into shape.block_size and num_blocks; every table a paged
// key or value is read through must have that block size.
absl::Status ResolveBlockSize(const KeepPlanRequest& request, RequestShape& shape) {
  const PlanShape plan_shape = request.policy.EffectivePlanShape();
  if (!IsBlockShape(plan_shape)) return absl::OkStatus();
  int64_t bs = request.policy.block_size;
  const TensorView& keys = request.layers[0].keys;
  if (bs == 0) {
    if (!keys.paged()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.plan_shape = ", PlanShapeName(plan_shape),
          " needs a block size: set policy.block_size, or page layers[0].keys through a block "
          "table"));
    }
    bs = keys.layout().table->block_size();
  }
  for (size_t l = 0; l < request.layers.size(); ++l) {
    LAPROX_RETURN_IF_ERROR(ForEachLayerTensor(
        [&](LayerTensor tensor, const TensorView& view) {
          if (!view.paged() || view.layout().table->block_size() == bs) return absl::OkStatus();
          return absl::InvalidArgumentError(absl::StrCat(
              "layers[", l, "].", tensor.name, " is read through a block table of block size ",
              view.layout().table->block_size(), ", but the plan's blocks have ", bs,
              request.policy.block_size != 0 ? " (policy.block_size)"
                                             : " (the block size of layers[0].keys)"));
        },
        request.layers[l]));
  }
  shape.block_size = bs;
  shape.num_blocks = BlockTable::BlocksFor(shape.n, bs);
  return absl::OkStatus();
}

// A decode re-plan's own checks (SEMANTICS.md, "Decode re-plans"): one entry count per layer,
// each in [1, n] and the largest n; the window rows inside the shortest layer; LAPROX only, a
// token plan shape, window queries without lse, a budget in tokens. Fills shape.layer_n.
absl::Status CheckDecodeReplan(const KeepPlanRequest& request, int64_t L, int64_t wq,
                               RequestShape& shape) {
  const std::vector<int64_t>& entries = request.layer_entries;
  if (static_cast<int64_t>(entries.size()) != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache.layers has ", entries.size(), " layers, the model has ", L));
  }
  int64_t shortest = request.n, longest = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (entries[l] < 1 || entries[l] > request.n) {
      return absl::InvalidArgumentError(absl::StrCat("cache.layers[", l, "].entries = ", entries[l],
                                                     " is outside [1, n = ", request.n, "]"));
    }
    shortest = std::min(shortest, entries[l]);
    longest = std::max(longest, entries[l]);
  }
  if (longest != request.n) {
    return absl::InvalidArgumentError(absl::StrCat("n = ", request.n,
                                                   " must be the longest layer's entries, ",
                                                   longest, ", in a decode re-plan"));
  }
  if (wq > shortest) {
    return absl::InvalidArgumentError(absl::StrCat("the window is longer than the cache: ", wq,
                                                   " window rows, but the shortest layer "
                                                   "holds ",
                                                   shortest, " entries"));
  }
  const PolicySpec& policy = request.policy;
  if (policy.kind != PolicyKind::kLaprox) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a decode re-plan takes policy.kind = LAPROX, not ", PolicyKindName(policy.kind)));
  }
  const PlanShape plan_shape = policy.EffectivePlanShape();
  if (IsBlockShape(plan_shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a decode re-plan takes policy.plan_shape = RAGGED or LAYER_UNIFORM, not ",
                     PlanShapeName(plan_shape)));
  }
  if (policy.budget.kind != Budget::Kind::kTokensPerHead) {
    return absl::InvalidArgumentError(
        "a decode re-plan takes budget.tokens_per_head, not a compression_ratio (of which n?)");
  }
  for (int64_t l = 0; l < L; ++l) {
    const LayerInputs& layer = request.layers[l];
    if (!layer.window_attention.empty() || !layer.window_lse.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layers[", l, "].", layer.window_lse.empty() ? "window_attention" : "window_lse",
          " is given; a decode re-plan takes window_queries only"));
    }
  }
  shape.layer_n = entries;
  return absl::OkStatus();
}

// The checks ComputeKeepPlan runs before any tensor data is read (the backend-independent
// part; CheckKeepPlanRequest adds the backend's own). Returns the derived shape.
absl::StatusOr<RequestShape> ValidateKeepPlanRequest(const ModelGeometry& geometry,
                                                     const PrepareOptions& prepared,
                                                     const KeepPlanRequest& request) {
  LAPROX_RETURN_IF_ERROR(request.policy.Validate());
  const int64_t n = request.n;
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("n = ", n, " must be at least 1"));
  if (n > KeepPlanRequest::kMaxTokens) {
    return absl::OutOfRangeError(absl::StrCat("n = ", n, " exceeds the backend's limit of ",
                                              KeepPlanRequest::kMaxTokens, " tokens"));
  }
  const int64_t L = geometry.num_layers, H = geometry.num_heads, Hkv = geometry.num_kv_heads,
                d = geometry.head_dim;
  if (static_cast<int64_t>(request.layers.size()) != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("request has ", request.layers.size(), " layers, the model has ", L));
  }
  if (!FitsPlanEntries(L, Hkv, n)) {
    return absl::OutOfRangeError(
        absl::StrCat("L*Hkv*n = ", L * Hkv * n, " exceeds the 2^32 tokens one request may score"));
  }
  const PolicyKind kind = request.policy.kind;
  if (kind == PolicyKind::kLaprox && request.policy.EffectiveGqaValue() == GqaValue::kExactBlock &&
      !prepared.cross_grams) {
    return absl::FailedPreconditionError(
        "policy.gqa_value = EXACT_BLOCK needs a model prepared with cross_grams");
  }
  if ((kind == PolicyKind::kCriticalKv || kind == PolicyKind::kCriticalAdaKv) &&
      !prepared.output_projection) {
    return absl::FailedPreconditionError(absl::StrCat("policy.kind = ", PolicyKindName(kind),
                                                      " needs a model prepared with "
                                                      "output_projection"));
  }

  RequestShape shape;
  shape.n = n;
  shape.num_layers = geometry.num_layers;
  shape.num_kv_heads = geometry.num_kv_heads;
  shape.group_size = geometry.group_size();
  shape.head_dim = geometry.head_dim;

  const LayerInputs& first = request.layers[0];
  shape.attention_given = first.window_queries.empty();
  shape.lse_given = !first.window_lse.empty();
  const TensorView& first_window =
      shape.attention_given ? first.window_attention : first.window_queries;
  if (first_window.empty()) {
    return absl::InvalidArgumentError("layers[0] has neither window_queries nor window_attention");
  }
  if (first_window.rank() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers[0].", shape.attention_given ? "window_attention" : "window_queries",
                     " has shape ", first_window.DebugString(), ", expected rank 3"));
  }
  const int64_t wq = first_window.dim(1);
  if (wq < 1 || wq > PolicySpec::kMaxWindow) {
    return absl::InvalidArgumentError(
        absl::StrCat("window rows given = ", wq, " is outside [1, ", PolicySpec::kMaxWindow, "]"));
  }
  // STREAMING_LLM reads no window, so its window option cannot contradict the rows given.
  if (kind != PolicyKind::kStreamingLlm && request.policy.window > wq) {
    return absl::InvalidArgumentError(absl::StrCat("policy.window = ", request.policy.window,
                                                   " is larger than the ", wq,
                                                   " window rows given"));
  }
  shape.window_rows = static_cast<int32_t>(wq);
  if (!request.layer_entries.empty()) {
    LAPROX_RETURN_IF_ERROR(CheckDecodeReplan(request, L, wq, shape));
  }

  for (int64_t l = 0; l < L; ++l) {
    const LayerInputs& layer = request.layers[l];
    const std::string prefix = absl::StrCat("layers[", l, "].");
    const int64_t entries = LayerEntries(shape, l);
    LAPROX_RETURN_IF_ERROR(CheckView(prefix + "keys", layer.keys, {Hkv, entries, d}, true));
    LAPROX_RETURN_IF_ERROR(CheckView(prefix + "values", layer.values, {Hkv, entries, d}, true));
    if (!layer.window_queries.empty() && !layer.window_attention.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "window_queries and window_attention are both given"));
    }
    if (shape.attention_given) {
      if (!layer.window_queries.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(prefix, "window_queries given but layers[0] gave window_attention"));
      }
      LAPROX_RETURN_IF_ERROR(
          CheckView(prefix + "window_attention", layer.window_attention, {H, wq, n}));
      if (!layer.window_lse.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(prefix, "window_lse goes with window_queries, not window_attention"));
      }
    } else {
      if (!layer.window_attention.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(prefix, "window_attention given but layers[0] gave window_queries"));
      }
      LAPROX_RETURN_IF_ERROR(
          CheckView(prefix + "window_queries", layer.window_queries, {H, wq, d}));
      if (layer.window_lse.empty() == shape.lse_given) {
        return absl::InvalidArgumentError(
            absl::StrCat(prefix, "window_lse must be given for every layer or for none"));
      }
      if (shape.lse_given) {
        LAPROX_RETURN_IF_ERROR(CheckView(prefix + "window_lse", layer.window_lse, {H, wq}));
      }
    }
  }
  policy::DeriveBudget(request.policy, shape);
  LAPROX_RETURN_IF_ERROR(ResolveBlockSize(request, shape));
  return shape;
}

}  // namespace

absl::string_view BackendKindName(BackendKind kind) {
  return kind == BackendKind::kCuda ? "cuda" : "cpu";
}

absl::StatusOr<std::shared_ptr<const PreparedModel>> Backend::PrepareModel(
    const ModelGeometry& geometry, absl::Span<const TensorView> o_proj,
    const PrepareOptions& options, const StopSignal* stop) {
  LAPROX_RETURN_IF_ERROR(geometry.Validate());
  if (static_cast<int64_t>(o_proj.size()) != geometry.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "o_proj has ", o_proj.size(), " layers, geometry.num_layers = ", geometry.num_layers));
  }
  const Dims expected = {geometry.hidden_size, int64_t{geometry.num_heads} * geometry.head_dim};
  for (size_t l = 0; l < o_proj.size(); ++l) {
    const std::string name = absl::StrCat("o_proj[", l, "]");
    LAPROX_RETURN_IF_ERROR(CheckView(name, o_proj[l], expected));
    if (!CanRead(o_proj[l].space())) {
      return absl::UnimplementedError(absl::StrCat(
          name, " is in a memory space the ", BackendKindName(kind()), " backend cannot read"));
    }
  }
  LAPROX_RETURN_IF_ERROR(CheckStop(stop, "preparing the model"));
  return PrepareModelImpl(geometry, o_proj, options, stop);
}

absl::StatusOr<RequestShape> Backend::CheckKeepPlanRequest(const PreparedModel& model,
                                                           const KeepPlanRequest& request) const {
  if (!request.layer_entries.empty() && !CanReplanDecode()) {
    return absl::UnimplementedError(
        absl::StrCat("decode re-plans (cache) are not implemented by "
                     "the ",
                     BackendKindName(kind()), " backend; the cpu backend computes them"));
  }
  if (!Supports(request.policy.kind)) {
    return absl::UnimplementedError(
        absl::StrCat("policy.kind = ", PolicyKindName(request.policy.kind),
                     " is not implemented by the ", BackendKindName(kind()), " backend"));
  }
  if (model.backend() != kind()) {
    return absl::FailedPreconditionError(absl::StrCat("model was prepared by the ",
                                                      BackendKindName(model.backend()),
                                                      " backend, not ", BackendKindName(kind())));
  }
  LAPROX_ASSIGN_OR_RETURN(RequestShape shape,
                          ValidateKeepPlanRequest(model.geometry(), model.options(), request));
  for (size_t l = 0; l < request.layers.size(); ++l) {
    LAPROX_RETURN_IF_ERROR(ForEachLayerTensor(
        [&](LayerTensor tensor, const TensorView& view) {
          if (view.empty()) return absl::OkStatus();
          if (!CanRead(view.space())) {
            return absl::UnimplementedError(
                absl::StrCat("layers[", l, "].", tensor.name, " is in a memory space the ",
                             BackendKindName(kind()), " backend cannot read"));
          }
          if (view.paged() && !CanReadPaged()) {
            return absl::UnimplementedError(absl::StrCat(
                "layers[", l, "].", tensor.name, " is paged; the ", BackendKindName(kind()),
                " backend does not read paged tensors yet (gather them)"));
          }
          return absl::OkStatus();
        },
        request.layers[l]));
  }
  return shape;
}

absl::StatusOr<KeepPlan> Backend::ComputeKeepPlan(const PreparedModel& model,
                                                  const KeepPlanRequest& request) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  LAPROX_ASSIGN_OR_RETURN(RequestShape shape, CheckKeepPlanRequest(model, request));
  const Clock::time_point validated = Clock::now();
  absl::StatusOr<KeepPlan> plan = ComputeKeepPlanImpl(model, request, shape);
  if (plan.ok()) FinishPlan(request, start, validated, *plan);
  return plan;
}

absl::StatusOr<std::vector<KeepPlan>> Backend::ComputeKeepPlans(
    const PreparedModel& model, absl::Span<const KeepPlanRequest> requests) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  if (requests.empty()) return absl::InvalidArgumentError("sequences: the batch is empty");
  std::vector<RequestShape> shapes;
  shapes.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<RequestShape> shape = CheckKeepPlanRequest(model, requests[i]);
    if (!shape.ok()) return InSequence(i, shape.status());
    shapes.push_back(*shape);
  }
  const Clock::time_point validated = Clock::now();
  LAPROX_ASSIGN_OR_RETURN(std::vector<KeepPlan> plans,
                          ComputeKeepPlansImpl(model, requests, shapes));
  for (size_t i = 0; i < plans.size(); ++i) FinishPlan(requests[i], start, validated, plans[i]);
  return plans;
}

absl::StatusOr<std::vector<KeepPlan>> Backend::ComputeKeepPlansImpl(
    const PreparedModel& model, absl::Span<const KeepPlanRequest> requests,
    absl::Span<const RequestShape> shapes) {
  std::vector<KeepPlan> plans;
  plans.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<KeepPlan> plan = ComputeKeepPlanImpl(model, requests[i], shapes[i]);
    if (!plan.ok()) return InSequence(i, plan.status());
    plans.push_back(*std::move(plan));
  }
  return plans;
}

absl::Status Backend::InSequence(size_t index, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("sequences[", index, "].", status.message()));
}

void Backend::FinishPlan(const KeepPlanRequest& request,
                         std::chrono::steady_clock::time_point entered,
                         std::chrono::steady_clock::time_point validated, KeepPlan& plan) {
  if (plan.blocks) {
    // Physical ids come from the unit's keys (kBlocksShared: layers[0]'s).
    std::vector<const BlockTable*> tables;
    for (int32_t u = 0; u < plan.blocks->units; ++u) {
      const TensorView& keys = request.layers[u].keys;
      tables.push_back(keys.paged() ? keys.layout().table : nullptr);
    }
    policy::FillBlockTables(tables, *plan.blocks);
  }
  PlanTiming& t = plan.timing;
  t.validate_seconds =
      std::chrono::duration<double>(validated - request.checks_started.value_or(entered)).count();
  if (t.score_seconds == 0 && t.select_seconds == 0) {  // the backend did not split its time
    t.score_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - validated).count();
  }
}

int64_t MemoryEstimate::total() const { return SatAdd(workspace_bytes, output_bytes); }

absl::StatusOr<MemoryEstimate> Backend::EstimateKeepPlanMemory(
    const PreparedModel& model, const KeepPlanRequest& request) const {
  LAPROX_ASSIGN_OR_RETURN(RequestShape shape, CheckKeepPlanRequest(model, request));
  const int64_t heads = SatMul(shape.num_layers, shape.num_kv_heads), n = shape.n;
  const int64_t entries = SatMul(heads, n);
  // LAPROX keeps exactly window + sinks + quota per head on average; a baseline or a block plan
  // (whose forced blocks may hold more than the window and sinks) at most n.
  const int64_t kept = request.policy.kind == PolicyKind::kLaprox && shape.num_blocks == 0
                           ? SatMul(heads, SatAdd({shape.window, shape.sinks, shape.quota}))
                           : entries;
  const OutputOptions& out = request.outputs;
  MemoryEstimate estimate;
  estimate.output_bytes =
      SatAdd({SatMul(heads, 4), SatMul(SatAdd(heads, 1), 8), out.positions ? SatMul(kept, 4) : 0,
              out.bitmask ? SatMul(heads, (n + 7) / 8) : 0, out.scores ? SatMul(entries, 4) : 0,
              SatMul(shape.num_layers, 8)});
  if (shape.num_blocks > 0) {
    // Per (unit, block): kept, new table and freed ids (4 bytes each), scores (8), offsets.
    const int64_t unit_blocks = SatMul(shape.num_layers, shape.num_blocks);
    estimate.output_bytes =
        SatAdd({estimate.output_bytes, SatMul(unit_blocks, 12),
                out.scores ? SatMul(unit_blocks, 8) : 0, SatMul(SatAdd(shape.num_layers, 1), 16)});
  }
  estimate.workspace_bytes = KeepPlanWorkspaceBytes(model.geometry(), shape, request.policy);
  if (shape.num_blocks > 0) {
    // The block selection's scores, marks and candidate pool (policy/blocks.cc); its per-token
    // buffers stay within the token selection's, which the backend counted.
    estimate.workspace_bytes =
        SatAdd(estimate.workspace_bytes, SatMul({shape.num_layers, shape.num_blocks, 32}));
  }
  return estimate;
}

absl::StatusOr<WorkEstimate> Backend::EstimateKeepPlanWork(const PreparedModel& model,
                                                           const KeepPlanRequest& request) const {
  LAPROX_ASSIGN_OR_RETURN(RequestShape shape, CheckKeepPlanRequest(model, request));
  const LayerInputs& first = request.layers[0];
  const TensorView& window = shape.attention_given ? first.window_attention : first.window_queries;
  return KeepPlanWork(model.geometry(), request.policy,
                      {.n = shape.n,
                       .window = shape.window,
                       .window_rows = shape.window_rows,
                       .attention_given = shape.attention_given,
                       .key_bytes = static_cast<int64_t>(DTypeSize(first.keys.dtype())),
                       .value_bytes = static_cast<int64_t>(DTypeSize(first.values.dtype())),
                       .window_bytes = static_cast<int64_t>(DTypeSize(window.dtype()))});
}

absl::StatusOr<MemoryEstimate> Backend::EstimatePrepareMemory(const ModelGeometry& geometry,
                                                              const PrepareOptions& options) const {
  LAPROX_RETURN_IF_ERROR(geometry.Validate());
  const int64_t L = geometry.num_layers, Hkv = geometry.num_kv_heads, G = geometry.group_size(),
                d = geometry.head_dim, D = geometry.hidden_size, H = geometry.num_heads;
  // Per (layer, KV head): 1 + G factor blocks of d x d, and G(G-1)/2 cross-Grams on request.
  const int64_t blocks = SatAdd(1 + G, options.cross_grams ? SatMul(G, G - 1) / 2 : 0);
  MemoryEstimate estimate;
  estimate.output_bytes = SatMul(4, SatAdd(SatMul({L, Hkv, d, d, blocks}),
                                           options.output_projection ? SatMul({L, D, H, d}) : 0));
  estimate.workspace_bytes = PrepareWorkspaceBytes(geometry, options);
  return estimate;
}

int64_t Backend::KeepPlanWorkspaceBytes(const ModelGeometry&, const RequestShape& shape,
                                        const PolicySpec&) const {
  // The raw scores read back and the selection's 32-bit marks, per (layer, head, token).
  const int64_t heads = SatMul(shape.num_layers, shape.num_kv_heads);
  return SatAdd(SatMul({heads, shape.n, 8}), SatMul(heads, 16));
}

int64_t Backend::PrepareWorkspaceBytes(const ModelGeometry& geometry, const PrepareOptions&) const {
  // One layer's o_proj staged on the host in fp32.
  return SatMul({4, geometry.hidden_size, geometry.num_heads, geometry.head_dim});
}

absl::StatusOr<std::unique_ptr<ImportedRegion>> Backend::ImportCudaIpc(
    const CudaIpcRegionSpec& spec) {
  if (spec.handle.size() != CudaIpcRegionSpec::kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.handle has ", spec.handle.size(),
                                                   " bytes, expected exactly ",
                                                   CudaIpcRegionSpec::kHandleBytes));
  }
  LAPROX_RETURN_IF_ERROR(CanonicalDeviceUuid(spec.device_uuid).status());
  if (spec.offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.offset = ", spec.offset, " is negative"));
  }
  if (spec.byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.byte_size = ", spec.byte_size, " must be positive"));
  }
  if (spec.offset > std::numeric_limits<int64_t>::max() - spec.byte_size) {
    return absl::OutOfRangeError(absl::StrCat("cuda_ipc.offset + byte_size = ", spec.offset, " + ",
                                              spec.byte_size, " overflows int64"));
  }
  return ImportCudaIpcImpl(spec);
}

absl::StatusOr<std::unique_ptr<ImportedRegion>> Backend::ImportCudaIpcImpl(
    const CudaIpcRegionSpec&) {
  return absl::UnimplementedError(absl::StrCat(
      "cuda_ipc regions need the CUDA backend; this is the ", BackendKindName(kind()), " backend"));
}

absl::Status Backend::CopyToRegion(void* dst, MemorySpace space, const void* src, int64_t bytes) {
  if (space != MemorySpace::kHost) {
    return absl::UnimplementedError(
        absl::StrCat("the ", BackendKindName(kind()), " backend cannot write device memory"));
  }
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

}  // namespace laprox::kernels
