// SelectKeepPlan: per-layer normalisation, budget allocation and the deterministic selection
// that turn raw LaProx scores into a KeepPlan (tests/reference/SEMANTICS.md, "Selection").
// Backend-independent host code; the CPU backend calls it directly.
#ifndef LAPROX_KERNELS_POLICY_SELECT_H_
#define LAPROX_KERNELS_POLICY_SELECT_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"

namespace laprox::kernels::policy {

// A scored candidate: `index` is the flat (layer, head, position) index (l * Hkv + g) * n + i.
struct ScoredToken {
  float score;
  uint32_t index;
};

// The selection order: higher score first, then lower flat index (layer, head, position).
inline bool SelectedBefore(const ScoredToken& a, const ScoredToken& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// Reorders `tokens` so that its first `k` elements are the best `k` by SelectedBefore (in no
// particular order among themselves). Exact threshold select, O(size) expected.
void PartitionBest(absl::Span<ScoredToken> tokens, int64_t k);

// Builds the keep-plan from raw scores `raw` ([L, Hkv, n], read only at candidate positions).
// Layer sums are accumulated in double in a fixed order, so the plan does not depend on how the
// raw scores were computed in parallel.
KeepPlan SelectKeepPlan(const PlanShape& shape, const PolicySpec& policy,
                        absl::Span<const float> raw, const OutputOptions& outputs);

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_SELECT_H_
