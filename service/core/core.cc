#include "service/core/core.h"

#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "laprox/kernels/layer_tensors.h"
#include "laprox/kernels/stop.h"
#include "laprox/kernels/work.h"
#include "service/core/decode_cache.h"
#include "service/core/resolver.h"
#include "service/core/sequence.h"

namespace laprox::service {
namespace {

using kernels::DTypeSize;
using kernels::TensorView;

constexpr size_t kMaxModelName = 128;

absl::Status CheckModelName(absl::string_view name) {
  bool ok = name.size() <= kMaxModelName;
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    ok = absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '/' || c == ':' || c == '-';
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("name \"", absl::CEscape(name.substr(0, kMaxModelName)), "\"",
                   name.size() > kMaxModelName ? "..." : "", " must have at most ", kMaxModelName,
                   " bytes of [A-Za-z0-9._/:-]"));
}

// Elements of `shape`, or -1 when the count overflows int64.
int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t sum;
  return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<int64_t>::max() : sum;
}

// The call's deadline on the steady clock the backends read (StopSignal).
kernels::StopSignal::Clock::time_point SteadyDeadline(absl::Time deadline) {
  using Clock = kernels::StopSignal::Clock;
  if (deadline == absl::InfiniteFuture()) return Clock::time_point::max();
  const absl::Duration left = deadline - absl::Now();
  if (left > absl::Hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + absl::ToChronoNanoseconds(std::max(left, absl::ZeroDuration()));
}

// "N units (F flops, B bytes read)".
std::string WorkText(const kernels::WorkEstimate& work) {
  return absl::StrCat(work.total(), " work units (", work.flops, " flops, ", work.bytes_read,
                      " bytes read)");
}

int64_t LimitOrShare(int64_t limit, int64_t numerator, int64_t denominator) {
  return limit > 0 ? limit : ProcessMemoryLimit() / denominator * numerator;
}

// `limits` with the work limits derived from the backend where they are 0.
CoreLimits ResolveLimits(CoreLimits limits, const kernels::Backend& backend) {
  if (limits.max_request_work <= 0) limits.max_request_work = backend.DefaultMaxRequestWork();
  if (limits.heavy_request_work <= 0) {
    limits.heavy_request_work = std::max<int64_t>(limits.max_request_work / 256, 1);
  }
  return limits;
}

// The work of `call` from the shapes it states (its first layer's window tensor, n, policy),
// before anything is resolved: for scheduling (Core::IsHeavy).
kernels::WorkEstimate StatedWork(const KeepPlanCall& call, const kernels::ModelGeometry& geometry) {
  kernels::KeepPlanWorkShape shape = {.n = call.n};
  if (!call.layers.empty()) {
    const LayerRefs& first = call.layers[0];
    shape.attention_given = first.window_queries.source == TensorRef::Source::kAbsent;
    const TensorRef& window = shape.attention_given ? first.window_attention : first.window_queries;
    if (window.shape.size() >= 2) shape.window_rows = window.shape[1];
    shape.window_bytes = static_cast<int64_t>(DTypeSize(window.dtype));
    shape.key_bytes = static_cast<int64_t>(DTypeSize(first.keys.dtype));
    shape.value_bytes = static_cast<int64_t>(DTypeSize(first.values.dtype));
  }
  // An upper bound of the rows used: the policy's window clamps them further.
  if (call.policy.kind != kernels::PolicyKind::kStreamingLlm) {
    shape.window = std::min(shape.window_rows, call.n);
  }
  return kernels::KeepPlanWork(geometry, call.policy, shape);
}

}  // namespace

Core::Core(std::unique_ptr<kernels::Backend> backend, const CoreLimits& limits, CoreOptions options)
    : backend_(std::move(backend)),
      limits_(ResolveLimits(limits, *backend_)),
      options_(options),
      regions_(*backend_, RegionRegistry::Limits{.max_regions = limits.max_regions},
               options.first_id),
      request_memory_("request memory", "--max_request_memory",
                      LimitOrShare(limits.max_request_memory, 1, 2)),
      model_memory_("model memory", "--max_model_memory",
                    LimitOrShare(limits.max_model_memory, 1, 4)),
      next_model_id_(options.first_id) {}

