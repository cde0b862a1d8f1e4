#include "policy/select.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "policy/blocks.h"

namespace laprox::kernels::policy {
namespace {

// The order of the selection as an unsigned key: a higher finite score has a higher key, and -0
// and +0 (equal scores) have the same one.
uint32_t OrderKey(float score) {
  if (score == 0.f) score = 0.f;
  const uint32_t bits = std::bit_cast<uint32_t>(score);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// Selection state over the flat [L, Hkv, n] index space. A step selects the best k of the
// candidates not yet selected in a range of (layer, head) rows by a radix select on the scores'
// order keys: three histogram passes fix the key of the k-th best, then one pass marks every
// better candidate and, of those tied with it, the first ones in flat index order. That is the
// order RankedBefore sorts by (score descending, flat index ascending), with no candidate pool:
// the extra memory is one histogram, whatever L * Hkv * n.
//
// `stop` is checked once per row of every pass; once it says stop, the passes skip their rows
// (the marks are then meaningless) and stopped() says why.
class Selector {
 public:
  Selector(const RequestShape& shape, const std::vector<float>& scores, const StopSignal* stop)
      : shape_(shape), scores_(scores), stop_(stop), selected_(scores.size(), 0) {}

  // OK unless the stop signal stopped a pass.
  const absl::Status& stopped() const { return stopped_; }

  // The kept marks so far, moved out: the selector is spent afterwards.
  std::vector<uint8_t> TakeSelected() { return std::move(selected_); }

  // Selects the best `k` not-yet-selected candidates of rows [row_begin, row_end), all of them
  // when there are at most k, marking them `mark`. Rows of closed layers (TakeCapped) are
  // skipped.
  void Take(int64_t row_begin, int64_t row_end, int64_t k, uint8_t mark = 1) {
    if (k <= 0 || !stopped_.ok()) return;
    uint32_t prefix = 0, prefix_mask = 0;
    int64_t needed = k;  // among the candidates whose key starts with `prefix`
    int64_t available = 0;
    for (const int shift : {21, 10, 0}) {
      const uint32_t digit_mask = shift == 0 ? 0x3ffu : 0x7ffu;
      std::fill(histogram_.begin(), histogram_.end(), 0);
      ForEachOpen(row_begin, row_end, [&](int64_t, uint32_t key) {
        if ((key & prefix_mask) == prefix) ++histogram_[(key >> shift) & digit_mask];
      });
      if (!stopped_.ok()) return;  // a partial histogram: the digit walk below would overrun
      if (prefix_mask == 0) {
        available = std::accumulate(histogram_.begin(), histogram_.end(), int64_t{0});
        if (available <= k) break;
      }
      uint32_t digit = digit_mask;
      while (histogram_[digit] < needed) needed -= histogram_[digit--];
      prefix |= digit << shift;
      prefix_mask |= digit_mask << shift;
    }
    if (available <= k) {
      ForEachOpen(row_begin, row_end, [&](int64_t i, uint32_t) { selected_[i] = mark; });
      return;
    }
    // `prefix` is the k-th best key: every better candidate and the first `needed` tied ones.
    ForEachOpen(row_begin, row_end, [&](int64_t i, uint32_t key) {
      if (key > prefix || (key == prefix && needed-- > 0)) selected_[i] = mark;
    });
  }

  // The global selection of `k` more candidates under a per-layer cap (max_layer_share,
  // SEMANTICS.md "Selection"): candidates in the selection order, skipping those of a layer that
  // already holds `cap` selected ones. Each round selects the best k of the open layers
  // tentatively; a layer holding more than its room there would reach its cap in the ordered
  // walk too (the walk goes at least as far down the order as the uncapped k), so it takes its
  // best `room` for good and closes, and the round is redone for the rest with k less those.
  // A round where no layer overflows is the walk's result. At most L + 1 rounds.
  void TakeCapped(int64_t k, int64_t cap) {
    const int64_t L = shape_.num_layers, Hkv = shape_.num_kv_heads;
    std::vector<int64_t> room(L);
    closed_.assign(L, 0);
    for (int64_t l = 0; l < L; ++l) {
      room[l] = std::max<int64_t>(0, cap - CountInLayer(l));
      closed_[l] = room[l] == 0;
    }
    constexpr uint8_t kTentative = 2;
    while (k > 0 && stopped_.ok()) {
      Take(0, L * Hkv, k, kTentative);
      if (!stopped_.ok()) break;
      std::vector<int64_t> full;
      for (int64_t l = 0; l < L; ++l) {
        if (!closed_[l] && CountInLayer(l, kTentative) > room[l]) full.push_back(l);
      }
      if (full.empty()) {
        std::replace(selected_.begin(), selected_.end(), kTentative, uint8_t{1});
        break;
      }
      std::replace(selected_.begin(), selected_.end(), kTentative, uint8_t{0});
      for (const int64_t l : full) {
        Take(l * Hkv, (l + 1) * Hkv, room[l]);
        k -= room[l];
        closed_[l] = 1;
      }
    }
    closed_.clear();
  }

  // Each head of `layer` selects its own best k (head 0..Hkv-1 get `per_head` plus one for the
  // first `extra` heads).
  void TakePerHead(int64_t layer, int64_t per_head, int64_t extra) {
    for (int64_t g = 0; g < shape_.num_kv_heads; ++g) {
      const int64_t row = layer * shape_.num_kv_heads + g;
      Take(row, row + 1, per_head + (g < extra ? 1 : 0));
    }
  }

  int64_t CountInLayer(int64_t layer, uint8_t mark = 1) const {
    const auto begin = selected_.begin() + layer * shape_.num_kv_heads * shape_.n;
    return std::count(begin, begin + shape_.num_kv_heads * shape_.n, mark);
  }

  void ClearLayer(int64_t layer) {
    const auto begin = selected_.begin() + layer * shape_.num_kv_heads * shape_.n;
    std::fill(begin, begin + shape_.num_kv_heads * shape_.n, 0);
  }

 private:
  // Calls visit(flat index, order key) for every not-yet-selected candidate of rows
  // [row_begin, row_end), in flat index order.
  template <typename Visit>
  void ForEachOpen(int64_t row_begin, int64_t row_end, Visit visit) {
    for (int64_t row = row_begin; row < row_end; ++row) {
      if (stopped_.ok()) stopped_ = CheckStop(stop_);
      if (!stopped_.ok()) return;
      if (!closed_.empty() && closed_[row / shape_.num_kv_heads]) continue;
      const int64_t begin = row * shape_.n + shape_.sinks;
      const int64_t end =
          row * shape_.n + LayerEntries(shape_, row / shape_.num_kv_heads) - shape_.window;
      for (int64_t i = begin; i < end; ++i) {
        if (!selected_[i]) visit(i, OrderKey(scores_[i]));
      }
    }
  }

  const RequestShape& shape_;
  const std::vector<float>& scores_;
  const StopSignal* stop_;
  absl::Status stopped_;
  std::vector<uint8_t> selected_;
  std::vector<uint8_t> closed_;  // per layer, during TakeCapped only: skipped by ForEachOpen
  std::vector<int64_t> histogram_ = std::vector<int64_t>(2048);
};

}  // namespace

absl::Status NonFiniteScoreError(const RequestShape& shape, uint64_t flat_index, double score,
                                 absl::string_view what) {
  const uint64_t n = static_cast<uint64_t>(shape.n);
  const uint64_t heads = static_cast<uint64_t>(std::max(shape.num_kv_heads, 1));
  const uint64_t row = flat_index / n;
  return absl::InternalError(absl::StrCat(
      "layers[", row / heads, "], KV head ", row % heads, ", position ", flat_index % n, ": the ",
      what, " is ", score,
      ", not finite, although every input was checked (a broken invariant of the backend)"));
}

absl::StatusOr<KeepPlan> SelectKeepPlan(const RequestShape& shape, const PolicySpec& policy,
                                        absl::Span<const float> raw, const OutputOptions& outputs,
                                        const StopSignal* stop) {
  return SelectKeepPlan(shape, policy, std::vector<float>(raw.begin(), raw.end()), outputs, stop);
}

absl::StatusOr<KeepPlan> SelectKeepPlan(const RequestShape& shape, const PolicySpec& policy,
                                        std::vector<float>&& raw, const OutputOptions& outputs,
                                        const StopSignal* stop) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t se = shape.sinks, q = shape.quota;

