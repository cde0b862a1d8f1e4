#include "policy/budget.h"

#include <algorithm>

namespace laprox::kernels::policy {

int64_t BudgetTokensPerHead(const Budget& budget, int64_t n) {
  if (budget.kind == Budget::Kind::kTokensPerHead) return budget.tokens_per_head;
  // kvpress semantics: the product is formed in double and truncated toward zero.
  return static_cast<int64_t>((1.0 - budget.compression_ratio) * static_cast<double>(n));
}

void DeriveBudget(const PolicySpec& policy, PlanShape& shape) {
  shape.window = static_cast<int32_t>(std::min<int64_t>(policy.window, shape.n));
  const int64_t before_window = shape.n - shape.window;
  shape.sinks = static_cast<int32_t>(std::min<int64_t>(policy.sinks, before_window));
  shape.candidates = before_window - shape.sinks;
  const int64_t forced = int64_t{shape.window} + shape.sinks;
  shape.quota = std::clamp<int64_t>(BudgetTokensPerHead(policy.budget, shape.n) - forced, 0,
                                    shape.candidates);
}

}  // namespace laprox::kernels::policy