absl::StatusOr<ModelInfo> Core::RegisterModel(const ModelSpec& spec, const Owner& owner) {
  return RegisterModel(spec, CallContext{.owner = owner});
}

absl::StatusOr<ModelInfo> Core::RegisterModel(const ModelSpec& spec, const CallContext& context) {
  const Owner& owner = context.owner;
  if (absl::Status s = CheckModelName(spec.name); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(models_.size()) >= limits_.max_models) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "already ", models_.size(), " models registered (limit ", limits_.max_models, ")"));
    }
  }
  const kernels::PrepareOptions options = {.cross_grams = spec.cross_grams};
  auto estimate = backend_->EstimatePrepareMemory(spec.geometry, options);
  if (!estimate.ok()) return estimate.status();
  auto model = std::make_shared<Model>(Model{.owner = owner});
  auto held = model_memory_.Reserve(
      SaturatingAdd(estimate->output_bytes, std::max<int64_t>(spec.bookkeeping_bytes, 0)),
      absl::StrCat("the prepared factors of ", spec.geometry.DebugString(),
                   spec.bookkeeping_bytes > 0
                       ? absl::StrCat(" and ", spec.bookkeeping_bytes, " bytes of its metrics")
                       : ""));
  if (!held.ok()) return held.status();
  model->memory = *std::move(held);
  const kernels::WorkEstimate work = kernels::PrepareWork(
      spec.geometry, spec.cross_grams,
      spec.o_proj.empty() ? 4 : static_cast<int64_t>(DTypeSize(spec.o_proj[0].dtype)));
  if (work.total() > limits_.max_request_work) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "preparing ", spec.geometry.DebugString(), " is ", WorkText(work),
        ", more than this server's limit of ", limits_.max_request_work, " (max_request_work)"));
  }
  auto scratch = request_memory_.Reserve(estimate->workspace_bytes, "preparing the model");
  if (!scratch.ok()) return scratch.status();

  Resolver resolver(regions_, owner);
  std::vector<TensorView> o_proj;
  for (size_t l = 0; l < spec.o_proj.size(); ++l) {
    auto view = resolver.Resolve(spec.o_proj[l], absl::StrCat("o_proj[", l, "]"));
    if (!view.ok()) return view.status();
    o_proj.push_back(*view);
  }
  const kernels::StopSignal stop(SteadyDeadline(context.deadline), context.cancelled);
  auto prepared = backend_->PrepareModel(spec.geometry, o_proj, options, &stop);
  if (!prepared.ok()) return prepared.status();
  if (absl::Status s = resolver.CheckIntact(); !s.ok()) return s;

  model->prepared = *std::move(prepared);
  model->info.geometry = spec.geometry;
  model->info.prepared_bytes = model->prepared->ByteSize();
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(models_.size()) >= limits_.max_models) {  // raced with another
    return absl::ResourceExhaustedError(absl::StrCat(
        "already ", models_.size(), " models registered (limit ", limits_.max_models, ")"));
  }
  model->info.id = next_model_id_++;
  model->info.name = spec.name.empty() ? absl::StrCat(model->info.id) : spec.name;
  models_[model->info.id] = model;
  return model->info;
}

absl::Status Core::UnregisterModel(uint64_t id, const Owner& owner) {
  if (id == 0) return absl::InvalidArgumentError("model_id is 0 (ids start at 1)");
  std::shared_ptr<const Model> model;  // freed outside the lock (when no request holds it)
  absl::MutexLock lock(&mu_);
  auto it = models_.find(id);
  if (it == models_.end() || !owner.Sees(it->second->owner)) {
    return absl::NotFoundError(absl::StrCat("model ", id, " not found"));
  }
  model = std::move(it->second);
  models_.erase(it);
  return absl::OkStatus();
}

Core::ModelTotals Core::model_totals() const {
  ModelTotals totals;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, model] : models_) {
    ++totals.count;
    totals.prepared_bytes += model->info.prepared_bytes;
  }
  return totals;
}

