#include "service/grpc/laprox_service.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "laprox/v1/plan_wire.h"
#include "service/grpc/convert.h"
#include "service/grpc/status.h"

namespace laprox::service {
namespace {

absl::Time Deadline(const grpc::CallbackServerContext* context) {
  return absl::FromChrono(context->deadline());
}

// What Core needs of a call: its deadline, its cancellation and who makes it.
CallContext CallOf(grpc::CallbackServerContext* context, const Owner& owner) {
  return {.owner = owner, .deadline = Deadline(context), .cancelled = [context] {
            return context->IsCancelled();
          }};
}

double SecondsBetween(std::chrono::steady_clock::time_point from,
                      std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// The stages of a keep-plan call: the queue (received to started), the plan's own compute
// stages, and the respond stage (computed to done).
StageSeconds Stages(std::chrono::steady_clock::time_point received,
                    std::chrono::steady_clock::time_point started, const kernels::PlanTiming& plan,
                    std::chrono::steady_clock::time_point computed,
                    std::chrono::steady_clock::time_point done) {
  return {.queue = SecondsBetween(received, started),
          .validate = plan.validate_seconds,
          .score = plan.score_seconds,
          .select = plan.select_seconds,
          .respond = SecondsBetween(computed, done)};
}

// The service's stages in a response's Timing (the plan's own stages are in it already).
void SetServiceTiming(const StageSeconds& stages, double total_seconds, v1::Timing* timing) {
  timing->set_queue_seconds(stages.queue);
  timing->set_respond_seconds(stages.respond);
  timing->set_total_seconds(total_seconds);
}

// Runs a handler's body; an exception (std::bad_alloc from a container when the host is short
// of memory despite the budgets) becomes a status instead of std::terminate.
// `fn` returns absl::Status or absl::StatusOr<T>.
template <typename Fn>
auto Guarded(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("laproxd ran out of memory serving this call");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected exception: ", e.what()));
  }
}

}  // namespace

class LaproxService::Call {
 public:
  Call(Metrics* metrics, Method method)
      : metrics_(metrics), method_(method), received_(Clock::now()) {
    if (metrics_ != nullptr) metrics_->CallStarted();
  }
  Call(Call&& other) noexcept
      : metrics_(std::exchange(other.metrics_, nullptr)),
        method_(other.method_),
        received_(other.received_) {}
  Call& operator=(Call&&) = delete;
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  ~Call() { Done(grpc::StatusCode::UNKNOWN); }  // only if never finished

  Clock::time_point received() const { return received_; }

  void Done(grpc::StatusCode code) {
    if (metrics_ == nullptr) return;
    metrics_->RecordCall(method_, static_cast<int>(code), SecondsBetween(received_, Clock::now()));
    metrics_->CallFinished();
    metrics_ = nullptr;
  }

