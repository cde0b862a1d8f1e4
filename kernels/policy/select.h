// SelectKeepPlan: per-layer normalisation, budget allocation and the deterministic selection
// that turn raw LaProx scores into a KeepPlan (tests/reference/SEMANTICS.md, "Selection").
// Backend-independent host code; the CPU backend calls it directly.
#ifndef LAPROX_KERNELS_POLICY_SELECT_H_
#define LAPROX_KERNELS_POLICY_SELECT_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"
#include "laprox/kernels/stop.h"

namespace laprox::kernels::policy {

// A scored candidate: `index` is the flat (layer, head, position) index (l * Hkv + g) * n + i
// (the baselines use positions inside a head or a layer). Score is float, or double where
// scores may exceed the fp32 range (the baselines' safeguarded values times u).
template <typename Score>
struct Ranked {
  Score score;
  uint32_t index;
};
using ScoredToken = Ranked<float>;

// The selection order: higher score first, then lower flat index (layer, head, position).
template <typename Score>
bool RankedBefore(const Ranked<Score>& a, const Ranked<Score>& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}
inline bool SelectedBefore(const ScoredToken& a, const ScoredToken& b) {
  return RankedBefore(a, b);
}

// Reorders `tokens` so that its first `k` elements are the best `k` by RankedBefore (in no
// particular order among themselves). Exact threshold select, O(size) expected.
template <typename Score>
void PartitionBest(absl::Span<Ranked<Score>> tokens, int64_t k) {
  if (k <= 0 || k >= static_cast<int64_t>(tokens.size())) return;
  std::nth_element(tokens.begin(), tokens.begin() + k, tokens.end(), RankedBefore<Score>);
}

// A KeepPlan with only the fields `shape` fixes: L, Hkv, n, window, sinks, quota.
KeepPlan PlanHeader(const RequestShape& shape);

// The KeepPlan of a kept mask `kept` ([L, Hkv, n], nonzero = kept) with the output scores
// `scores` ([L, Hkv, n], moved into the plan when requested): counts, offsets, positions and
// bitmask as `outputs` asks, window / sinks / quota from `shape`, selected_total = the kept
// positions among the candidates [sinks, n - window). layer_sums are left empty.
KeepPlan BuildKeepPlan(const RequestShape& shape, absl::Span<const uint8_t> kept,
                       std::vector<float> scores, const OutputOptions& outputs);

// Builds the keep-plan from raw scores `raw` ([L, Hkv, n], read only at candidate positions).
// Layer sums are accumulated in double in a fixed order, so the plan does not depend on how the
// raw scores were computed in parallel. A backend rejects inputs that could make a raw score
// non-finite (policy/magnitude.h), so a NaN or infinite raw score is a broken invariant: INTERNAL
// naming the first one in (layer, KV head, position) order, and nothing is selected (a NaN would
// break the strict order the selection sorts by). `stop` (may be null) is checked once per
// (layer, head) row of every pass: once it says stop, the call returns its CANCELLED or
// DEADLINE_EXCEEDED.
absl::StatusOr<KeepPlan> SelectKeepPlan(const RequestShape& shape, const PolicySpec& policy,
                                        absl::Span<const float> raw, const OutputOptions& outputs,
                                        const StopSignal* stop = nullptr);
// The same, normalising `raw` in place: no second [L, Hkv, n] buffer. The selection marks one
// byte per entry and needs no candidate pool (select.cc, Selector).
absl::StatusOr<KeepPlan> SelectKeepPlan(const RequestShape& shape, const PolicySpec& policy,
                                        std::vector<float>&& raw, const OutputOptions& outputs,
                                        const StopSignal* stop = nullptr);

// The INTERNAL status for a non-finite score a backend produced: "layers[l], KV head g, position
// i: the <what> is <score>, not finite: ..." (the device selection reports the same words).
absl::Status NonFiniteScoreError(const RequestShape& shape, uint64_t flat_index, double score,
                                 absl::string_view what);

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_SELECT_H_