absl::StatusOr<std::shared_ptr<const Core::Model>> Core::FindModel(uint64_t id,
                                                                   const Owner& owner) const {
  if (id == 0) return absl::InvalidArgumentError("model_id is 0 (ids start at 1)");
  absl::MutexLock lock(&mu_);
  auto it = models_.find(id);
  if (it == models_.end() || !(options_.shared_models || owner.Sees(it->second->owner))) {
    return absl::NotFoundError(absl::StrCat("model ", id, " not found"));
  }
  return it->second;
}

absl::StatusOr<kernels::KeepPlan> Core::ComputeKeepPlan(const KeepPlanCall& call,
                                                        const CallContext& context) {
  auto plans = Compute(absl::MakeConstSpan(&call, 1), context, /*batch=*/false);
  if (!plans.ok()) return plans.status();
  return std::move((*plans)[0]);
}

absl::StatusOr<std::vector<kernels::KeepPlan>> Core::ComputeKeepPlans(
    absl::Span<const KeepPlanCall> calls, const CallContext& context) {
  if (calls.empty()) return absl::InvalidArgumentError("sequences: the batch is empty");
  if (static_cast<int64_t>(calls.size()) > limits_.max_batch_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("sequences: ", calls.size(),
                                                   " sequences in one batch, more than this "
                                                   "server's limit of ",
                                                   limits_.max_batch_sequences,
                                                   " (max_batch_sequences)"));
  }
  return Compute(calls, context, /*batch=*/true);
}

bool Core::IsHeavy(absl::Span<const KeepPlanCall> calls, const Owner& owner) const {
  if (calls.empty()) return false;
  auto model = FindModel(calls[0].model_id, owner);
  if (!model.ok()) return false;
  int64_t work = 0;
  for (const KeepPlanCall& call : calls) {
    work = SaturatingAdd(work, StatedWork(call, (*model)->info.geometry).total());
  }
  return work > limits_.heavy_request_work;
}