  // The competing scores replace the raw ones in place; +inf marks forced tokens (sinks,
  // window) in the output, 0 the entries past a decode re-plan's shorter layer.
  std::vector<float> scores = std::move(raw);
  std::vector<double> layer_sums(L, 0.0);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t entries = LayerEntries(shape, l), candidates_end = entries - shape.window;
    const int64_t m = candidates_end - se;
    double sum = 0.0;
    for (int64_t g = 0; g < Hkv; ++g) {
      LAPROX_RETURN_IF_ERROR(CheckStop(stop));
      const float* p = scores.data() + (l * Hkv + g) * n;
      for (int64_t i = se; i < candidates_end; ++i) {
        if (!std::isfinite(p[i])) {
          return NonFiniteScoreError(shape, static_cast<uint64_t>((l * Hkv + g) * n + i), p[i],
                                     "raw score");
        }
        sum += p[i];
      }
    }
    layer_sums[l] = sum;
    const bool uniform = !(sum > 0.0) || !std::isfinite(sum);
    const double uniform_score = m > 0 ? 1.0 / static_cast<double>(Hkv * m) : 0.0;
    for (int64_t g = 0; g < Hkv; ++g) {
      float* p = scores.data() + (l * Hkv + g) * n;
      std::fill(p, p + se, std::numeric_limits<float>::infinity());
      std::fill(p + candidates_end, p + entries, std::numeric_limits<float>::infinity());
      std::fill(p + entries, p + n, 0.f);
      if (policy.allocation == Allocation::kGlobalRaw) continue;
      for (int64_t i = se; i < candidates_end; ++i) {
        p[i] = static_cast<float>(uniform ? uniform_score : p[i] / sum);
      }
    }
  }

