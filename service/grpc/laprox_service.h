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
// Every call first learns who it comes from (ServiceOptions::identify) and then acts for that
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
  // Who a call comes from (peer_identity.h: IdentifyCaller); an error status (PERMISSION_DENIED)
  // answers the call and is counted as denied. Empty: every call acts as Owner::Laproxd() (tests
  // of the translation alone).
  std::function<absl::StatusOr<Owner>(const grpc::ServerContextBase&)> identify;
  // When set, every region and model a local client registers is recorded here, and
  // ReclaimLapsed() unregisters those of clients that are gone. Must outlive the service.
  LeaseTable* leases = nullptr;
  // When set, keep-plan calls that Core::IsHeavy finds heavy run here instead of on `work`
  // (their own workers and backlog). Must outlive the service.
  WorkQueue* heavy = nullptr;
};

class LaproxService final : public v1::Laprox::CallbackService {
 public:
  // `core`, `work` and options.metrics must outlive the service.
  LaproxService(Core& core, WorkQueue& work, std::string version, ServiceOptions options = {})
      : core_(core), work_(work), version_(std::move(version)), options_(std::move(options)) {}
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

  // Finishes the call (its context's DefaultReactor, obtained once) with `status`.
  static grpc::ServerUnaryReactor* Reply(grpc::ServerUnaryReactor* reactor, Call& call,
                                         const absl::Status& status);
  // The queue a keep-plan call of `calls` runs on: options_.heavy for heavy calls, else work_.
  WorkQueue& ComputeQueue(absl::Span<const KeepPlanCall> calls, const Owner& owner);
  // Runs `job` (returning absl::Status) on `queue` and finishes the call with its status.
  template <typename Job>
  grpc::ServerUnaryReactor* Offload(WorkQueue& queue, grpc::CallbackServerContext* context,
                                    Call call, Job job);
  absl::Status FillServerInfo(v1::GetServerInfoResponse* response) const;
  // The caller's identity (options_.identify), counting a refusal in the metrics.
  absl::StatusOr<Owner> Identify(const grpc::CallbackServerContext& context) const;
  // Registers the region the request describes (on the control queue); a call that stopped
  // meanwhile leaves nothing registered.
  absl::Status OpenRegion(grpc::CallbackServerContext* context, const Owner& owner,
                          const v1::RegisterRegionRequest& request,
                          v1::RegisterRegionResponse* response);
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
  const ServiceOptions options_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
