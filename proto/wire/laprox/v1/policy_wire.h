// The one mapping between the kernels' policy types and their laprox.v1 wire form, shared by the
// server (service/grpc/convert.cc) and the C++ client.
//
// Policy enums travel as the kernels value + 1, with UNSPECIFIED = 0 meaning the default (the
// first kernels value; for gqa_value and pool_target: unset, which PolicySpec resolves with
// EffectiveGqaValue and EffectivePoolTarget); static_asserts in policy_wire.cc pin the ends and
// the proto contract test checks every value's number. The preset (PolicyPreset) exists on the
// wire only: PolicyFromProto resolves it into the fields.
#ifndef LAPROX_PROTO_WIRE_LAPROX_V1_POLICY_WIRE_H_
#define LAPROX_PROTO_WIRE_LAPROX_V1_POLICY_WIRE_H_

#include <string>

#include "absl/status/statusor.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/tensor_view.h"
#include "laprox/v1/laprox.pb.h"

namespace laprox::v1 {

// Every option explicitly (the receiver applies exactly `policy`), budget included; gqa_value
// and pool_target as PolicySpec::EffectiveGqaValue and EffectivePoolTarget, no preset.
void PolicyToProto(const kernels::PolicySpec& policy, Policy* proto);
void BudgetToProto(const kernels::Budget& budget, Budget* proto);

// The policy a request asks for: the kind first, then every field that is set overrides that
// kind's defaults (PolicySpec::ForKind), then the preset fills the fields it names that are not
// set (tests/reference/SEMANTICS.md, "Presets"). INVALID_ARGUMENT naming "policy.<field>" for an
// enum value the proto does not define, naming preset and kind for a preset with a kind other
// than LAPROX, or "budget" when none is given. Ranges are checked later by PolicySpec::Validate.
absl::StatusOr<kernels::PolicySpec> PolicyFromProto(const Policy& policy, const Budget& budget);

DType DTypeToProto(kernels::DType dtype);
// INVALID_ARGUMENT naming `field` for UNSPECIFIED or an unknown value.
absl::StatusOr<kernels::DType> DTypeFromProto(DType dtype, const std::string& field);

}  // namespace laprox::v1

#endif  // LAPROX_PROTO_WIRE_LAPROX_V1_POLICY_WIRE_H_