 private:
  Metrics* metrics_;
  Method method_;
  Clock::time_point received_;
};

grpc::ServerUnaryReactor* LaproxService::Reply(grpc::ServerUnaryReactor* reactor, Call& call,
                                               const absl::Status& status) {
  grpc::Status reply = ToGrpcStatus(status);
  call.Done(reply.error_code());
  reactor->Finish(std::move(reply));
  return reactor;
}

template <typename Body>
grpc::ServerUnaryReactor* LaproxService::Handle(grpc::CallbackServerContext* context, Method method,
                                                Body&& body) {
  Call call(options_.metrics, method);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Owner> owner = Identify(*context);
  if (!owner.ok()) return Reply(reactor, call, owner.status());
  absl::StatusOr<Deferred> next =
      Guarded([&]() -> absl::StatusOr<Deferred> { return body(*std::move(owner)); });
  if (!next.ok() || next->queue == nullptr) return Reply(reactor, call, next.status());
  auto shared_call = std::make_shared<Call>(std::move(call));
  absl::Status queued =
      next->queue->Submit([this, context, shared_call, reactor, job = std::move(next->job)] {
        if (context->IsCancelled()) {
          Reply(reactor, *shared_call, absl::CancelledError("cancelled before it started"));
          return;
        }
        absl::Status status = Guarded([&] { return job(*shared_call); });
        if (!status.ok()) CheckBackendHealth();
        Reply(reactor, *shared_call, status);
      });
  if (!queued.ok()) return Reply(reactor, *shared_call, queued);
  return reactor;
}

WorkQueue& LaproxService::ComputeQueue(absl::Span<const KeepPlanCall> calls, const Owner& owner) {
  if (options_.heavy == nullptr || !core_.IsHeavy(calls, owner)) return work_;
  return *options_.heavy;
}

void LaproxService::CheckBackendHealth() {
  if (!options_.backend_unhealthy) return;
  if (absl::Status health = core_.backend().Health(); !health.ok()) {
    options_.backend_unhealthy(health);
  }
}

absl::StatusOr<Owner> LaproxService::Identify(const grpc::CallbackServerContext& context) const {
  absl::StatusOr<Owner> owner =
      identify_ ? identify_(context)
                : absl::InternalError(
                      "this laprox service was built without a caller identifier: it serves "
                      "no call (nobody acts for laproxd by default)");
  if (!owner.ok() && options_.metrics != nullptr) options_.metrics->RecordDenied();
  return owner;
}

absl::Status LaproxService::FillServerInfo(v1::GetServerInfoResponse* response) const {
  response->set_version(version_);
  response->set_backend(core_.backend().kind() == kernels::BackendKind::kCuda
                            ? v1::BACKEND_KIND_CUDA
                            : v1::BACKEND_KIND_CPU);
  response->set_backend_description(core_.backend().Describe());
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_regions(static_cast<int32_t>(core_.limits().max_regions));
  limits->set_max_models(static_cast<int32_t>(core_.limits().max_models));
  limits->set_max_tokens(core_.limits().max_tokens);
  limits->set_max_batch_sequences(static_cast<int32_t>(core_.limits().max_batch_sequences));
  limits->set_max_request_work(core_.limits().max_request_work);
  limits->set_heavy_request_work(core_.limits().heavy_request_work);
  limits->set_max_request_memory_bytes(core_.request_memory().limit());
  limits->set_max_model_memory_bytes(core_.model_memory().limit());
  limits->set_max_request_bytes(options_.max_request_bytes);
  limits->set_max_response_bytes(options_.max_response_bytes);
  limits->set_max_window(kernels::PolicySpec::kMaxWindow);
  limits->set_max_pool_kernel(kernels::PolicySpec::kMaxPoolKernel);
  limits->set_max_tokens_per_head(kernels::PolicySpec::kMaxTokensPerHead);
  for (int wire = v1::POLICY_KIND_LAPROX; wire <= v1::PolicyKind_MAX; ++wire) {
    // The backend says which kinds it computes.
    const std::optional<kernels::PolicyKind> kind = v1::PolicyKindFromProto(wire);
    if (kind && core_.backend().Supports(*kind)) {
      response->add_supported_policies(v1::PolicyKindToProto(*kind));
    }
  }
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    response->add_supported_dtypes(d);
  }
  for (const kernels::DeviceDescription& d : core_.backend().Devices()) {
    DeviceToProto(d, response->add_devices());
  }
  response->add_supported_region_kinds(v1::REGION_KIND_SHM);
  // Only a backend with device memory opens CUDA IPC handles (Backend::ImportCudaIpc).
  if (core_.backend().kind() == kernels::BackendKind::kCuda) {
    response->add_supported_region_kinds(v1::REGION_KIND_CUDA_IPC);
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* LaproxService::GetServerInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetServerInfoRequest*,
                                                       v1::GetServerInfoResponse* response) {
  return Handle(context, Method::kGetServerInfo, [&](const Owner&) -> absl::StatusOr<Deferred> {
    if (absl::Status s = FillServerInfo(response); !s.ok()) return s;
    return Deferred{};
  });
}

grpc::ServerUnaryReactor* LaproxService::RegisterRegion(grpc::CallbackServerContext* context,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegisterRegionResponse* response) {
  // Opening never blocks (shm: O_NONBLOCK, regular files only), but an IPC handle is slow to
  // open (the driver maps the allocation): both off the callback threads.
  return Handle(context, Method::kRegisterRegion, [&](Owner owner) -> absl::StatusOr<Deferred> {
    absl::StatusOr<RegionSpec> spec = RegionSpecFromProto(*request);
    if (!spec.ok()) return spec.status();
    return Deferred{&control_,
                    [this, context, owner = std::move(owner), spec = *std::move(spec),
                     response](const Call&) -> absl::Status {
                      absl::StatusOr<uint64_t> id =
                          registry_.RegisterRegion(spec, CallOf(context, owner));
                      if (!id.ok()) return id.status();
                      response->set_region_id(*id);
                      return absl::OkStatus();
                    }};
  });
}

grpc::ServerUnaryReactor* LaproxService::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse*) {
  const uint64_t id = request->region_id();
  const absl::Time deadline = Deadline(context);
  // Waits for in-flight requests: off the callback threads, and off the compute queue.
  return Handle(context, Method::kUnregisterRegion, [&](Owner owner) -> absl::StatusOr<Deferred> {
    return Deferred{&admin_, [this, id, deadline, owner = std::move(owner)](const Call&) {
                      return registry_.UnregisterRegion(id, owner, deadline);
                    }};
  });
}

