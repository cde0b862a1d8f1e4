#include "service/core/core.h"

#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::service {
namespace {

using kernels::DTypeSize;
using kernels::TensorView;

// Turns references into views for one call, holding one lease per region it names.
class Resolver {
 public:
  explicit Resolver(RegionRegistry& regions) : regions_(regions) {}

  absl::StatusOr<TensorView> Resolve(const TensorRef& ref, const std::string& field) {
    if (ref.source == TensorRef::Source::kAbsent) return TensorView();
    kernels::Dims strides = ref.strides;
    if (strides.empty()) strides = kernels::ContiguousStrides(ref.shape);
    if (strides.size() != ref.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has ", ref.shape.size(), " dimensions but ", strides.size(), " strides"));
    }
    // A view over nothing yet, only to compute the extent with the kernels' overflow checks.
    int64_t extent = 0;
    if (absl::Status s = TensorView(nullptr, ref.dtype, ref.shape, strides).ElementExtent(&extent);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
    }
    const int64_t element = static_cast<int64_t>(DTypeSize(ref.dtype));
    int64_t bytes;
    if (__builtin_mul_overflow(extent, element, &bytes)) {
      return absl::OutOfRangeError(
          absl::StrCat(field, ": extent of ", extent, " elements overflows int64 bytes"));
    }
    const void* data = nullptr;
    kernels::MemorySpace space = kernels::MemorySpace::kHost;
    if (ref.source == TensorRef::Source::kInline) {
      if (static_cast<int64_t>(ref.inline_bytes.size()) != bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".inline_bytes has ", ref.inline_bytes.size(), " bytes, expected ",
                         bytes, " (", extent, " elements of ", element, " bytes)"));
      }
      data = ref.inline_bytes.data();
      if (reinterpret_cast<uintptr_t>(data) % element != 0) {
        // Protobuf does not promise aligned bytes fields: copy into aligned storage.
        auto& copy = copies_.emplace_back((bytes + 7) / 8);
        std::memcpy(copy.data(), data, bytes);
        data = copy.data();
      }
    } else {
      if (ref.region_id == 0) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".region.region_id is 0"));
      }
      auto lease = Lease(ref.region_id, field);
      if (!lease.ok()) return lease.status();
      auto slice = (*lease)->Slice(ref.byte_offset, bytes, field);
      if (!slice.ok()) return slice.status();
      if (reinterpret_cast<uintptr_t>(*slice) % element != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".region.byte_offset = ", ref.byte_offset, " is not aligned to the ", element,
            "-byte ", kernels::DTypeName(ref.dtype), " elements"));
      }
      data = *slice;
      space = (*lease)->space();  // cuda_ipc regions are read in place on the device
    }
    return TensorView(data, ref.dtype, ref.shape, strides, space);
  }

  absl::StatusOr<const MappedRegion*> Lease(uint64_t id, const std::string& field) {
    auto it = leases_.find(id);
    if (it == leases_.end()) {
      auto lease = regions_.Acquire(id);
      if (!lease.ok()) {
        return absl::Status(lease.status().code(),
                            absl::StrCat(field, ": ", lease.status().message()));
      }
      it = leases_.emplace(id, std::move(lease).value()).first;
    }
    return &it->second.region();
  }

 private:
  RegionRegistry& regions_;
  std::map<uint64_t, RegionLease> leases_;
  std::vector<std::vector<uint64_t>> copies_;
};

// Copies `values` to `byte_offset` of `region` (checked bounds and alignment) through the
// backend, which writes host and device regions alike.
template <typename T>
absl::Status WriteOutput(kernels::Backend& backend, const MappedRegion& region, int64_t byte_offset,
                         const std::vector<T>& values, const char* field) {
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(T));
  auto slice = region.Slice(byte_offset, bytes, absl::StrCat("outputs.destination.", field));
  if (!slice.ok()) return slice.status();
  if (reinterpret_cast<uintptr_t>(*slice) % alignof(T) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("outputs.destination.", field, " offset ",
                                                   byte_offset, " is not aligned to ", alignof(T),
                                                   " bytes"));
  }
  absl::Status s = backend.CopyToRegion(*slice, region.space(), values.data(), bytes);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("outputs.destination.", field, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

Core::Core(std::unique_ptr<kernels::Backend> backend, const CoreLimits& limits)
    : backend_(std::move(backend)),
      limits_(limits),
      regions_(RegionRegistry::Limits{.max_regions = limits.max_regions}) {}

absl::StatusOr<uint64_t> Core::RegisterCudaIpcRegion(const kernels::CudaIpcRegionSpec& spec,
                                                     bool writable) {
  return regions_.RegisterCudaIpc(spec, writable, *backend_);
}

absl::StatusOr<ModelInfo> Core::RegisterModel(const ModelSpec& spec) {
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(models_.size()) >= limits_.max_models) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "already ", models_.size(), " models registered (limit ", limits_.max_models, ")"));
    }
  }
  Resolver resolver(regions_);
  std::vector<TensorView> o_proj;
  for (size_t l = 0; l < spec.o_proj.size(); ++l) {
    auto view = resolver.Resolve(spec.o_proj[l], absl::StrCat("o_proj[", l, "]"));
    if (!view.ok()) return view.status();
    o_proj.push_back(*view);
  }
  auto prepared = backend_->PrepareModel(spec.geometry, o_proj, {.cross_grams = spec.cross_grams});
  if (!prepared.ok()) return prepared.status();

  auto model = std::make_shared<Model>();
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

