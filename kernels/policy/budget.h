// Budget arithmetic shared by every backend: effective window and sinks, candidates per head and
// the per-head quota q (tests/reference/SEMANTICS.md, "Window, sinks, candidates" and "Budget").
#ifndef LAPROX_KERNELS_POLICY_BUDGET_H_
#define LAPROX_KERNELS_POLICY_BUDGET_H_

#include <cstdint>

#include "laprox/kernels/backend.h"
#include "laprox/kernels/policy.h"

namespace laprox::kernels::policy {

// Kept tokens per head the budget asks for (window and sinks included), before clamping:
// B itself, or int((1.0 - cr) * n) in IEEE double, truncated.
int64_t BudgetTokensPerHead(const Budget& budget, int64_t n);

// Fills window, sinks, candidates and quota of `shape` from n, window_rows and the policy.
// Preconditions: policy validated, shape.n >= 1, 1 <= policy.window <= shape.window_rows.
void DeriveBudget(const PolicySpec& policy, PlanShape& shape);

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_BUDGET_H_
