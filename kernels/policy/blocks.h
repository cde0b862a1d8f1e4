// Block-shaped plans (PlanShape kBlocksShared and kBlocksPerLayer): whole logical blocks kept or
// evicted identically in every KV head, scored by the sum of their positions' per-token scores
// (tests/reference/SEMANTICS.md, "Plan shapes"). Backend-independent host code, shared by the
// LAPROX selection (select.cc) and the baselines (baselines.cc).
#ifndef LAPROX_KERNELS_POLICY_BLOCKS_H_
#define LAPROX_KERNELS_POLICY_BLOCKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::policy {

// What a policy makes of blocks.
struct BlockRule {
  PlanShape plan_shape = PlanShape::kBlocksShared;  // a block shape
  int64_t forced_begin = 0;  // positions [0, forced_begin) are forced (sinks)
  int64_t forced_end = 0;    // positions [forced_end, n) are forced (the window)
  // kBlocksPerLayer: every (layer, block) pair competes model-wide for L * qb slots (LAPROX's
  // global allocations); false: each layer selects its own qb.
  bool model_wide = false;
  // STREAMING_LLM: the block index is the score (the most recent blocks win).
  bool by_recency = false;
};

// The keep-plan of a block-shaped policy. `token_scores` ([L, Hkv, n]) are summed over each
// candidate block's positions (read nowhere else), in float64 and in (layer, head, position)
// order; `output_scores` ([L, Hkv, n]) become the plan's per-token scores when requested.
// Budget: shape.kept_per_head tokens per head (>= n: every block is kept), else
// floor(kept_per_head / block_size) blocks per unit, forced blocks included. Preconditions:
// shape.block_size >= 1, shape.num_blocks = ceil(n / block_size), no NaN among the read scores
// (a NaN is INTERNAL, naming its position). layer_sums are left empty. The new block tables
// and freed ids are filled by FillBlockTables.
template <typename Score>
absl::StatusOr<KeepPlan> SelectBlockPlan(const RequestShape& shape, const BlockRule& rule,
                                         absl::Span<const Score> token_scores,
                                         std::vector<float> output_scores,
                                         const OutputOptions& outputs);

// Fills the new block tables and freed ids of `blocks` from the block table of each unit's keys
// (`unit_tables[u]`: the table layers[u].keys is read through, kBlocksShared layers[0].keys'),
// or leaves them empty when a unit's keys are not paged (nullptr). Preconditions: one table
// pointer per unit, each table holding blocks.num_blocks ids.
void FillBlockTables(absl::Span<const BlockTable* const> unit_tables, BlockPlan& blocks);

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_BLOCKS_H_
