// Budget arithmetic shared by every backend: effective window and sinks, candidates per head and
// the per-head quota q (tests/reference/SEMANTICS.md, "Window, sinks, candidates" and "Budget").
#ifndef LAPROX_KERNELS_POLICY_BUDGET_H_
#define LAPROX_KERNELS_POLICY_BUDGET_H_

#include <cstdint>

#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"

namespace laprox::kernels::policy {

// Kept tokens per head the budget asks for (window and sinks included), before clamping:
// B itself, or int((1.0 - cr) * n) in IEEE double, truncated.
int64_t BudgetTokensPerHead(const Budget& budget, int64_t n);

// The baselines' budget before truncation: min(B, n), or (1.0 - cr) * n in IEEE double
// (kvpress derives PyramidKV's and CriticalKV's budgets from this product).
double BudgetTokensExact(const Budget& budget, int64_t n);

// True when kvpress's "keep at least one" floors apply (KVPRESS_COMPAT, a compression-ratio
// budget, a baseline other than CAKE): n_kept = max(1, int((1 - cr) * n)) (compute_n_kept),
// CriticalKV's stage-1 count max(1, int((1 - cr) * n * first_stage_ratio)) and PyramidKV's
// fallback max(1, round((1 - cr) * n)).
bool KvpressFloorsBudget(const PolicySpec& policy);

// Fills window, sinks, candidates, quota and kept_per_head of `shape` from n, window_rows and
// the policy (STREAMING_LLM: no window; other baselines: no sinks; kept_per_head floored at 1
// where KvpressFloorsBudget).
// Preconditions: policy validated, shape.n >= 1, 1 <= policy.window <= shape.window_rows
// unless the kind is STREAMING_LLM.
void DeriveBudget(const PolicySpec& policy, RequestShape& shape);

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_BUDGET_H_
