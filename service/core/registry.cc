#include "service/core/registry.h"

#include <cstdio>
#include <map>
#include <utility>
#include <variant>
#include <vector>

#include "service/core/sequence.h"

namespace laprox::service {

Registry::Registry(Core& core, absl::Duration lease, RegistryHooks hooks)
    : core_(core), hooks_(std::move(hooks)) {
  if (lease > absl::ZeroDuration()) leases_.emplace(lease);
}

absl::StatusOr<uint64_t> Registry::RegisterRegion(const RegionSpec& spec,
                                                  const CallContext& context) {
  const Owner& owner = context.owner;
  // Backend::ImportCudaIpc checks the handle size and the UUID before it asks whether the
  // backend can open handles at all, so a CPU server answers INVALID_ARGUMENT for a malformed
  // request and UNIMPLEMENTED for a well-formed one.
  const auto* ipc = std::get_if<CudaIpcRegistration>(&spec);
  absl::StatusOr<uint64_t> id =
      ipc != nullptr ? core_.regions().RegisterCudaIpc(ipc->spec, ipc->writable, owner)
                     : core_.regions().RegisterShm(std::get<ShmRegionSpec>(spec), owner);
  if (!id.ok()) return id.status();
  if (!CheckCall(context, "").ok()) {
    // The call was cancelled or is past its deadline: the client will never learn the id, so
    // nothing may stay registered for it.
    core_.regions().Unregister(*id, owner).IgnoreError();
    return absl::DeadlineExceededError("the call ended while the region was opened; it was closed");
  }
  if (leases_) leases_->Add(owner, LeaseTable::Kind::kRegion, *id);
  return id;
}

absl::Status Registry::UnregisterRegion(uint64_t id, const Owner& owner, absl::Time deadline) {
  absl::Status status = core_.regions().Unregister(id, owner, deadline);
  if (status.ok() && leases_) leases_->Remove(LeaseTable::Kind::kRegion, id);
  return status;
}

absl::StatusOr<ModelInfo> Registry::RegisterModel(ModelSpec spec, const CallContext& context) {
  if (hooks_.model_bytes) spec.bookkeeping_bytes = hooks_.model_bytes(spec.geometry);
  absl::StatusOr<ModelInfo> model = core_.RegisterModel(spec, context);
  if (!model.ok()) return model.status();
  if (hooks_.model_added) {
    if (absl::Status s = hooks_.model_added(*model); !s.ok()) {
      core_.UnregisterModel(model->id, context.owner).IgnoreError();  // nothing half-registered
      return s;
    }
  }
  if (leases_) leases_->Add(context.owner, LeaseTable::Kind::kModel, model->id);
  ModelsChanged();
  return model;
}

absl::Status Registry::UnregisterModel(uint64_t id, const Owner& owner) {
  if (absl::Status s = core_.UnregisterModel(id, owner); !s.ok()) return s;
  if (hooks_.model_removed) hooks_.model_removed(id);
  if (leases_) leases_->Remove(LeaseTable::Kind::kModel, id);
  ModelsChanged();
  return absl::OkStatus();
}

Reclaimed Registry::ReclaimLapsed(const LeaseTable::Connected& connected) {
  Reclaimed reclaimed;
  if (!leases_) return reclaimed;
  const std::vector<LeaseTable::Registration> lapsed = leases_->Collect(connected);
  if (lapsed.empty()) return reclaimed;
  std::map<uint64_t, int64_t> region_bytes;
  for (const RegionInfo& info : core_.regions().List(Owner::Laproxd())) {
    region_bytes[info.id] = info.byte_size;
  }
  for (const LeaseTable::Registration& r : lapsed) {
    if (r.kind == LeaseTable::Kind::kRegion) {
      const absl::Status status =
          core_.regions().Unregister(r.id, Owner::Laproxd(), absl::Now() + absl::Seconds(10));
      // DEADLINE_EXCEEDED: still draining; it is unmapped when its last plan ends.
      if (status.ok() || absl::IsDeadlineExceeded(status)) {
        ++reclaimed.regions;
        reclaimed.region_bytes += region_bytes[r.id];
      }
    } else if (core_.UnregisterModel(r.id, Owner::Laproxd()).ok()) {
      ++reclaimed.models;
      if (hooks_.model_removed) hooks_.model_removed(r.id);
    }
  }
  if (hooks_.reclaimed) hooks_.reclaimed(reclaimed);
  if (reclaimed.models > 0) ModelsChanged();
  std::fprintf(stderr,
               "laproxd: reclaimed %lld regions (%lld bytes) and %lld models of clients that "
               "are gone\n",
               static_cast<long long>(reclaimed.regions),
               static_cast<long long>(reclaimed.region_bytes),
               static_cast<long long>(reclaimed.models));
  return reclaimed;
}

void Registry::ModelsChanged() {
  if (hooks_.models_changed) hooks_.models_changed(core_.model_totals().count);
}

}  // namespace laprox::service