  const PlanShape plan_shape = policy.EffectivePlanShape();
  if (IsBlockShape(plan_shape)) {
    const BlockRule rule = {.plan_shape = plan_shape,
                            .forced_begin = se,
                            .forced_end = se + shape.candidates,
                            .model_wide = policy.allocation == Allocation::kGlobalNormalized ||
                                          policy.allocation == Allocation::kGlobalRaw};
    std::vector<float> output_scores = outputs.scores ? scores : std::vector<float>();
    LAPROX_RETURN_IF_ERROR(CheckStop(stop));
    LAPROX_ASSIGN_OR_RETURN(
        KeepPlan plan,
        SelectBlockPlan<float>(shape, rule, scores, std::move(output_scores), outputs));
    plan.layer_sums = std::move(layer_sums);
    return plan;
  }

  Selector selector(shape, scores, stop);
  for (const SelectionStep& step : SelectionSteps(shape, policy)) {
    if (step.kind == SelectionStep::Kind::kHeadUniformRecount) {
      for (int64_t l = 0; l < L; ++l) {
        const int64_t total = selector.CountInLayer(l);
        selector.ClearLayer(l);
        selector.TakePerHead(l, total / Hkv, total % Hkv);
      }
      continue;
    }
    switch (step.scope) {
      case SelectionScope::kHead:
        for (int64_t l = 0; l < L; ++l) selector.TakePerHead(l, step.k, 0);
        break;
      case SelectionScope::kLayer:
        for (int64_t l = 0; l < L; ++l) selector.Take(l * Hkv, (l + 1) * Hkv, step.k);
        break;
      case SelectionScope::kModel:
        if (step.layer_cap.has_value()) {
          selector.TakeCapped(step.k, *step.layer_cap);
        } else {
          selector.Take(0, L * Hkv, step.k);
        }
        break;
    }
  }

