// How laprox-cli prints a keep-plan: a budget-share table, or JSON (--json).
#ifndef LAPROX_CLIENT_CLI_OUTPUT_H_
#define LAPROX_CLIENT_CLI_OUTPUT_H_

#include "laprox/kernels/keep_plan.h"

namespace laprox::cli {

// {"counts", "kept", "layer_sums"}, and "kept_blocks" per unit and "block_size" for a block
// shape.
void PrintJson(const kernels::KeepPlan& plan);
// Budget share: kept tokens of each (layer, head) over the uniform share (kept per head on
// average), so 1.00 is "exactly its share"; the last column is the layer's mean.
void PrintTable(const kernels::KeepPlan& plan);

}  // namespace laprox::cli

#endif  // LAPROX_CLIENT_CLI_OUTPUT_H_
