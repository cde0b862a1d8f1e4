// SelectKeepPlan: per-layer normalisation, budget allocation and the deterministic selection
// that turn raw LaProx scores into a KeepPlan (tests/reference/SEMANTICS.md, "Selection").
// Backend-independent host code; the CPU backend calls it directly.
#ifndef LAPROX_KERNELS_POLICY_SELECT_H_
#define LAPROX_KERNELS_POLICY_SELECT_H_

#include <algorithm>
#include <cstdint>
#include <optional>
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

// The steps of the selection (SEMANTICS.md "Selection"), in the order every backend takes them:
// the one description that SelectKeepPlan (the CPU, select.cc) and the CUDA backend's
// DeviceSelector (cuda/select.cc) both walk. A step is either a top-k: each segment of `scope`
// (one (layer, KV head) row, one layer's rows, or every row of the model) selects the best `k`
// of its candidates not selected yet, by RankedBefore's order, all of them when it has at most k;
// or the head_uniform_layers recount: each layer's selected total T_l is cleared and re-selected
// as T_l / Hkv per head, plus one for heads 0 .. T_l % Hkv - 1.
enum class SelectionScope { kHead, kLayer, kModel };
struct SelectionStep {
  enum class Kind { kTopK, kHeadUniformRecount };
  Kind kind = Kind::kTopK;
  SelectionScope scope = SelectionScope::kHead;  // kTopK only
  int64_t k = 0;                                 // kTopK only: per segment, > 0
  // kTopK at kModel scope only: max_layer_share's cap on a layer's selected candidates
  // (PolicySpec::LayerSelectionCap), reservations included; the model-wide top-k then becomes
  // the capped walk.
  std::optional<int64_t> layer_cap;
};
// The steps for `policy` over `shape` (after DeriveBudget): the per-head reservation
// (min(min_per_head, q)) first, then the competition of the allocation, then the recount when
// the plan shape is LAYER_UNIFORM. PER_LAYER's "reserve, then compete" per layer is written as
// all reservations, then every layer's competition: the same plan, since layers do not interact.
// Top-k steps with k = 0 are left out (they select nothing).
std::vector<SelectionStep> SelectionSteps(const RequestShape& shape, const PolicySpec& policy);

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
