#include "policy/budget.h"

#include <algorithm>

namespace laprox::kernels::policy {

int64_t BudgetTokensPerHead(const Budget& budget, int64_t n) {
  if (budget.kind == Budget::Kind::kTokensPerHead) return budget.tokens_per_head;
  // kvpress semantics: the product is formed in double and truncated toward zero.
  return static_cast<int64_t>((1.0 - budget.compression_ratio) * static_cast<double>(n));
}

double BudgetTokensExact(const Budget& budget, int64_t n) {
  if (budget.kind == Budget::Kind::kTokensPerHead) {
    return static_cast<double>(std::min(budget.tokens_per_head, n));
  }
  return (1.0 - budget.compression_ratio) * static_cast<double>(n);
}

bool KvpressFloorsBudget(const PolicySpec& policy) {
  return policy.numeric_mode == NumericMode::kKvpressCompat &&
         policy.budget.kind == Budget::Kind::kCompressionRatio &&
         policy.kind != PolicyKind::kLaprox && policy.kind != PolicyKind::kCake;
}

void DeriveBudget(const PolicySpec& policy, RequestShape& shape) {
  const bool streaming = policy.kind == PolicyKind::kStreamingLlm;
  const bool sinks = streaming || policy.kind == PolicyKind::kLaprox;
  // A decode re-plan's window and sinks fit its shortest layer; candidates are the longest's.
  const int64_t shortest = shape.layer_n.empty()
                               ? shape.n
                               : *std::min_element(shape.layer_n.begin(), shape.layer_n.end());
  shape.window = streaming ? 0 : static_cast<int32_t>(std::min<int64_t>(policy.window, shortest));
  shape.sinks =
      sinks ? static_cast<int32_t>(std::min<int64_t>(policy.sinks, shortest - shape.window)) : 0;
  shape.candidates = shape.n - shape.window - shape.sinks;
  const int64_t forced = int64_t{shape.window} + shape.sinks;
  shape.tokens_per_head = BudgetTokensPerHead(policy.budget, shape.n);
  int64_t budget = shape.tokens_per_head;
  if (KvpressFloorsBudget(policy)) budget = std::max<int64_t>(budget, 1);
  shape.quota = std::clamp<int64_t>(budget - forced, 0, shape.candidates);
  shape.kept_per_head = std::min(budget, shape.n);
}

}  // namespace laprox::kernels::policy
