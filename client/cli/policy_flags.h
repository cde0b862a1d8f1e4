// laprox-cli's policy flags: one per field of laprox.v1 Policy, and the budget, turned into the
// policy laproxd would compute with.
#ifndef LAPROX_CLIENT_CLI_POLICY_FLAGS_H_
#define LAPROX_CLIENT_CLI_POLICY_FLAGS_H_

#include "absl/status/statusor.h"
#include "laprox/kernels/policy.h"

namespace laprox::cli {

// The policy the flags describe, resolved as laproxd resolves a request (v1::PolicyFromProto:
// the kind's defaults, every flag that is set, then the preset), and validated. A value that is
// not a name of its enum is INVALID_ARGUMENT naming the flag and the accepted names.
absl::StatusOr<kernels::PolicySpec> PolicyFromFlags();

// EXACT_BLOCK needs the model's cross-Grams (PrepareOptions::cross_grams).
bool NeedsCrossGrams(const kernels::PolicySpec& policy);

}  // namespace laprox::cli

#endif  // LAPROX_CLIENT_CLI_POLICY_FLAGS_H_