grpc::ServerUnaryReactor* LaproxService::ListRegions(grpc::CallbackServerContext* context,
                                                     const v1::ListRegionsRequest*,
                                                     v1::ListRegionsResponse* response) {
  return Handle(context, Method::kListRegions, [&](const Owner& owner) -> absl::StatusOr<Deferred> {
    for (const RegionInfo& info : core_.regions().List(owner)) {
      RegionInfoToProto(info, response->add_regions());
    }
    return Deferred{};
  });
}

grpc::ServerUnaryReactor* LaproxService::RegisterModel(grpc::CallbackServerContext* context,
                                                       const v1::RegisterModelRequest* request,
                                                       v1::RegisterModelResponse* response) {
  return Handle(context, Method::kRegisterModel, [&](Owner owner) -> absl::StatusOr<Deferred> {
    // The spec keeps views of the request (the o_proj bytes), which outlives the job.
    absl::StatusOr<ModelSpec> spec = ModelSpecFromProto(*request);
    if (!spec.ok()) return spec.status();
    return Deferred{&admin_,
                    [this, context, owner = std::move(owner), spec = *std::move(spec),
                     response](const Call&) -> absl::Status {
                      absl::StatusOr<ModelInfo> model =
                          registry_.RegisterModel(spec, CallOf(context, owner));
                      if (!model.ok()) return model.status();
                      response->set_model_id(model->id);
                      response->set_prepared_bytes(model->prepared_bytes);
                      return absl::OkStatus();
                    }};
  });
}

grpc::ServerUnaryReactor* LaproxService::UnregisterModel(grpc::CallbackServerContext* context,
                                                         const v1::UnregisterModelRequest* request,
                                                         v1::UnregisterModelResponse*) {
  return Handle(
      context, Method::kUnregisterModel, [&](const Owner& owner) -> absl::StatusOr<Deferred> {
        if (absl::Status s = registry_.UnregisterModel(request->model_id(), owner); !s.ok()) {
          return s;
        }
        return Deferred{};
      });
}

absl::Status LaproxService::CheckResponseSize(google::protobuf::Message& response) const {
  const auto bytes = static_cast<int64_t>(response.ByteSizeLong());
  if (options_.max_response_bytes <= 0 || bytes <= options_.max_response_bytes) {
    return absl::OkStatus();
  }
  response.Clear();
  return absl::ResourceExhaustedError(
      absl::StrCat("the response would be ", bytes,
                   " bytes, more than max_response_bytes = ", options_.max_response_bytes,
                   "; write positions, bitmask or scores into a region (outputs.destination)"));
}

