// Registry: a region's or a model's life in laproxd, from Register* to its end, whoever ends it
// (the client that registered it, or laproxd reclaiming it once that client is gone).
//
// Core registers and unregisters; around each of its steps the Registry does the rest of the
// operation, so that every path does all of it:
//   - a local client's lease (LeaseTable): recorded at registration, dropped at unregistration,
//     and ReclaimLapsed() unregisters what clients that are gone registered;
//   - what lives beside a model for as long as it is registered (laproxd's metrics series),
//     reserved with its factors and created and dropped with it (RegistryHooks);
//   - the model count, which laproxd's readiness follows (RegistryHooks::models_changed);
//   - a registration whose call ended before it could answer leaves nothing registered.
//
// The gRPC layer calls only this for registrations; tests that need no leases or hooks may call
// Core directly.
//
// Thread safety: every method may be called concurrently.
#ifndef LAPROX_SERVICE_CORE_REGISTRY_H_
#define LAPROX_SERVICE_CORE_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <variant>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "laprox/kernels/backend.h"
#include "service/core/core.h"
#include "service/core/leases.h"
#include "service/core/owner.h"
#include "service/core/region_registry.h"

namespace laprox::service {

// A CUDA IPC allocation to open, and whether outputs may be written there.
struct CudaIpcRegistration {
  kernels::CudaIpcRegionSpec spec;
  bool writable = false;
};
using RegionSpec = std::variant<ShmRegionSpec, CudaIpcRegistration>;

// What the Registry has taken back from clients that are gone, in one ReclaimLapsed() pass.
struct Reclaimed {
  int64_t regions = 0;
  int64_t region_bytes = 0;
  int64_t models = 0;
};

// What else a registration's life touches; every hook is optional and may be called from
// several threads at once.
struct RegistryHooks {
  // Bytes kept beside a model of this geometry for as long as it is registered; reserved with
  // its prepared factors against the model memory budget.
  std::function<int64_t(const kernels::ModelGeometry&)> model_bytes;
  // A model was registered. An error unregisters it again and is the registration's status.
  std::function<absl::Status(const ModelInfo&)> model_added;
  // Model `id` is unregistered (by its client or reclaimed).
  std::function<void(uint64_t id)> model_removed;
  // The number of registered models, after every registration or unregistration of one.
  std::function<void(int64_t models)> models_changed;
  // After a ReclaimLapsed() pass that took anything back.
  std::function<void(const Reclaimed&)> reclaimed;
};

class Registry {
 public:
  // `core` must outlive the Registry. A zero `lease` tracks nothing: what a client registered
  // stays until it unregisters it (ReclaimLapsed() is then a no-op).
  Registry(Core& core, absl::Duration lease, RegistryHooks hooks = {});
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Opens the region for context.owner and records its lease. Errors are Core's
  // (RegionRegistry::RegisterShm / RegisterCudaIpc), and DEADLINE_EXCEEDED when the call was
  // cancelled or passed its deadline while the region was opened: it is closed again, since the
  // client will never learn its id.
  absl::StatusOr<uint64_t> RegisterRegion(const RegionSpec& spec, const CallContext& context);
  // RegionRegistry::Unregister; the lease goes once the region is gone.
  absl::Status UnregisterRegion(uint64_t id, const Owner& owner, absl::Time deadline);

  // Core::RegisterModel with the hooks' bytes reserved beside the factors, then model_added
  // (whose error unregisters the model again), the lease and models_changed.
  absl::StatusOr<ModelInfo> RegisterModel(ModelSpec spec, const CallContext& context);
  // Core::UnregisterModel, then model_removed, the lease and models_changed.
  absl::Status UnregisterModel(uint64_t id, const Owner& owner);

  // Unregisters the regions and models of the clients the lease table finds gone (`connected`
  // says which still have a connection open), as their owner would: a region drains for at most
  // 10 s, then goes with its last plan. Reports the pass to hooks.reclaimed and on stderr. Call
  // it periodically from one thread; it blocks while regions drain.
  Reclaimed ReclaimLapsed(const LeaseTable::Connected& connected);

  // Registrations whose leases are tracked (for tests).
  int64_t leases() const { return leases_ ? leases_->size() : 0; }

 private:
  void ModelsChanged();

  Core& core_;
  std::optional<LeaseTable> leases_;
  const RegistryHooks hooks_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_REGISTRY_H_