  if (!selector.stopped().ok()) return selector.stopped();
  LAPROX_RETURN_IF_ERROR(CheckStop(stop));
  // Kept: forced tokens (sinks, window) and the selected candidates.
  std::vector<uint8_t> kept = selector.TakeSelected();
  for (int64_t lg = 0; lg < L * Hkv; ++lg) {
    const int64_t entries = LayerEntries(shape, lg / Hkv);
    std::fill_n(kept.begin() + lg * n, se, 1);
    std::fill(kept.begin() + lg * n + entries - shape.window, kept.begin() + lg * n + entries, 1);
  }
  KeepPlan plan = BuildKeepPlan(shape, kept, std::move(scores), outputs);
  // K = L * Hkv * q; a decode re-plan whose layers hold fewer candidates selects them all.
  if (shape.layer_n.empty()) plan.selected_total = L * Hkv * q;
  plan.layer_sums = std::move(layer_sums);
  return plan;
}

std::vector<SelectionStep> SelectionSteps(const RequestShape& shape, const PolicySpec& policy) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, q = shape.quota;
  const int64_t reserve = std::min<int64_t>(policy.min_per_head, q);
  std::vector<SelectionStep> steps;
  auto top_k = [&steps](SelectionScope scope, int64_t k, std::optional<int64_t> cap = {}) {
    if (k > 0) steps.push_back({.scope = scope, .k = k, .layer_cap = cap});
  };
  switch (policy.allocation) {
    case Allocation::kGlobalNormalized:
    case Allocation::kGlobalRaw:
      top_k(SelectionScope::kHead, reserve);
      top_k(SelectionScope::kModel, L * Hkv * (q - reserve), policy.LayerSelectionCap(L, Hkv, q));
      break;
    case Allocation::kPerLayer:
      top_k(SelectionScope::kHead, reserve);
      top_k(SelectionScope::kLayer, Hkv * (q - reserve));
      break;
    case Allocation::kUniform:
      top_k(SelectionScope::kHead, q);
      break;
  }
  if (policy.EffectivePlanShape() == PlanShape::kLayerUniform) {
    SelectionStep recount;
    recount.kind = SelectionStep::Kind::kHeadUniformRecount;
    steps.push_back(recount);
  }
  return steps;
}

KeepPlan PlanHeader(const RequestShape& shape) {
  KeepPlan plan;
  plan.num_layers = shape.num_layers;
  plan.num_kv_heads = shape.num_kv_heads;
  plan.n = shape.n;
  plan.window = shape.window;
  plan.sinks = shape.sinks;
  plan.quota = shape.quota;
  plan.tokens_per_head = shape.tokens_per_head;
  return plan;
}

KeepPlan BuildKeepPlan(const RequestShape& shape, absl::Span<const uint8_t> kept,
                       std::vector<float> scores, const OutputOptions& outputs) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t candidates_begin = shape.sinks;
  KeepPlan plan = PlanHeader(shape);
  plan.counts.resize(L * Hkv);
  plan.offsets.resize(L * Hkv + 1);
  plan.offsets[0] = 0;
  const int64_t mask_bytes = (n + 7) / 8;
  if (outputs.bitmask) plan.bitmask.assign(L * Hkv * mask_bytes, 0);
  for (int64_t lg = 0; lg < L * Hkv; ++lg) {
    const uint8_t* row = kept.data() + lg * n;
    const int64_t candidates_end = LayerEntries(shape, lg / Hkv) - shape.window;
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (row[i] == 0) continue;
      ++count;
      if (i >= candidates_begin && i < candidates_end) ++plan.selected_total;
      if (outputs.positions) plan.positions.push_back(static_cast<int32_t>(i));
      if (outputs.bitmask) plan.bitmask[lg * mask_bytes + i / 8] |= uint8_t{1} << (i % 8);
    }
    plan.counts[lg] = static_cast<int32_t>(count);
    plan.offsets[lg + 1] = plan.offsets[lg] + count;
  }
  if (outputs.scores) plan.scores = std::move(scores);
  return plan;
}

}  // namespace laprox::kernels::policy
