#include "policy/select.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "policy/blocks.h"

namespace laprox::kernels::policy {
namespace {

// Selection state over the flat [L, Hkv, n] index space.
class Selector {
 public:
  Selector(const RequestShape& shape, const std::vector<float>& scores)
      : shape_(shape), scores_(scores), selected_(scores.size(), 0) {}

  const std::vector<uint8_t>& selected() const { return selected_; }

  // Appends the not-yet-selected candidates of (layer, head) to `out`.
  void Gather(int64_t layer, int64_t head, std::vector<ScoredToken>& out) const {
    const int64_t base = (layer * shape_.num_kv_heads + head) * shape_.n;
    const int64_t begin = base + shape_.sinks, end = begin + shape_.candidates;
    for (int64_t i = begin; i < end; ++i) {
      if (!selected_[i]) out.push_back({scores_[i], static_cast<uint32_t>(i)});
    }
  }

  // Selects the best `k` of `pool` (cleared afterwards).
  void Take(std::vector<ScoredToken>& pool, int64_t k) {
    k = std::min<int64_t>(k, static_cast<int64_t>(pool.size()));
    PartitionBest(absl::MakeSpan(pool), k);
    for (int64_t j = 0; j < k; ++j) selected_[pool[j].index] = 1;
    pool.clear();
  }

  // Each head of `layer` selects its own best k (head 0..Hkv-1 get `per_head` plus one for the
  // first `extra` heads).
  void TakePerHead(int64_t layer, int64_t per_head, int64_t extra, std::vector<ScoredToken>& pool) {
    for (int64_t g = 0; g < shape_.num_kv_heads; ++g) {
      Gather(layer, g, pool);
      Take(pool, per_head + (g < extra ? 1 : 0));
    }
  }

  int64_t CountInLayer(int64_t layer) const {
    const auto begin = selected_.begin() + layer * shape_.num_kv_heads * shape_.n;
    return std::count(begin, begin + shape_.num_kv_heads * shape_.n, 1);
  }

  void ClearLayer(int64_t layer) {
    const auto begin = selected_.begin() + layer * shape_.num_kv_heads * shape_.n;
    std::fill(begin, begin + shape_.num_kv_heads * shape_.n, 0);
  }

 private:
  const RequestShape& shape_;
  const std::vector<float>& scores_;
  std::vector<uint8_t> selected_;
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
                                        absl::Span<const float> raw, const OutputOptions& outputs) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t se = shape.sinks, m = shape.candidates, q = shape.quota;
  const int64_t candidates_end = se + m;

  // Competing scores: +inf marks forced tokens (sinks, window) in the output.
  std::vector<float> scores(raw.size(), std::numeric_limits<float>::infinity());
  std::vector<double> layer_sums(L, 0.0);
  for (int64_t l = 0; l < L; ++l) {
    double sum = 0.0;
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* p = raw.data() + (l * Hkv + g) * n;
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
      const int64_t base = (l * Hkv + g) * n;
      for (int64_t i = se; i < candidates_end; ++i) {
        double s;
        if (policy.allocation == Allocation::kGlobalRaw) {
          s = raw[base + i];
        } else {
          s = uniform ? uniform_score : raw[base + i] / sum;
        }
        scores[base + i] = static_cast<float>(s);
      }
    }
  }

  const PlanShape plan_shape = policy.EffectivePlanShape();
  if (IsBlockShape(plan_shape)) {
    const BlockRule rule = {.plan_shape = plan_shape,
                            .forced_begin = se,
                            .forced_end = candidates_end,
                            .model_wide = policy.allocation == Allocation::kGlobalNormalized ||
                                          policy.allocation == Allocation::kGlobalRaw};
    std::vector<float> output_scores = outputs.scores ? scores : std::vector<float>();
    LAPROX_ASSIGN_OR_RETURN(
        KeepPlan plan,
        SelectBlockPlan<float>(shape, rule, scores, std::move(output_scores), outputs));
    plan.layer_sums = std::move(layer_sums);
    return plan;
  }

  Selector selector(shape, scores);
  std::vector<ScoredToken> pool;
  const int64_t reserve = std::min<int64_t>(policy.min_per_head, q);
  switch (policy.allocation) {
    case Allocation::kGlobalNormalized:
    case Allocation::kGlobalRaw:
      if (reserve > 0) {
        for (int64_t l = 0; l < L; ++l) selector.TakePerHead(l, reserve, 0, pool);
      }
      pool.reserve(L * Hkv * m);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t g = 0; g < Hkv; ++g) selector.Gather(l, g, pool);
      }
      selector.Take(pool, L * Hkv * (q - reserve));
      break;
    case Allocation::kPerLayer:
      for (int64_t l = 0; l < L; ++l) {
        if (reserve > 0) selector.TakePerHead(l, reserve, 0, pool);
        for (int64_t g = 0; g < Hkv; ++g) selector.Gather(l, g, pool);
        selector.Take(pool, Hkv * (q - reserve));
      }
      break;
    case Allocation::kUniform:
      for (int64_t l = 0; l < L; ++l) selector.TakePerHead(l, q, 0, pool);
      break;
  }
  if (plan_shape == PlanShape::kLayerUniform) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t total = selector.CountInLayer(l);
      selector.ClearLayer(l);
      selector.TakePerHead(l, total / Hkv, total % Hkv, pool);
    }
  }

  // Kept: forced tokens (sinks, window) and the selected candidates.
  std::vector<uint8_t> kept = selector.selected();
  for (int64_t lg = 0; lg < L * Hkv; ++lg) {
    std::fill_n(kept.begin() + lg * n, se, 1);
    std::fill(kept.begin() + lg * n + candidates_end, kept.begin() + (lg + 1) * n, 1);
  }
  KeepPlan plan = BuildKeepPlan(shape, kept, std::move(scores), outputs);
  plan.selected_total = L * Hkv * q;
  plan.layer_sums = std::move(layer_sums);
  return plan;
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
  const int64_t candidates_begin = shape.sinks, candidates_end = n - shape.window;
  KeepPlan plan = PlanHeader(shape);
  plan.counts.resize(L * Hkv);
  plan.offsets.resize(L * Hkv + 1);
  plan.offsets[0] = 0;
  const int64_t mask_bytes = (n + 7) / 8;
  if (outputs.bitmask) plan.bitmask.assign(L * Hkv * mask_bytes, 0);
  for (int64_t lg = 0; lg < L * Hkv; ++lg) {
    const uint8_t* row = kept.data() + lg * n;
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
