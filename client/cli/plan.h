// laprox-cli's keep-plan of a dump: computed in-process with the CPU backend (--local), or by
// laproxd with the dump in shared memory or, with --device, in GPU memory as a cuda_ipc region.
#ifndef LAPROX_CLIENT_CLI_PLAN_H_
#define LAPROX_CLIENT_CLI_PLAN_H_

#include <string>

#include "absl/status/statusor.h"
#include "client/cli/dump.h"
#include "laprox/client/client.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"

namespace laprox::cli {

// In-process: views straight over the loaded bytes.
absl::StatusOr<kernels::KeepPlan> PlanLocal(const Dump& dump, const kernels::PolicySpec& policy);

// Through laproxd: every tensor is copied once into one shared buffer `shm_name` (or, with
// `device`, one device allocation) and sent by reference; the region and the model are
// unregistered before this returns.
absl::StatusOr<kernels::KeepPlan> PlanRemote(client::Client& client, const Dump& dump,
                                             const kernels::PolicySpec& policy, bool device,
                                             const std::string& shm_name);

}  // namespace laprox::cli

#endif  // LAPROX_CLIENT_CLI_PLAN_H_
