#include "service/grpc/laprox_service.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/grpc/convert.h"
#include "service/grpc/status.h"

namespace laprox::service {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

absl::Time Deadline(const grpc::CallbackServerContext* context) {
  return absl::FromChrono(context->deadline());
}

}  // namespace

template <typename Job>
grpc::ServerUnaryReactor* LaproxService::Offload(grpc::CallbackServerContext* context, Job job) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status queued = work_.Submit([context, reactor, job = std::move(job)]() mutable {
    if (context->IsCancelled()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled before it started"));
      return;
    }
    reactor->Finish(ToGrpcStatus(job()));
  });
  if (!queued.ok()) reactor->Finish(ToGrpcStatus(queued));
  return reactor;
}

grpc::ServerUnaryReactor* LaproxService::GetServerInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetServerInfoRequest*,
                                                       v1::GetServerInfoResponse* response) {
  response->set_version(version_);
  response->set_backend(core_.backend().kind() == kernels::BackendKind::kCuda
                            ? v1::BACKEND_KIND_CUDA
                            : v1::BACKEND_KIND_CPU);
  response->set_backend_description(core_.backend().Describe());
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_regions(static_cast<int32_t>(core_.limits().max_regions));
  limits->set_max_models(static_cast<int32_t>(core_.limits().max_models));
  limits->set_max_tokens(core_.limits().max_tokens);
  limits->set_max_window(kernels::PolicySpec::kMaxWindow);
  limits->set_max_pool_kernel(kernels::PolicySpec::kMaxPoolKernel);
  limits->set_max_tokens_per_head(kernels::PolicySpec::kMaxTokensPerHead);
  response->add_supported_policies(v1::POLICY_KIND_LAPROX);
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    response->add_supported_dtypes(d);
  }
  response->add_supported_region_kinds(v1::REGION_KIND_SHM);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* LaproxService::RegisterRegion(grpc::CallbackServerContext* context,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegisterRegionResponse* response) {
  switch (request->kind_case()) {
    case v1::RegisterRegionRequest::kShm: {
      const v1::ShmRegion& shm = request->shm();
      auto id = core_.regions().RegisterShm({.name = shm.name(),
                                             .offset = shm.offset(),
                                             .byte_size = shm.byte_size(),
                                             .writable = request->writable()});
      if (id.ok()) response->set_region_id(*id);
      return Finish(context, id.status());
    }
    case v1::RegisterRegionRequest::kCudaIpc:
      return Finish(context, absl::UnimplementedError(absl::StrCat(
                                 "cuda_ipc regions need the CUDA backend; this server runs ",
                                 core_.backend().Describe())));
    case v1::RegisterRegionRequest::KIND_NOT_SET:
      break;
  }
  return Finish(context,
                absl::InvalidArgumentError("region kind is missing: give shm or cuda_ipc"));
}

grpc::ServerUnaryReactor* LaproxService::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse*) {
  const uint64_t id = request->region_id();
  const absl::Time deadline = Deadline(context);
  // Waits for in-flight requests: off the callback threads.
  return Offload(context,
                 [this, id, deadline] { return core_.regions().Unregister(id, deadline); });
}

grpc::ServerUnaryReactor* LaproxService::ListRegions(grpc::CallbackServerContext* context,
                                                     const v1::ListRegionsRequest*,
                                                     v1::ListRegionsResponse* response) {
  for (const RegionInfo& info : core_.regions().List()) {
    RegionInfoToProto(info, response->add_regions());
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* LaproxService::RegisterModel(grpc::CallbackServerContext* context,
                                                       const v1::RegisterModelRequest* request,
                                                       v1::RegisterModelResponse* response) {
  return Offload(context, [this, request, response]() -> absl::Status {
    auto spec = ModelSpecFromProto(*request);
    if (!spec.ok()) return spec.status();
    auto model = core_.RegisterModel(*spec);
    if (!model.ok()) return model.status();
    response->set_model_id(model->id);
    response->set_prepared_bytes(model->prepared_bytes);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* LaproxService::UnregisterModel(grpc::CallbackServerContext* context,
                                                         const v1::UnregisterModelRequest* request,
                                                         v1::UnregisterModelResponse*) {
  return Finish(context, core_.UnregisterModel(request->model_id()));
}

grpc::ServerUnaryReactor* LaproxService::ComputeKeepMask(grpc::CallbackServerContext* context,
                                                         const v1::ComputeKeepMaskRequest* request,
                                                         v1::ComputeKeepMaskResponse* response) {
  const auto received = std::chrono::steady_clock::now();
  return Offload(context, [this, request, response, received]() -> absl::Status {
    using Seconds = std::chrono::duration<double>;
    const auto started = std::chrono::steady_clock::now();
    auto call = KeepPlanCallFromProto(*request);
    if (!call.ok()) return call.status();
    auto plan = core_.ComputeKeepPlan(*call);
    if (!plan.ok()) return plan.status();
    const auto computed = std::chrono::steady_clock::now();
    KeepPlanToProto(*plan, *call, response);
    const auto done = std::chrono::steady_clock::now();
    v1::Timing* timing = response->mutable_timing();
    timing->set_queue_seconds(Seconds(started - received).count());
    timing->set_score_seconds(Seconds(computed - started).count());
    timing->set_respond_seconds(Seconds(done - computed).count());
    timing->set_total_seconds(Seconds(done - received).count());
    return absl::OkStatus();
  });
}

}  // namespace laprox::service
