// LaproxService: the laprox.v1.Laprox gRPC service on the callback API. It only translates:
// each handler decodes the proto into domain types, makes one call into the core (Core for
// keep-plans, Registry for registrations: leases, metrics series, readiness and reclaim live
// there), encodes the result and turns absl::Status into grpc::Status. Around that it does what
// belongs to an RPC: identifies the caller (every call acts for that Owner: it sees, uses and
// unregisters only what the same identity registered), counts the call, picks the thread, and
// after a failed call asks whether the backend still works.
//
// Blocking work runs on WorkQueues, never on gRPC's callback threads: keep-plans on the compute
// queue (`work`, whose backlog bound answers RESOURCE_EXHAUSTED) or, when Core::IsHeavy says
// they are heavy, on a queue of their own (ServiceOptions::heavy), so that small plans never
// wait behind long ones; the control plane on the queues laproxd gives it (ServiceOptions::
// control and admin), so that registering and unregistering answer while every compute worker
// is busy and the backlog is full. No exception leaves a call: an allocation that fails anyway
// (the host is short of memory) answers RESOURCE_EXHAUSTED.
#ifndef LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
#define LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_

#include <chrono>
#include <functional>
#include <string>

#include "laprox/v1/laprox.grpc.pb.h"
#include "service/core/core.h"
#include "service/core/registry.h"
#include "service/core/work_queue.h"
#include "service/metrics/metrics.h"

namespace laprox::service {

// Who a call comes from (peer_identity.h: IdentifyCaller in laproxd); an error status
// (PERMISSION_DENIED) answers the call and is counted as denied.
using CallerIdentifier = std::function<absl::StatusOr<Owner>(const grpc::ServerContextBase&)>;

// How laproxd runs the service; every field is optional.
struct ServiceOptions {
  // Every call and every plan is recorded here.
  Metrics* metrics = nullptr;
  // Registrations go through it (leases, metrics series, readiness). Unset: a Registry of the
  // service's own over `core`, with no leases and no hooks. Must outlive the service.
  Registry* registry = nullptr;
  // Called after a failed call when Backend::Health() is no longer OK (a sticky device error),
  // with that status; possibly many times and from several threads. laproxd then reports
  // NOT_SERVING.
  std::function<void(const absl::Status& health)> backend_unhealthy = nullptr;
  // The transport's message limits, reported by GetServerInfo (0: not reported). A
  // ComputeKeepMask response larger than max_response_bytes (> 0) is RESOURCE_EXHAUSTED.
  int64_t max_request_bytes = 0;
  int64_t max_response_bytes = 0;
  // When set, keep-plan calls that Core::IsHeavy finds heavy run here instead of on `work`
  // (their own workers and backlog). Must outlive the service.
  WorkQueue* heavy = nullptr;
  // Where region opens (`control`) and model preparations and region drains (`admin`: a drain
  // waits for at most the deadlines of the plans using its region, so give it a few workers)
  // run. Unset: on `work`, behind the keep-plans. Must outlive the service.
  WorkQueue* control = nullptr;
  WorkQueue* admin = nullptr;
};

class LaproxService final : public v1::Laprox::CallbackService {
 public:
  // `core`, `work` and options.metrics must outlive the service. Every call acts for the Owner
  // `identify` names; there is no default identity: a service built with an empty `identify`
  // answers every call INTERNAL (tests that want the all-seeing Owner::Laproxd() say so).
  LaproxService(Core& core, WorkQueue& work, std::string version, CallerIdentifier identify,
                ServiceOptions options = {})
      : core_(core),
        work_(work),
        version_(std::move(version)),
        identify_(std::move(identify)),
        options_(std::move(options)),
        own_registry_(core, absl::ZeroDuration()),
        registry_(options_.registry != nullptr ? *options_.registry : own_registry_),
        control_(options_.control != nullptr ? *options_.control : work),
        admin_(options_.admin != nullptr ? *options_.admin : work) {}
  // Destroy only after the server has shut down and its queues ran what they accepted.

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* context,
                                        const v1::ListRegionsRequest* request,
                                        v1::ListRegionsResponse* response) override;
  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* context,
                                          const v1::RegisterModelRequest* request,
                                          v1::RegisterModelResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterModel(grpc::CallbackServerContext* context,
                                            const v1::UnregisterModelRequest* request,
                                            v1::UnregisterModelResponse* response) override;
  grpc::ServerUnaryReactor* ComputeKeepMask(grpc::CallbackServerContext* context,
                                            const v1::ComputeKeepMaskRequest* request,
                                            v1::ComputeKeepMaskResponse* response) override;
  grpc::ServerUnaryReactor* ComputeKeepPlans(grpc::CallbackServerContext* context,
                                             const v1::ComputeKeepPlansRequest* request,
                                             v1::ComputeKeepPlansResponse* response) override;

 private:
  // OK, or (the response cleared) RESOURCE_EXHAUSTED when `response` is larger than
  // options_.max_response_bytes.
  absl::Status CheckResponseSize(google::protobuf::Message& response) const;
  using Clock = std::chrono::steady_clock;

  // One call from arrival to reply: counts it in flight, and records its method, code and time.
  class Call;
  // What a handler's body decides once it knows the caller: reply OK now (no queue), or run
  // `job` on `queue`, whose status is the reply.
  struct Deferred {
    WorkQueue* queue = nullptr;
    std::function<absl::Status(const Call&)> job;
  };

  // Every RPC: counts the call, identifies the caller (a refusal is the reply), runs
  // `body(owner)` on the callback thread (an exception becomes RESOURCE_EXHAUSTED or INTERNAL),
  // and replies with its status, or, when it returns a Deferred with a queue, hands the call to
  // that queue (RESOURCE_EXHAUSTED when its backlog is full, CANCELLED when the call is gone
  // before it starts). `body` returns absl::StatusOr<Deferred>.
  template <typename Body>
  grpc::ServerUnaryReactor* Handle(grpc::CallbackServerContext* context, Method method,
                                   Body&& body);
  // Finishes the call (its context's DefaultReactor, obtained once) with `status`.
  static grpc::ServerUnaryReactor* Reply(grpc::ServerUnaryReactor* reactor, Call& call,
                                         const absl::Status& status);
  // The queue a keep-plan call of `calls` runs on: options_.heavy for heavy calls, else work_.
  WorkQueue& ComputeQueue(absl::Span<const KeepPlanCall> calls, const Owner& owner);
  absl::Status FillServerInfo(v1::GetServerInfoResponse* response) const;
  // The caller's identity (identify_), counting a refusal in the metrics.
  absl::StatusOr<Owner> Identify(const grpc::CallbackServerContext& context) const;
  // ComputeKeepPlans' job (on a compute queue): the plans, their responses, timing and metrics.
  absl::Status ComputeBatch(grpc::CallbackServerContext* context, const Owner& owner,
                            const std::vector<KeepPlanCall>& calls, const Call& rpc,
                            const v1::ComputeKeepPlansRequest& request,
                            v1::ComputeKeepPlansResponse* response);
  // Asks the backend whether it still works after a failed call (see backend_unhealthy).
  void CheckBackendHealth();

  Core& core_;
  WorkQueue& work_;
  const std::string version_;
  const CallerIdentifier identify_;
  const ServiceOptions options_;
  Registry own_registry_;  // used when options_.registry is unset
  Registry& registry_;
  WorkQueue& control_;
  WorkQueue& admin_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
