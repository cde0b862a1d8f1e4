// LaproxService: the laprox.v1.Laprox gRPC service on the callback API. It only translates:
// proto -> domain types, one Core call, domain result -> proto, absl::Status -> grpc::Status.
// Blocking work runs on WorkQueues, never on gRPC's callback threads: keep-plans on the compute
// queue (`work`, whose backlog bound answers RESOURCE_EXHAUSTED) or, when Core::IsHeavy says
// they are heavy, on a queue of their own (ServiceOptions::heavy), so that small plans never
// wait behind long ones; the control plane on
// queues of its own, so that registering and unregistering answer while every compute worker
// is busy and the backlog is full: region opens on one, model preparation and region draining
// (which waits for the plans using the region) on another. No exception leaves a call: an
// allocation that fails anyway (the host is short of memory) answers RESOURCE_EXHAUSTED.
// Every call first learns who it comes from (the CallerIdentifier) and then acts for that
// Owner: it sees, uses and unregisters only what the same identity registered.
#ifndef LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
#define LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_

#include <chrono>
#include <functional>
#include <string>

#include "laprox/v1/laprox.grpc.pb.h"
#include "service/core/core.h"
#include "service/core/leases.h"
#include "service/core/work_queue.h"
#include "service/metrics/metrics.h"

namespace laprox::service {

// Who a call comes from (peer_identity.h: IdentifyCaller in laproxd); an error status
// (PERMISSION_DENIED) answers the call and is counted as denied.
using CallerIdentifier = std::function<absl::StatusOr<Owner>(const grpc::ServerContextBase&)>;

// How laproxd runs the service; every field is optional.
struct ServiceOptions {
  // Every call, every plan and every model (un)registration is recorded here.
  Metrics* metrics = nullptr;
  // Called with the number of registered models after a model was registered or unregistered
  // (laproxd derives its readiness from it).
  std::function<void(int64_t models)> models_changed;
  // Called after a failed call when Backend::Health() is no longer OK (a sticky device error),
  // with that status; possibly many times and from several threads. laproxd then reports
  // NOT_SERVING.
  std::function<void(const absl::Status& health)> backend_unhealthy = nullptr;
  // The transport's message limits, reported by GetServerInfo (0: not reported). A
  // ComputeKeepMask response larger than max_response_bytes (> 0) is RESOURCE_EXHAUSTED.
  int64_t max_request_bytes = 0;
  int64_t max_response_bytes = 0;
  // When set, every region and model a local client registers is recorded here, and
  // ReclaimLapsed() unregisters those of clients that are gone. Must outlive the service.
  LeaseTable* leases = nullptr;
  // When set, keep-plan calls that Core::IsHeavy finds heavy run here instead of on `work`
  // (their own workers and backlog). Must outlive the service.
  WorkQueue* heavy = nullptr;
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
        options_(std::move(options)) {}
  // Destroy only after the server has shut down (region opens still queued are then run).

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

  // Unregisters the regions and models of the clients options.leases finds gone (`connected`
  // says which still have a connection open), exactly as UnregisterRegion / UnregisterModel
  // would: a region drains for at most 10 s, then goes with its last plan. Counts them in the
  // metrics. Call it periodically from one thread; it blocks while regions drain.
  void ReclaimLapsed(const LeaseTable::Connected& connected);

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
  // Registers the region the request describes (on the control queue); a call that stopped
  // meanwhile leaves nothing registered.
  absl::Status OpenRegion(grpc::CallbackServerContext* context, const Owner& owner,
                          const v1::RegisterRegionRequest& request,
                          v1::RegisterRegionResponse* response);
  // RegisterModel's job (on the admin queue): prepares the model, adds its metrics series and
  // its lease.
  absl::Status AddModel(grpc::CallbackServerContext* context, const Owner& owner,
                        const v1::RegisterModelRequest& request,
                        v1::RegisterModelResponse* response);
  // ComputeKeepPlans' job (on a compute queue): the plans, their responses, timing and metrics.
  absl::Status ComputeBatch(grpc::CallbackServerContext* context, const Owner& owner,
                            const std::vector<KeepPlanCall>& calls, const Call& rpc,
                            const v1::ComputeKeepPlansRequest& request,
                            v1::ComputeKeepPlansResponse* response);
  void ModelsChanged();
  // Asks the backend whether it still works after a failed call (see backend_unhealthy).
  void CheckBackendHealth();

  Core& core_;
  WorkQueue& work_;
  WorkQueue control_{/*workers=*/1, /*max_pending=*/256};  // region opens
  // RegisterModel (preparation) and UnregisterRegion (draining): a drain waits for at most the
  // deadlines of the plans using its region, so a few workers keep the others moving.
  WorkQueue admin_{/*workers=*/4, /*max_pending=*/256};
  const std::string version_;
  const CallerIdentifier identify_;
  const ServiceOptions options_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
