// Fuzz target: bytes -> laprox.v1.ComputeKeepMaskRequest -> KeepPlanCallFromProto ->
// Core::ComputeKeepPlan on the real CPU backend, over a real POSIX shared-memory region and three
// registered models (fuzz_world.h), then v1::KeepPlanToProto — what laproxd's ComputeKeepMask does
// minus gRPC. Findings: sanitizer reports, allocations past -malloc_limit_mb, refusals with
// INTERNAL/UNKNOWN, and plans that break the API's contract (CheckPlan below).
//
//   build-fuzz/tests/fuzz/compute_keep_mask_fuzzer -malloc_limit_mb=2048 -rss_limit_mb=2048 \
//       CORPUS_DIR tests/fuzz/corpus/compute_keep_mask      (tests/fuzz/README.md)
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "laprox/v1/laprox.pb.h"
#include "laprox/v1/plan_wire.h"
#include "service/grpc/convert.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/fuzz_world.h"

namespace laprox::fuzz {
namespace {

service::Core* core = nullptr;
ShmObject* output = nullptr;

}  // namespace
}  // namespace laprox::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  namespace fuzz = laprox::fuzz;
  fuzz::SetUpHarness();
  const fuzz::ComputeWorld world = fuzz::SetUpComputeWorld();
  fuzz::core = world.core;
  fuzz::output = world.output;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fuzz = laprox::fuzz;
  namespace service = laprox::service;
  namespace v1 = laprox::v1;
  v1::ComputeKeepMaskRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  request.set_model_id(fuzz::MapModelId(request.model_id()));
  auto call = service::KeepPlanCallFromProto(request);
  if (!call.ok()) {
    fuzz::CheckRefusal(call.status(), "KeepPlanCallFromProto");
    return 0;
  }
  auto plan = fuzz::core->ComputeKeepPlan(*call, {.owner = service::Owner::Laproxd()});
  if (call->destination) {
    // Keep every run reproducible: outputs written there must not feed later inputs.
    std::memset(fuzz::output->data(), 0, static_cast<size_t>(fuzz::output->size()));
  }
  if (!plan.ok()) {
    fuzz::CheckRefusal(plan.status(), "Core::ComputeKeepPlan");
    return 0;
  }
  fuzz::CheckPlan(*plan, *call);
  fuzz::Note(absl::StrCat("plan: n = ", plan->n, ", kept ", plan->offsets.back(), ", window ",
                          plan->window, ", quota ", plan->quota));
  v1::ComputeKeepMaskResponse response;
  v1::KeepPlanToProto(*plan, call->policy, &response);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return laprox::fuzz::MutateSerializedProto(laprox::v1::ComputeKeepMaskRequest::default_instance(),
                                             data, size, max_size, seed);
}