absl::StatusOr<std::vector<kernels::KeepPlan>> Core::Compute(absl::Span<const KeepPlanCall> calls,
                                                             const CallContext& context,
                                                             bool batch) {
  const auto started = context.started.value_or(std::chrono::steady_clock::now());
  // One model for the whole call: the batch's sequences must all name it.
  const uint64_t model_id = calls[0].model_id;
  auto found = FindModel(model_id, context.owner);
  if (!found.ok()) return Prefixed(found.status(), batch ? "sequences[0]." : "");
  const std::shared_ptr<const Model> model = *std::move(found);
  std::vector<Sequence> sequences(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    Sequence& sequence = sequences[i];
    sequence.prefix = batch ? absl::StrCat("sequences[", i, "].") : "";
    if (calls[i].model_id != model_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          sequence.prefix, "model_id = ", calls[i].model_id, ", but sequences[0] names model ",
          model_id, ": the sequences of a batch share one model"));
    }
    if (absl::Status s = PrepareSequence(calls[i], context, limits_.max_tokens, regions_,
                                         request_memory_, sequence);
        !s.ok()) {
      return Prefixed(s, sequence.prefix);
    }
  }
  // Every plan is held twice at most: by the backend's result and by the response built from it.
  int64_t bytes = 0;
  kernels::WorkEstimate work;
  for (const Sequence& sequence : sequences) {
    auto estimate = backend_->EstimateKeepPlanMemory(*model->prepared, sequence.request);
    if (!estimate.ok()) return Prefixed(estimate.status(), sequence.prefix);
    for (int64_t term : {estimate->total(), estimate->output_bytes}) {
      if (__builtin_add_overflow(bytes, term, &bytes)) bytes = std::numeric_limits<int64_t>::max();
    }
    auto sequence_work = backend_->EstimateKeepPlanWork(*model->prepared, sequence.request);
    if (!sequence_work.ok()) return Prefixed(sequence_work.status(), sequence.prefix);
    const KeepPlanCall& call = calls[&sequence - sequences.data()];
    if (call.cache) {
      // The backend has checked the entry counts and the window rows' shape by now.
      const int64_t window_rows = sequence.request.layers[0].window_queries.dim(1);
      if (absl::Status s =
              CheckCachePositions(*call.cache, model->info.geometry.num_kv_heads, window_rows);
          !s.ok()) {
        return Prefixed(s, sequence.prefix);
      }
    }
    work.flops = SaturatingAdd(work.flops, sequence_work->flops);
    work.bytes_read = SaturatingAdd(work.bytes_read, sequence_work->bytes_read);
  }
  const kernels::ModelGeometry& geometry = model->info.geometry;
  if (work.total() > limits_.max_request_work) {
    // Work is refused like memory: a request that reads a few bytes of a region through zero
    // strides as a million tokens is charged for every element it makes the server read.
    return absl::ResourceExhaustedError(absl::StrCat(
        batch ? absl::StrCat("this batch (", calls.size(), " sequences)") : "this request", " is ",
        WorkText(work), " on ", geometry.num_layers, " layers x ", geometry.num_heads,
        " heads, more than this server's limit of ", limits_.max_request_work,
        " (max_request_work); send fewer tokens, a shorter window or smaller batches"));
  }
  auto memory = request_memory_.Reserve(
      bytes,
      batch ? absl::StrCat("this batch's workspace and plans (", calls.size(), " sequences, ",
                           geometry.num_layers, " layers x ", geometry.num_kv_heads, " KV heads)")
            : absl::StrCat("this request's workspace and plan (n = ", calls[0].n, ", ",
                           geometry.num_layers, " layers x ", geometry.num_kv_heads, " KV heads)"));
  if (!memory.ok()) return memory.status();
  // The backend stops at its next check once the call's deadline passes or it is cancelled.
  const kernels::StopSignal stop(SteadyDeadline(context.deadline), context.cancelled);
  if (absl::Status s = stop.Check("nothing was computed"); !s.ok()) return s;
  std::vector<kernels::KeepPlan> plans;
  if (batch) {
    std::vector<kernels::KeepPlanRequest> requests;
    requests.reserve(sequences.size());
    for (Sequence& sequence : sequences) {
      sequence.request.checks_started = started;
      sequence.request.stop = &stop;
      requests.push_back(std::move(sequence.request));
    }
    auto computed = backend_->ComputeKeepPlans(*model->prepared, requests);
    if (!computed.ok()) return computed.status();
    plans = *std::move(computed);
  } else {
    sequences[0].request.checks_started = started;
    sequences[0].request.stop = &stop;
    auto plan = backend_->ComputeKeepPlan(*model->prepared, sequences[0].request);
    if (!plan.ok()) return plan.status();
    plans.push_back(*std::move(plan));
  }
  // Whatever was read from a region its client shrank meanwhile is garbage.
  if (absl::Status s = CheckIntact(sequences); !s.ok()) return s;
  for (size_t i = 0; i < sequences.size(); ++i) {
    if (calls[i].cache) ToTokenPositions(*calls[i].cache, plans[i]);
  }
  std::vector<Area> areas;
  bool destination = false;
  for (size_t i = 0; i < sequences.size(); ++i) {
    if (sequences[i].destination == nullptr) continue;
    destination = true;
    const OutputDestination& to = *calls[i].destination;
    const kernels::KeepPlan& plan = plans[i];
    AddArea(areas, sequences[i], "counts", to.counts_offset, plan.counts);
    AddArea(areas, sequences[i], "offsets", to.offsets_offset, plan.offsets);
    AddArea(areas, sequences[i], "positions", to.positions_offset, plan.positions);
    AddArea(areas, sequences[i], "bitmask", to.bitmask_offset, plan.bitmask);
    AddArea(areas, sequences[i], "scores", to.scores_offset, plan.scores);
  }
  if (destination) {
    if (absl::Status s = WriteOutputs(*backend_, areas, sequences, context); !s.ok()) return s;
    // Written to the region instead of the response (counts and offsets stay in both).
    for (size_t i = 0; i < sequences.size(); ++i) {
      if (sequences[i].destination == nullptr) continue;
      const OutputDestination& to = *calls[i].destination;
      if (to.positions_offset) plans[i].positions.clear();
      if (to.bitmask_offset) plans[i].bitmask.clear();
      if (to.scores_offset) plans[i].scores.clear();
    }
  }
  if (context.hold_memory != nullptr) *context.hold_memory = *std::move(memory);
  return plans;
}

}  // namespace laprox::service