grpc::ServerUnaryReactor* LaproxService::ComputeKeepMask(grpc::CallbackServerContext* context,
                                                         const v1::ComputeKeepMaskRequest* request,
                                                         v1::ComputeKeepMaskResponse* response) {
  return Handle(context, Method::kComputeKeepMask, [&](Owner owner) -> absl::StatusOr<Deferred> {
    // Converted here (views of the request, no copies) to choose the queue by its work.
    auto converted = KeepPlanCallFromProto(*request);
    if (!converted.ok()) return converted.status();
    auto call = std::make_shared<KeepPlanCall>(*std::move(converted));
    WorkQueue& queue = ComputeQueue(absl::MakeConstSpan(call.get(), 1), owner);
    return Deferred{&queue,
                    [this, context, owner = std::move(owner), request, response,
                     call](const Call& rpc) -> absl::Status {
                      const Clock::time_point started = Clock::now();
                      MemoryBudget::Reservation memory;  // covers the response built below
                      CallContext call_context = CallOf(context, owner);
                      call_context.hold_memory = &memory;
                      call_context.started = started;
                      auto plan = core_.ComputeKeepPlan(*call, call_context);
                      if (!plan.ok()) return plan.status();
                      const Clock::time_point computed = Clock::now();
                      v1::KeepPlanToProto(*plan, call->policy, response);
                      if (absl::Status s = CheckResponseSize(*response); !s.ok()) return s;
                      const Clock::time_point done = Clock::now();
                      const StageSeconds stages =
                          Stages(rpc.received(), started, plan->timing, computed, done);
                      SetServiceTiming(stages, SecondsBetween(rpc.received(), done),
                                       response->mutable_timing());
                      if (options_.metrics != nullptr) {
                        options_.metrics->RecordStages(stages);
                        options_.metrics->RecordPlan(request->model_id(), *plan);
                      }
                      return absl::OkStatus();
                    }};
  });
}

grpc::ServerUnaryReactor* LaproxService::ComputeKeepPlans(
    grpc::CallbackServerContext* context, const v1::ComputeKeepPlansRequest* request,
    v1::ComputeKeepPlansResponse* response) {
  return Handle(context, Method::kComputeKeepPlans, [&](Owner owner) -> absl::StatusOr<Deferred> {
    // Converted here (views of the request, no copies) to choose the queue by its work.
    auto calls = std::make_shared<std::vector<KeepPlanCall>>();
    calls->reserve(request->sequences_size());
    for (int i = 0; i < request->sequences_size(); ++i) {
      auto call = KeepPlanCallFromProto(request->sequences(i));
      if (!call.ok()) {
        return absl::Status(call.status().code(),
                            absl::StrCat("sequences[", i, "].", call.status().message()));
      }
      calls->push_back(*std::move(call));
    }
    WorkQueue& queue = ComputeQueue(*calls, owner);
    return Deferred{&queue, [this, context, owner = std::move(owner), request, response,
                             calls](const Call& rpc) {
                      return ComputeBatch(context, owner, *calls, rpc, *request, response);
                    }};
  });
}

absl::Status LaproxService::ComputeBatch(grpc::CallbackServerContext* context, const Owner& owner,
                                         const std::vector<KeepPlanCall>& calls, const Call& rpc,
                                         const v1::ComputeKeepPlansRequest& request,
                                         v1::ComputeKeepPlansResponse* response) {
  const Clock::time_point started = Clock::now();
  MemoryBudget::Reservation memory;  // covers the responses built below
  CallContext call_context = CallOf(context, owner);
  call_context.hold_memory = &memory;
  call_context.started = started;
  auto plans = core_.ComputeKeepPlans(calls, call_context);
  if (!plans.ok()) return plans.status();
  const Clock::time_point computed = Clock::now();
  for (size_t i = 0; i < plans->size(); ++i) {
    v1::KeepPlanToProto((*plans)[i], calls[i].policy, response->add_plans());
  }
  if (absl::Status s = CheckResponseSize(*response); !s.ok()) return s;
  const Clock::time_point done = Clock::now();
  // The batch's sequences were scored and selected together: every plan has its stages.
  const StageSeconds stages =
      Stages(rpc.received(), started, plans->front().timing, computed, done);
  for (v1::ComputeKeepMaskResponse& plan : *response->mutable_plans()) {
    SetServiceTiming(stages, SecondsBetween(rpc.received(), done), plan.mutable_timing());
  }
  *response->mutable_timing() = response->plans(0).timing();
  if (options_.metrics != nullptr) {
    options_.metrics->RecordStages(stages);
    for (size_t i = 0; i < plans->size(); ++i) {
      options_.metrics->RecordPlan(request.sequences(static_cast<int>(i)).model_id(), (*plans)[i]);
    }
  }
  return absl::OkStatus();
}

}  // namespace laprox::service