absl::Status Core::UnregisterModel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  if (models_.erase(id) == 0) return absl::NotFoundError(absl::StrCat("model ", id, " not found"));
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

absl::StatusOr<kernels::KeepPlan> Core::ComputeKeepPlan(const KeepPlanCall& call) {
  const auto started = std::chrono::steady_clock::now();
  std::shared_ptr<const Model> model;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(call.model_id);
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat("model ", call.model_id, " not found"));
    }
    model = it->second;
  }
  if (call.n > limits_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "n = ", call.n, " exceeds this server's limit of ", limits_.max_tokens, " tokens"));
  }
  Resolver resolver(regions_);
  const MappedRegion* destination = nullptr;
  if (call.destination) {
    auto region = resolver.Lease(call.destination->region_id, "outputs.destination");
    if (!region.ok()) return region.status();
    if (!(*region)->info().writable) {
      return absl::FailedPreconditionError(
          absl::StrCat("outputs.destination: region ", call.destination->region_id,
                       " was registered read-only; register it writable to receive outputs"));
    }
    destination = *region;
  }
  kernels::KeepPlanRequest request;
  request.n = call.n;
  request.policy = call.policy;
  request.outputs = call.outputs;
  for (size_t l = 0; l < call.layers.size(); ++l) {
    const LayerRefs& refs = call.layers[l];
    const std::string prefix = absl::StrCat("layers[", l, "].");
    kernels::LayerInputs& in = request.layers.emplace_back();
    struct Field {
      const TensorRef& ref;
      TensorView& view;
      const char* name;
    };
    for (const Field& f :
         {Field{refs.keys, in.keys, "keys"}, Field{refs.values, in.values, "values"},
          Field{refs.window_queries, in.window_queries, "window_queries"},
          Field{refs.window_attention, in.window_attention, "window_attention"},
          Field{refs.window_lse, in.window_lse, "window_lse"}}) {
      auto view = resolver.Resolve(f.ref, prefix + f.name);
      if (!view.ok()) return view.status();
      f.view = *view;
    }
  }
  if (destination != nullptr) {
    // Outputs written into the region are computed even if the inline flags did not ask.
    request.outputs.positions |= call.destination->positions.has_value();
    request.outputs.bitmask |= call.destination->bitmask.has_value();
    request.outputs.scores |= call.destination->scores.has_value();
  }
  const auto resolved = std::chrono::steady_clock::now();
  auto plan = backend_->ComputeKeepPlan(*model->prepared, request);
  if (!plan.ok()) return plan;
  plan->timing.validate_seconds += std::chrono::duration<double>(resolved - started).count();
  if (destination == nullptr) return plan;
  const OutputDestination& to = *call.destination;
  absl::Status s;
  if (to.counts) {
    s.Update(WriteOutput(*backend_, *destination, *to.counts, plan->counts, "counts"));
  }
  if (to.offsets) {
    s.Update(WriteOutput(*backend_, *destination, *to.offsets, plan->offsets, "offsets"));
  }
  if (to.positions) {
    s.Update(WriteOutput(*backend_, *destination, *to.positions, plan->positions, "positions"));
    plan->positions.clear();
  }
  if (to.bitmask) {
    s.Update(WriteOutput(*backend_, *destination, *to.bitmask, plan->bitmask, "bitmask"));
    plan->bitmask.clear();
  }
  if (to.scores) {
    s.Update(WriteOutput(*backend_, *destination, *to.scores, plan->scores, "scores"));
    plan->scores.clear();
  }
  if (!s.ok()) return s;
  return plan;
}

}  // namespace laprox::service
