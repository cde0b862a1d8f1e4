// Fuzz target: bytes -> laprox.v1.ComputeKeepPlansRequest -> KeepPlanCallFromProto per sequence
// -> Core::ComputeKeepPlans on the real CPU backend, over fuzz_world.h's regions and models, then
// v1::KeepPlanToProto per plan — what laproxd's ComputeKeepPlans does minus gRPC. Findings:
// sanitizer reports, allocations past -malloc_limit_mb, refusals with INTERNAL/UNKNOWN, a batch
// whose plan count differs from its sequences, and plans that break the API's contract
// (CheckPlan, fuzz_support.h).
//
//   build-fuzz/tests/fuzz/compute_keep_plans_fuzzer -malloc_limit_mb=2048 -rss_limit_mb=2048 \
//       CORPUS_DIR tests/fuzz/corpus/compute_keep_plans      (tests/fuzz/README.md)
#include <cstdint>
#include <cstring>
#include <vector>

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
  v1::ComputeKeepPlansRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  std::vector<service::KeepPlanCall> calls;
  bool writes = false;
  for (v1::ComputeKeepMaskRequest& sequence : *request.mutable_sequences()) {
    sequence.set_model_id(fuzz::MapModelId(sequence.model_id()));
    auto call = service::KeepPlanCallFromProto(sequence);
    if (!call.ok()) {
      fuzz::CheckRefusal(call.status(), "KeepPlanCallFromProto");
      return 0;
    }
    writes |= call->destination.has_value();
    calls.push_back(*std::move(call));
  }
  auto plans = fuzz::core->ComputeKeepPlans(calls, {.owner = service::Owner::Laproxd()});
  if (writes) {
    // Keep every run reproducible: outputs written there must not feed later inputs.
    std::memset(fuzz::output->data(), 0, static_cast<size_t>(fuzz::output->size()));
  }
  if (!plans.ok()) {
    fuzz::CheckRefusal(plans.status(), "Core::ComputeKeepPlans");
    return 0;
  }
  if (plans->size() != calls.size()) {
    fuzz::Fail(absl::StrCat(plans->size(), " plans for ", calls.size(), " sequences"));
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    fuzz::CheckPlan((*plans)[i], calls[i]);
    v1::ComputeKeepMaskResponse response;
    v1::KeepPlanToProto((*plans)[i], calls[i].policy, &response);
  }
  fuzz::Note(absl::StrCat("batch: ", plans->size(), " plans"));
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return laprox::fuzz::MutateSerializedProto(
      laprox::v1::ComputeKeepPlansRequest::default_instance(), data, size, max_size, seed);
}
