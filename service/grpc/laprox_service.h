// LaproxService: the laprox.v1.Laprox gRPC service on the callback API. It only translates:
// proto -> domain types, one Core call, domain result -> proto, absl::Status -> grpc::Status.
// Blocking work (keep-plans, model preparation, region draining) runs on a WorkQueue, never on
// gRPC's callback threads.
#ifndef LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
#define LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_

#include <string>

#include "laprox/v1/laprox.grpc.pb.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"

namespace laprox::service {

class LaproxService final : public v1::Laprox::CallbackService {
 public:
  // `core` and `work` must outlive the service.
  LaproxService(Core& core, WorkQueue& work, std::string version)
      : core_(core), work_(work), version_(std::move(version)) {}

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

 private:
  // Runs `job` (returning absl::Status) on the work queue and finishes the call with its status.
  template <typename Job>
  grpc::ServerUnaryReactor* Offload(grpc::CallbackServerContext* context, Job job);

  Core& core_;
  WorkQueue& work_;
  const std::string version_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_LAPROX_SERVICE_H_
