// Fuzz target: bytes -> laprox.v1.ComputeKeepMaskRequest -> KeepPlanCallFromProto ->
// Core::ComputeKeepPlan on the real CPU backend, over a real POSIX shared-memory region and three
// registered models (fuzz_world.h), then v1::KeepPlanToProto — what laproxd's ComputeKeepMask does
// minus gRPC. Findings: sanitizer reports, allocations past -malloc_limit_mb, refusals with
// INTERNAL/UNKNOWN, and plans that break the API's contract (CheckPlan below).
//
//   build-fuzz/tests/fuzz/compute_keep_mask_fuzzer -malloc_limit_mb=2048 -rss_limit_mb=2048 \
//       CORPUS_DIR tests/fuzz/corpus/compute_keep_mask      (tests/fuzz/README.md)
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

// LAPROX_FUZZ_ALLOW_NONFINITE=1: non-finite layer sums and NaN scores are not findings (to fuzz
// on while such a finding is being fixed; tests/fuzz/README.md).
bool AllowNonFinite() {
  static const bool allow = [] {
    const char* v = std::getenv("LAPROX_FUZZ_ALLOW_NONFINITE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return allow;
}

// What the API promises about every plan (laprox.proto, ComputeKeepMaskResponse).
void CheckPlan(const kernels::KeepPlan& plan, const service::KeepPlanCall& call) {
  const FuzzModel& model = kModels[call.model_id - 1];
  const int64_t heads = int64_t{model.num_layers} * model.num_kv_heads;
  const int64_t n = call.n;
  if (plan.num_layers != model.num_layers || plan.num_kv_heads != model.num_kv_heads ||
      plan.n != n) {
    Fail(absl::StrCat("plan geometry ", plan.num_layers, "x", plan.num_kv_heads, " n=", plan.n,
                      " for a request of n=", n));
  }
  if (static_cast<int64_t>(plan.counts.size()) != heads ||
      static_cast<int64_t>(plan.offsets.size()) != heads + 1 || plan.offsets[0] != 0 ||
      static_cast<int64_t>(plan.layer_sums.size()) != model.num_layers) {
    Fail(absl::StrCat("plan arrays: ", plan.counts.size(), " counts, ", plan.offsets.size(),
                      " offsets, ", plan.layer_sums.size(), " layer sums"));
  }
  for (int64_t i = 0; i < heads; ++i) {
    if (plan.counts[i] < 0 || plan.counts[i] > n ||
        plan.offsets[i + 1] - plan.offsets[i] != plan.counts[i]) {
      Fail(absl::StrCat("head ", i, ": count ", plan.counts[i], ", offsets ", plan.offsets[i], "..",
                        plan.offsets[i + 1], ", n = ", n));
    }
  }
  for (int l = 0; l < model.num_layers && !AllowNonFinite(); ++l) {
    if (!std::isfinite(plan.layer_sums[l])) {
      Fail(absl::StrCat("layer_sums[", l, "] = ", plan.layer_sums[l]));
    }
  }
  if (call.policy.kind == kernels::PolicyKind::kLaprox) {
    // "For LAPROX that is exactly L * Hkv * (window + sinks + quota)".
    if (plan.offsets[heads] != heads * (plan.window + plan.sinks + plan.quota)) {
      Fail(absl::StrCat("LAPROX kept ", plan.offsets[heads], " positions, expected ", heads, " * (",
                        plan.window, " + ", plan.sinks, " + ", plan.quota, ")"));
    }
  }
  const bool in_region = call.destination.has_value();
  if (call.outputs.positions && !(in_region && call.destination->positions_offset)) {
    if (static_cast<int64_t>(plan.positions.size()) != plan.offsets[heads]) {
      Fail(absl::StrCat(plan.positions.size(), " positions, offsets say ", plan.offsets[heads]));
    }
    for (int64_t i = 0; i < heads; ++i) {
      for (int64_t k = plan.offsets[i]; k < plan.offsets[i + 1]; ++k) {
        const int32_t p = plan.positions[k];
        if (p < 0 || p >= n || (k > plan.offsets[i] && p <= plan.positions[k - 1])) {
          Fail(absl::StrCat("head ", i, ": positions not ascending inside [0, n): ", p));
        }
      }
      if (call.policy.kind == kernels::PolicyKind::kLaprox) {
        // The window and the sinks are always kept.
        const int64_t count = plan.counts[i];
        const int32_t* kept = plan.positions.data() + plan.offsets[i];
        for (int32_t s = 0; s < plan.sinks; ++s) {
          if (count <= s || kept[s] != s) Fail(absl::StrCat("head ", i, " lost sink ", s));
        }
        for (int32_t w = 0; w < plan.window; ++w) {
          if (count < plan.window || kept[count - plan.window + w] != n - plan.window + w) {
            Fail(absl::StrCat("head ", i, " lost window position ", n - plan.window + w));
          }
        }
      }
    }
  }
  if (call.outputs.bitmask && !(in_region && call.destination->bitmask_offset)) {
    const int64_t row = (n + 7) / 8;
    if (static_cast<int64_t>(plan.bitmask.size()) != heads * row) {
      Fail(absl::StrCat("bitmask of ", plan.bitmask.size(), " bytes, expected ", heads * row));
    }
    for (int64_t i = 0; i < heads; ++i) {
      int64_t bits = 0;
      for (int64_t b = 0; b < row; ++b) bits += __builtin_popcount(plan.bitmask[i * row + b]);
      if (bits != plan.counts[i]) {
        Fail(absl::StrCat("head ", i, ": ", bits, " bits set, count ", plan.counts[i]));
      }
    }
  }
  if (call.outputs.scores && !(in_region && call.destination->scores_offset)) {
    if (static_cast<int64_t>(plan.scores.size()) != heads * n) {
      Fail(absl::StrCat(plan.scores.size(), " scores, expected ", heads * n));
    }
    for (size_t i = 0; i < plan.scores.size() && !AllowNonFinite(); ++i) {
      if (std::isnan(plan.scores[i])) Fail(absl::StrCat("scores[", i, "] is NaN"));
    }
  }
}

}  // namespace
}  // namespace laprox::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  namespace fuzz = laprox::fuzz;
  fuzz::SetUpHarness();
  fuzz::core = fuzz::NewCore().release();
  fuzz::output = new fuzz::ShmObject("-out", fuzz::kOutputBytes);
  fuzz::RegisterWorldRegions(*fuzz::core, fuzz::output);
  fuzz::RegisterWorldModels(*fuzz::core);
  // Registered regions stay mapped; nothing needs the names any more, so a crash leaves none.
  fuzz::InputObject().Unlink();
  fuzz::output->Unlink();
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
  auto plan = fuzz::core->ComputeKeepPlan(*call);
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
