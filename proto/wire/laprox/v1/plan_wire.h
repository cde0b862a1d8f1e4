// The one mapping between the kernels' keep-plan types and their laprox.v1 wire form, shared by
// the server (service/grpc/convert.cc) and the C++ client: model geometry, policy kinds, output
// options and destinations, keep plans, and the five per-layer tensor fields. Policies and
// dtypes are in policy_wire.h. Enum maps are pinned by static_asserts in the .cc files.
#ifndef LAPROX_PROTO_WIRE_LAPROX_V1_PLAN_WIRE_H_
#define LAPROX_PROTO_WIRE_LAPROX_V1_PLAN_WIRE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/v1/laprox.pb.h"

namespace laprox::v1 {

void GeometryToProto(const kernels::ModelGeometry& geometry, ModelGeometry* proto);
// Copies the fields as they are; ModelGeometry::Validate checks them.
kernels::ModelGeometry GeometryFromProto(const ModelGeometry& proto);

PolicyKind PolicyKindToProto(kernels::PolicyKind kind);
// nullopt for POLICY_KIND_UNSPECIFIED and for a number this build does not define (a newer
// server's kind, as GetServerInfo lists it).
std::optional<kernels::PolicyKind> PolicyKindFromProto(int kind);

// The options and, when given, the destination of a request (every offset that is set).
void OutputsToProto(const kernels::OutputOptions& outputs,
                    const kernels::OutputDestination* destination, OutputOptions* proto);
// positions defaults to true when unset. INVALID_ARGUMENT naming the field for a destination
// with region_id 0 or a negative offset; whether the region exists, is writable and holds the
// areas is checked where it is resolved (service/core).
absl::Status OutputsFromProto(const OutputOptions& proto, kernels::OutputOptions* outputs,
                              std::optional<kernels::OutputDestination>* destination);

// Everything of `plan` (its compute timing too; the service adds queue, respond and total) and
// the policy that was applied, every option explicit.
void KeepPlanToProto(const kernels::KeepPlan& plan, const kernels::PolicySpec& effective_policy,
                     ComputeKeepMaskResponse* proto);
// The plan a response carries, its compute timing included.
kernels::KeepPlan KeepPlanFromProto(const ComputeKeepMaskResponse& proto);

// A response's positions and scores: little-endian int32 and float32 arrays in `bytes` fields
// (on the wire the same as a packed sfixed32 / float field). Trailing bytes short of a whole
// element are ignored.
std::vector<int32_t> PositionsOf(const ComputeKeepMaskResponse& proto);
std::vector<float> ScoresOf(const ComputeKeepMaskResponse& proto);

// LayerInputs' five tensors as members that kernels::ForEachLayerTensor walks beside a C++
// struct of them: the read accessors of a received message, and the mutable ones of a message
// being built (call one only for a tensor that is given: it sets the field).
struct LayerTensorGetters {
  const TensorRef& (LayerInputs::*keys)() const = &LayerInputs::keys;
  const TensorRef& (LayerInputs::*values)() const = &LayerInputs::values;
  const TensorRef& (LayerInputs::*window_queries)() const = &LayerInputs::window_queries;
  const TensorRef& (LayerInputs::*window_attention)() const = &LayerInputs::window_attention;
  const TensorRef& (LayerInputs::*window_lse)() const = &LayerInputs::window_lse;
};
struct LayerTensorMutators {
  TensorRef* (LayerInputs::*keys)() = &LayerInputs::mutable_keys;
  TensorRef* (LayerInputs::*values)() = &LayerInputs::mutable_values;
  TensorRef* (LayerInputs::*window_queries)() = &LayerInputs::mutable_window_queries;
  TensorRef* (LayerInputs::*window_attention)() = &LayerInputs::mutable_window_attention;
  TensorRef* (LayerInputs::*window_lse)() = &LayerInputs::mutable_window_lse;
};

}  // namespace laprox::v1

#endif  // LAPROX_PROTO_WIRE_LAPROX_V1_PLAN_WIRE_H_
