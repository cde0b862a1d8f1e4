// SelectBaselinePlan: budgets and selection of the baseline policies (docs/design.md §3, NVIDIA
// kvpress semantics; tests/reference/laprox_ref.py documents the same text): StreamingLLM,
// SnapKV, PyramidKV, Ada-KV, CriticalKV, CriticalAdaKV and CAKE, from per-token statistics that
// a backend computed. Backend-independent host code; the CPU backend calls it directly.
//
// Common rules (tests/reference/SEMANTICS.md, "Baseline policies"). n_kept = min(B, n) tokens
// per KV head with B the budget in tokens per head (int((1 - cr) * n) for a compression ratio,
// at least 1 in KVPRESS_COMPAT but for CAKE, as kvpress's compute_n_kept); n <= B keeps
// everything. Inside a head ties go to the lower position; across the heads of a
// layer (ADAKV, CRITICAL_ADAKV) to the lower (head, position); forced tokens (Ada-KV's
// safeguard, CriticalKV's first stage) come first. The plan's scores are the ranking scores the
// policy used, sentinels included, in fp32 (beyond its range: +inf); CAKE's window is +inf.
// layer_sums are CAKE's layer preferences P_l, and 0 for the other baselines.
#ifndef LAPROX_KERNELS_POLICY_BASELINES_H_
#define LAPROX_KERNELS_POLICY_BASELINES_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "laprox/kernels/keep_plan.h"
#include "laprox/kernels/policy.h"
#include "laprox/kernels/request_shape.h"
#include "laprox/kernels/stop.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::policy {

// What a backend computed for a baseline request, per (layer, KV head) g of the layer l.
struct BaselineStatistics {
  // [L, Hkv, n]: the policy's pooled group score at the prefix positions [0, n - we): SnapKV's
  // mean window attention (every kind but CAKE and STREAMING_LLM) or CAKE's mean + gamma *
  // variance. Other entries are ignored; unused for STREAMING_LLM.
  absl::Span<const float> prefix_scores;
  // [L, Hkv, n]: u_i = mean over the group's query heads h of ||v_i W_O^h||_1 (CRITICALKV and
  // CRITICAL_ADAKV; empty otherwise).
  absl::Span<const float> value_norms;
  // [L, Hkv]: CAKE's per-group parts of the layer entropy H_l and variance V_l (empty otherwise).
  absl::Span<const double> entropy;
  absl::Span<const double> variance;
  // [L]: the value safeguarded and stage-1 tokens are raised to (the score dtype's maximum).
  absl::Span<const float> safeguard;
  // [L] in KVPRESS_COMPAT (empty in EXACT): the model dtype T of the layer (kF32: no rounding).
  // The SnapKV kinds then round, like kvpress in T, the window sentinel r(M + 1) and
  // CriticalKV's stage-2 score r(r(s + epsilon) * u), each computed in fp32.
  absl::Span<const DType> compat_dtype;
};

// The plan of a baseline policy. Preconditions: shape from Backend::ComputeKeepPlan's checks for
// `policy`, policy.kind != LAPROX, statistics sized as above. Ranking scores may be +inf (the
// sentinels above, products beyond fp64 or a 16-bit dtype); a NaN ranking score would break the
// strict order of the selection and cannot come from checked inputs, so it is never selected and
// the result is INTERNAL naming its (layer, KV head, position). `stop` (may be null) is checked
// before each head's or layer's selection: its CANCELLED / DEADLINE_EXCEEDED ends the call.
absl::StatusOr<KeepPlan> SelectBaselinePlan(const RequestShape& shape, const PolicySpec& policy,
                                            const BaselineStatistics& statistics,
                                            const OutputOptions& outputs,
                                            const StopSignal* stop = nullptr);

// PYRAMIDKV's kept tokens (window included) of each of `layers` layers, for n tokens, the
// policy window `window` (not clamped to n), budget `budget` = min(B, n) or (1 - cr) * n before
// truncation and steepness `beta`, in kvpress arithmetic: cap = w + budget, min = (cap - w) /
// beta, max = 2 (cap - w) - min; if max >= n - w then max = n - w, min = 2 (cap - w) - max.
// Layer l keeps round(max - l (max - min) / (L - 1)) if n >= max >= min >= w and L > 1, else
// max(fallback_min, round(budget)); round half to even, clamped to [0, n]. kvpress floors the
// fallback at 1 (fallback_min 1 for a compression ratio in KVPRESS_COMPAT, else 0).
std::vector<int64_t> PyramidLayerCounts(int64_t n, int64_t window, double budget, double beta,
                                        int64_t layers, int64_t fallback_min);

// CAKE's prefix budgets (window excluded) from the layer preferences P_l and the total T >= 0:
// each layer int(P_l / sum P * T). When the sum is 0 or not finite (P_l overflowed or all
// underflowed), the shares are exp(log P_l - max) / sum exp(log P_j - max) from
// `log_preferences` (-inf for P_l = 0); without them, or with every log P_l = -inf, the shares
// are equal.
// Budgets above `cap` (= n - w) are cut to it and the excess is spread evenly over the layers
// below the cap, the remainder one each to the lowest of them, repeated while a spread
// overflows; then the truncation deficit T - sum is spread the same way. The sum is T unless
// every layer is at the cap.
std::vector<int64_t> CakeLayerBudgets(absl::Span<const double> preferences, int64_t total,
                                      int64_t cap, absl::Span<const double> log_preferences = {});

}  // namespace laprox::kernels::policy

#endif  // LAPROX_KERNELS_POLICY_BASELINES_H_
