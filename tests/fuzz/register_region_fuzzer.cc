// Fuzz target: bytes -> laprox.v1.RegisterRegionRequest -> what laproxd's RegisterRegion does:
// RegionSpecFromProto, then Registry::RegisterRegion: shm -> RegionRegistry::RegisterShm (a name
// containing "laprox-fuzz-self" names the world's real input object, fuzz_world.h), then
// Registry::UnregisterRegion; cuda_ipc -> RegionRegistry::RegisterCudaIpc, which the CPU backend
// must refuse. Findings: sanitizer reports, hangs, refusals with
// INTERNAL/UNKNOWN, a cuda_ipc region accepted by the CPU backend, a registration that
// ListRegions does not show as given, or one that cannot be unregistered.
#include <cstdint>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "laprox/v1/laprox.pb.h"
#include "service/grpc/convert.h"
#include "tests/fuzz/fuzz_support.h"

namespace {
laprox::service::Core* core = nullptr;
laprox::service::Registry* registry = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  laprox::fuzz::SetUpHarness();
  core = laprox::fuzz::NewCore().release();
  registry = new laprox::service::Registry(*core, absl::ZeroDuration());
  laprox::fuzz::InputObject();  // created and filled; stays linked until exit
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fuzz = laprox::fuzz;
  namespace service = laprox::service;
  namespace v1 = laprox::v1;
  v1::RegisterRegionRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  absl::StatusOr<service::RegionSpec> converted = service::RegionSpecFromProto(request);
  if (!converted.ok()) {
    fuzz::CheckRefusal(converted.status(), "RegionSpecFromProto");
    return 0;
  }
  const service::CallContext call{.owner = service::Owner::Laproxd()};
  if (auto* spec = std::get_if<service::ShmRegionSpec>(&*converted)) {
    spec->name = fuzz::ResolveShmName(spec->name);
    auto id = registry->RegisterRegion(*spec, call);
    if (!id.ok()) {
      fuzz::CheckRefusal(id.status(), "RegisterShm");
      return 0;
    }
    fuzz::Note(absl::StrCat("region ", *id, " registered"));
    absl::string_view name = spec->name;
    absl::ConsumePrefix(&name, "/");
    bool listed = false;
    for (const service::RegionInfo& info : core->regions().List(service::Owner::Laproxd())) {
      if (info.id != *id) continue;
      listed = info.kind == service::RegionKind::kShm && info.name == name &&
               info.offset == spec->offset && info.byte_size == spec->byte_size &&
               info.writable == spec->writable && info.in_use == 0 && !info.draining;
    }
    if (!listed) fuzz::Fail(absl::StrCat("region ", *id, " is not listed as registered"));
    if (absl::Status s =
            registry->UnregisterRegion(*id, service::Owner::Laproxd(), absl::InfiniteFuture());
        !s.ok()) {
      fuzz::Fail(absl::StrCat("Unregister(", *id, "): ", s.ToString()));
    }
    if (!core->regions().List(service::Owner::Laproxd()).empty()) {
      fuzz::Fail("a region is left after Unregister");
    }
    return 0;
  }
  auto id = registry->RegisterRegion(*converted, call);
  if (id.ok()) fuzz::Fail("the CPU backend registered a cuda_ipc region");
  fuzz::CheckRefusal(id.status(), "RegisterCudaIpc");
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return laprox::fuzz::MutateSerializedProto(laprox::v1::RegisterRegionRequest::default_instance(),
                                             data, size, max_size, seed);
}
