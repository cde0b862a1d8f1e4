// Fuzz target: bytes -> laprox.v1.RegisterModelRequest -> ModelSpecFromProto ->
// Core::RegisterModel on the real CPU backend (o_proj inline or in the world's input region,
// fuzz_world.h), then UnregisterModel, so that no state accumulates between inputs. Findings:
// sanitizer reports, allocations past -malloc_limit_mb (the d x d factors and cross-Grams are
// sized by the geometry), refusals with INTERNAL/UNKNOWN, and a registration that does not
// describe the model it was given.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "laprox/v1/laprox.pb.h"
#include "service/grpc/convert.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/fuzz_world.h"

namespace {
laprox::service::Core* core = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  laprox::fuzz::SetUpHarness();
  core = laprox::fuzz::NewCore().release();
  laprox::fuzz::RegisterWorldRegions(*core, nullptr);
  laprox::fuzz::InputObject().Unlink();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fuzz = laprox::fuzz;
  namespace kernels = laprox::kernels;
  namespace service = laprox::service;
  namespace v1 = laprox::v1;
  v1::RegisterModelRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  auto spec = service::ModelSpecFromProto(request);
  if (!spec.ok()) {
    fuzz::CheckRefusal(spec.status(), "ModelSpecFromProto");
    return 0;
  }
  auto model = core->RegisterModel(*spec, service::Owner::Laproxd());
  if (!model.ok()) {
    fuzz::CheckRefusal(model.status(), "Core::RegisterModel");
    return 0;
  }
  fuzz::Note(absl::StrCat("model ", model->id, ": ", model->prepared_bytes, " prepared bytes"));
  const kernels::ModelGeometry& g = model->geometry;
  if (model->id == 0 || g.num_layers != spec->geometry.num_layers ||
      g.num_heads != spec->geometry.num_heads || g.num_kv_heads != spec->geometry.num_kv_heads ||
      g.head_dim != spec->geometry.head_dim || g.hidden_size != spec->geometry.hidden_size ||
      model->prepared_bytes <= 0 || model->name.empty()) {
    fuzz::Fail(absl::StrCat("RegisterModel answered id ", model->id, " ", g.DebugString(),
                            " prepared_bytes ", model->prepared_bytes, " for ",
                            spec->geometry.DebugString()));
  }
  if (absl::Status s = core->UnregisterModel(model->id, service::Owner::Laproxd()); !s.ok()) {
    fuzz::Fail(absl::StrCat("UnregisterModel(", model->id, "): ", s.ToString()));
  }
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return laprox::fuzz::MutateSerializedProto(laprox::v1::RegisterModelRequest::default_instance(),
                                             data, size, max_size, seed);
}
