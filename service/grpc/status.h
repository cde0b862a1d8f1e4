// The one place where absl::Status becomes grpc::Status (docs/style.md principle 7).
#ifndef LAPROX_SERVICE_GRPC_STATUS_H_
#define LAPROX_SERVICE_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace laprox::service {

// Same code (the numeric values of both enums are the canonical gRPC codes), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_STATUS_H_
