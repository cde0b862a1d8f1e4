#include "policy/baselines.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "common/half.h"
#include "common/status_macros.h"
#include "policy/blocks.h"
#include "policy/budget.h"
#include "policy/magnitude.h"
#include "policy/select.h"

namespace laprox::kernels::policy {
namespace {

// Ranking scores and kept marks of the whole plan, [L, Hkv, n], with the selection helpers the
// policies share. Scores are double: a safeguarded value times u may exceed the fp32 range.
// Indices in a selection pool are positions (inside one head) or g * n + position (across the
// heads of one layer), so PartitionBest's index order is the tie order.
class Plan {
 public:
  Plan(const RequestShape& shape, const StopSignal* stop)
      : shape_(shape),
        stop_(stop),
        n_(shape.n),
        heads_(shape.num_kv_heads),
        scores_(int64_t{shape.num_layers} * shape.num_kv_heads * shape.n, 0.0),
        kept_(scores_.size(), 0) {}

  double* scores(int64_t layer, int64_t g) { return scores_.data() + Offset(layer, g); }
  uint8_t* kept(int64_t layer, int64_t g) { return kept_.data() + Offset(layer, g); }

  // Marks in `mark` the best k of positions [begin, end) by `scores`, skipping positions whose
  // `skip` entry is set (skip may be null).
  // A NaN score never enters the pool (it has no place in the strict order PartitionBest needs);
  // the first one is remembered for status().
  // Once the stop signal says stop, nothing more is marked (stopped() says why).
  void MarkBest(const double* scores, int64_t begin, int64_t end, int64_t k, const uint8_t* skip,
                uint8_t* mark) {
    if (stopped_.ok()) stopped_ = CheckStop(stop_);
    if (!stopped_.ok()) return;
    pool_.clear();
    for (int64_t i = begin; i < end; ++i) {
      if (skip != nullptr && skip[i] != 0) continue;
      if (std::isnan(scores[i])) {
        NoteNaN(&scores[i]);
        continue;
      }
      pool_.push_back({scores[i], static_cast<uint32_t>(i)});
    }
    Mark(k, mark);
  }

  // OK unless a ranking score was NaN.
  const absl::Status& status() const { return status_; }
  // OK unless the stop signal stopped the marking (CANCELLED, DEADLINE_EXCEEDED).
  const absl::Status& stopped() const { return stopped_; }

  // Marks the best k of all positions of the layer's heads (ties to the lower head, then
  // position) in the layer's part of `mark` ([Hkv, n]).
  void MarkBestInLayer(int64_t layer, int64_t k, uint8_t* mark) {
    MarkBest(scores(layer, 0), 0, heads_ * n_, k, nullptr, mark);
  }

  // The output scores (fp32; values beyond its range become +-inf) and the kept marks.
  std::vector<float> OutputScores() const { return {scores_.begin(), scores_.end()}; }
  const std::vector<uint8_t>& all_kept() const { return kept_; }
  absl::Span<const double> all_scores() const { return scores_; }

 private:
  int64_t Offset(int64_t layer, int64_t g) const { return (layer * heads_ + g) * n_; }

  void NoteNaN(const double* score) {
    if (!status_.ok()) return;
    const auto flat = static_cast<uint64_t>(score - scores_.data());
    status_ = NonFiniteScoreError(shape_, flat, *score, "ranking score");
  }

  void Mark(int64_t k, uint8_t* mark) {
    k = std::clamp<int64_t>(k, 0, static_cast<int64_t>(pool_.size()));
    PartitionBest(absl::MakeSpan(pool_), k);
    for (int64_t j = 0; j < k; ++j) mark[pool_[j].index] = 1;
  }

  const RequestShape& shape_;
  const StopSignal* stop_;
  int64_t n_, heads_;
  std::vector<double> scores_;
  std::vector<uint8_t> kept_;
  std::vector<Ranked<double>> pool_;
  absl::Status status_;
  absl::Status stopped_;
};

// kvpress's round(): half to even (the default floating-point rounding mode).
int64_t RoundHalfEven(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

// int(x) for a non-negative double, as Python truncates it.
int64_t Truncate(double x) { return static_cast<int64_t>(x); }

// KVPRESS_COMPAT: x rounded to the layer's model dtype (ties to even) and back; kF32 keeps x.
float RoundTo(DType dtype, float x) {
  if (dtype == DType::kBF16) return Bf16ToFloat(FloatToBf16(x));
  if (dtype == DType::kF16) return F16ToFloat(FloatToF16(x));
  return x;
}

// StreamingLLM's scores (kvpress StreamingLLMPress.score): 1 except at [sinks, sinks + n -
// n_kept), from the unfloored int((1 - cr) * n); the best n_kept per head are then the sinks and
// the most recent positions.
void StreamingLlmScores(const RequestShape& shape, const PolicySpec& policy, Plan& plan) {
  const int64_t n = shape.n, sinks = shape.sinks;
  const int64_t pruned = n - std::min(BudgetTokensPerHead(policy.budget, n), n);
  for (int64_t lg = 0; lg < int64_t{shape.num_layers} * shape.num_kv_heads; ++lg) {
    double* s = plan.scores(lg / shape.num_kv_heads, lg % shape.num_kv_heads);
    for (int64_t i = 0; i < n; ++i) s[i] = i < sinks || i >= sinks + pruned ? 1.0 : 0.0;
  }
}

// SnapKV scores of every head of every layer: the prefix score, and the window positions at the
// layer's maximum prefix score (over all its heads) + 1 so that they rank first.
void SnapKvScores(const RequestShape& shape, const BaselineStatistics& st, Plan& plan) {
  const int64_t Hkv = shape.num_kv_heads, n = shape.n, prefix = n - shape.window;
  for (int64_t l = 0; l < shape.num_layers; ++l) {
    float top = 0.f;  // prefix scores are >= 0; an empty prefix leaves the sentinel at 1
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* p = st.prefix_scores.data() + (l * Hkv + g) * n;
      for (int64_t i = 0; i < prefix; ++i) top = std::max(top, p[i]);
    }
    // kvpress pads with scores.max().item() + 1 into a model-dtype tensor.
    const double sentinel = st.compat_dtype.empty() ? static_cast<double>(top) + 1.0
                                                    : RoundTo(st.compat_dtype[l], top + 1.f);
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* p = st.prefix_scores.data() + (l * Hkv + g) * n;
      double* s = plan.scores(l, g);
      std::copy(p, p + prefix, s);
      std::fill(s + prefix, s + n, sentinel);
    }
  }
}

// Ada-KV's safeguard: each head's best n_safe scores become the layer's safeguard value.
void Safeguard(const RequestShape& shape, const PolicySpec& policy, const BaselineStatistics& st,
               int64_t layer, Plan& plan, std::vector<uint8_t>& mark) {
  const int64_t n = shape.n;
  const int64_t safe =
      Truncate(static_cast<double>(shape.kept_per_head) * policy.baseline.alpha_safeguard);
  for (int64_t g = 0; g < shape.num_kv_heads; ++g) {
    std::fill(mark.begin(), mark.end(), 0);
    double* s = plan.scores(layer, g);
    plan.MarkBest(s, 0, n, safe, nullptr, mark.data());
    for (int64_t i = 0; i < n; ++i) {
      if (mark[i] != 0) s[i] = st.safeguard[layer];
    }
  }
}

// CriticalKV inside one head with `budget` kept tokens: the best `first` by the current score
// are kept (and scored with the safeguard value), the remaining budget goes to the best of the
// others by (score + epsilon) * u.
void CriticalStages(const RequestShape& shape, const PolicySpec& policy,
                    const BaselineStatistics& st, int64_t layer, int64_t g, int64_t budget,
                    int64_t first, Plan& plan, std::vector<uint8_t>& stage1) {
  const int64_t n = shape.n;
  first = std::min(first, budget);
  std::fill(stage1.begin(), stage1.end(), 0);
  double* s = plan.scores(layer, g);
  plan.MarkBest(s, 0, n, first, nullptr, stage1.data());
  const float* u = st.value_norms.data() + (layer * shape.num_kv_heads + g) * n;
  if (st.compat_dtype.empty()) {
    for (int64_t i = 0; i < n; ++i) {
      s[i] = stage1[i] != 0 ? st.safeguard[layer] : (s[i] + policy.baseline.epsilon) * u[i];
    }
  } else {
    // kvpress: (scores + epsilon) * norm on model-dtype tensors, two roundings; a safeguarded
    // score times a norm above ~1 overflows to +inf there.
    const DType T = st.compat_dtype[layer];
    const float epsilon = SaturatedFloat(policy.baseline.epsilon);
    for (int64_t i = 0; i < n; ++i) {
      if (stage1[i] != 0) {
        s[i] = st.safeguard[layer];
        continue;
      }
      // A norm that rounds to T's +inf times a zero shifted score is 0, not NaN.
      const float shifted = RoundTo(T, static_cast<float>(s[i]) + epsilon);
      s[i] = shifted == 0.f || u[i] == 0.f ? 0.f : RoundTo(T, shifted * u[i]);
    }
  }
  uint8_t* kept = plan.kept(layer, g);
  std::copy(stage1.begin(), stage1.end(), kept);
  plan.MarkBest(s, 0, n, budget - first, stage1.data(), kept);
}

// CAKE: layer preferences from the entropy and variance sums (returned as layer sums), prefix
// budgets, and each head's best prefix tokens by the eviction score plus the window.
std::vector<double> Cake(const RequestShape& shape, const PolicySpec& policy,
                         const BaselineStatistics& st, Plan& plan) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t we = shape.window, prefix = n - we, kept = shape.kept_per_head;
  std::vector<double> preferences(L), log_preferences(L);
  const double tau1 = policy.baseline.cake_tau1, tau2 = policy.baseline.cake_tau2;
  for (int64_t l = 0; l < L; ++l) {
    double entropy = 0.0, variance = 0.0;
    for (int64_t g = 0; g < Hkv; ++g) {
      entropy += st.entropy[l * Hkv + g];
      variance += st.variance[l * Hkv + g];
    }
    entropy = std::max(entropy, 0.0);
    variance = std::max(variance, 0.0);
    // Each power is in [0, +inf]; a zero factor makes P_l zero even when the other overflowed
    // (inf * 0 would be NaN).
    const double h = std::pow(entropy, 1.0 / tau1);
    const double v = std::pow(variance, 1.0 / tau2);
    preferences[l] = h == 0.0 || v == 0.0 ? 0.0 : h * v;
    log_preferences[l] = entropy == 0.0 || variance == 0.0
                             ? -std::numeric_limits<double>::infinity()
                             : std::log(entropy) / tau1 + std::log(variance) / tau2;
  }
  // No compression when the window and n_kept more tokens cover the sequence (then n > w, so
  // we = w below).
  const bool keep_all = n <= kept + we;
  const std::vector<int64_t> budgets =
      keep_all ? std::vector<int64_t>(L, prefix)
               : CakeLayerBudgets(preferences, std::max<int64_t>(0, (kept - we) * L), prefix,
                                  log_preferences);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* p = st.prefix_scores.data() + (l * Hkv + g) * n;
      double* s = plan.scores(l, g);
      std::copy(p, p + prefix, s);
      std::fill(s + prefix, s + n, std::numeric_limits<double>::infinity());
      uint8_t* k = plan.kept(l, g);
      plan.MarkBest(s, 0, prefix, budgets[l], nullptr, k);
      std::fill(k + prefix, k + n, 1);
    }
  }
  // The plan reports P_l; one that overflowed is reported as the largest finite double.
  for (double& p : preferences) p = std::min(p, std::numeric_limits<double>::max());
  return preferences;
}

}  // namespace

std::vector<int64_t> PyramidLayerCounts(int64_t n, int64_t window, double budget, double beta,
                                        int64_t layers, int64_t fallback_min) {
  // kvpress PyramidKVPress.get_layer_budget, term by term.
  const double w = static_cast<double>(window), len = static_cast<double>(n);
  const double capacity = w + budget;
  double min_num = (capacity - w) / beta;
  double max_num = (capacity - w) * 2 - min_num;
  if (max_num >= len - w) {
    max_num = len - w;
    min_num = (capacity - w) * 2 - max_num;
  }
  // One layer has no slope (kvpress divides by L - 1): it falls back like an invalid pyramid.
  const bool pyramid = len >= max_num && max_num >= min_num && min_num >= w && layers > 1;
  std::vector<int64_t> counts(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t count =
        pyramid ? RoundHalfEven(max_num - static_cast<double>(l) * (max_num - min_num) /
                                              static_cast<double>(layers - 1))
                : std::max(fallback_min, RoundHalfEven(budget));
    counts[l] = std::clamp<int64_t>(count, 0, n);
  }
  return counts;
}

std::vector<int64_t> CakeLayerBudgets(absl::Span<const double> preferences, int64_t total,
                                      int64_t cap, absl::Span<const double> log_preferences) {
  const int64_t L = static_cast<int64_t>(preferences.size());
  double sum = 0.0;
  for (double p : preferences) sum += p;
  std::vector<double> share(L, 1.0 / static_cast<double>(L));
  if (sum > 0.0 && std::isfinite(sum)) {
    for (int64_t l = 0; l < L; ++l) share[l] = preferences[l] / sum;
  } else if (static_cast<int64_t>(log_preferences.size()) == L) {
    // P_l or their sum overflowed, or every P_l underflowed: the same shares from log P_l.
    double top = -std::numeric_limits<double>::infinity();
    for (double x : log_preferences) top = std::max(top, x);
    if (std::isfinite(top)) {
      double total_weight = 0.0;
      for (int64_t l = 0; l < L; ++l) {
        share[l] = std::exp(log_preferences[l] - top);
        total_weight += share[l];
      }
      for (double& x : share) x /= total_weight;
    }
  }
  std::vector<int64_t> b(L);
  for (int64_t l = 0; l < L; ++l) {
    b[l] = static_cast<int64_t>(share[l] * static_cast<double>(total));  // truncated toward 0
  }
  // Adds `amount` evenly over the layers below the cap (the remainder one each to the lowest of
  // them), clamps at the cap and spreads what the clamp cut off again, until nothing is left
  // or every layer is at the cap.
  auto spread = [&](int64_t amount) {
    while (amount > 0) {
      int64_t open = 0;
      for (int64_t x : b) open += x < cap ? 1 : 0;
      if (open == 0) return;
      const int64_t each = amount / open;
      int64_t remainder = amount % open;
      amount = 0;
      for (int64_t& x : b) {
        if (x >= cap) continue;
        x += each + (remainder-- > 0 ? 1 : 0);
        amount += std::max<int64_t>(x - cap, 0);
        x = std::min(x, cap);
      }
    }
  };
  int64_t excess = 0;
  for (int64_t& x : b) {
    excess += std::max<int64_t>(x - cap, 0);
    x = std::min(x, cap);
  }
  spread(excess);
  int64_t current = 0;
  for (int64_t x : b) current += x;
  spread(total - current);
  // Only rounding pathologies leave more than the total: take it from the highest layers.
  int64_t over = -total;
  for (int64_t x : b) over += x;
  for (int64_t l = L - 1; l >= 0 && over > 0; --l) {
    const int64_t take = std::min(over, b[l]);
    b[l] -= take;
    over -= take;
  }
  return b;
}

absl::StatusOr<KeepPlan> SelectBaselinePlan(const RequestShape& shape, const PolicySpec& policy,
                                            const BaselineStatistics& st,
                                            const OutputOptions& outputs, const StopSignal* stop) {
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, n = shape.n;
  const int64_t kept = shape.kept_per_head;
  Plan plan(shape, stop);
  const PlanShape plan_shape = policy.EffectivePlanShape();
  if (IsBlockShape(plan_shape)) {
    // The kinds Validate allows with a block shape: whole blocks by summed SnapKV scores (ADAKV's
    // per-head budgets have nothing to act on when heads share blocks), or the most recent.
    BlockRule rule = {.plan_shape = plan_shape};
    if (policy.kind == PolicyKind::kStreamingLlm) {
      StreamingLlmScores(shape, policy, plan);
      rule.forced_begin = shape.sinks;
      rule.forced_end = n;
      rule.by_recency = true;
    } else {
      SnapKvScores(shape, st, plan);
      rule.forced_end = n - shape.window;
    }
    LAPROX_RETURN_IF_ERROR(CheckStop(stop));
    LAPROX_ASSIGN_OR_RETURN(
        KeepPlan result, SelectBlockPlan<double>(
                             shape, rule, plan.all_scores(),
                             outputs.scores ? plan.OutputScores() : std::vector<float>(), outputs));
    result.layer_sums.assign(L, 0.0);
    return result;
  }
  std::vector<double> layer_sums(L, 0.0);
  std::vector<uint8_t> head_mark(n), layer_mark;
  // kvpress's PyramidKV and CriticalKV budgets come from (1 - cr) * n before truncation.
  const double exact_budget = BudgetTokensExact(policy.budget, n);
  const double first_stage = policy.baseline.first_stage_ratio;
  const bool floors = KvpressFloorsBudget(policy);

  switch (policy.kind) {
    case PolicyKind::kLaprox:  // not a baseline; callers never pass it
    case PolicyKind::kStreamingLlm:
      StreamingLlmScores(shape, policy, plan);
      for (int64_t lg = 0; lg < L * Hkv; ++lg) {
        plan.MarkBest(plan.scores(lg / Hkv, lg % Hkv), 0, n, kept, nullptr,
                      plan.kept(lg / Hkv, lg % Hkv));
      }
      break;
    case PolicyKind::kSnapKv:
    case PolicyKind::kPyramidKv: {
      SnapKvScores(shape, st, plan);
      std::vector<int64_t> counts(L, kept);
      if (policy.kind == PolicyKind::kPyramidKv && kept < n) {
        counts = PyramidLayerCounts(n, policy.window, exact_budget, policy.baseline.pyramid_beta, L,
                                    floors ? 1 : 0);
      }
      for (int64_t lg = 0; lg < L * Hkv; ++lg) {
        const int64_t l = lg / Hkv, g = lg % Hkv;
        plan.MarkBest(plan.scores(l, g), 0, n, counts[l], nullptr, plan.kept(l, g));
      }
      break;
    }
    case PolicyKind::kAdaKv:
      SnapKvScores(shape, st, plan);
      for (int64_t l = 0; l < L; ++l) {
        Safeguard(shape, policy, st, l, plan, head_mark);
        plan.MarkBestInLayer(l, Hkv * kept, plan.kept(l, 0));
      }
      break;
    case PolicyKind::kCriticalKv: {
      SnapKvScores(shape, st, plan);
      // kvpress: int((1 - cr) * n * first_stage_ratio), left to right, before truncating.
      int64_t first = Truncate(exact_budget * first_stage);
      if (floors) first = std::max<int64_t>(first, 1);
      first = std::min(first, kept);
      for (int64_t lg = 0; lg < L * Hkv; ++lg) {
        CriticalStages(shape, policy, st, lg / Hkv, lg % Hkv, kept, first, plan, head_mark);
      }
      break;
    }
    case PolicyKind::kCriticalAdaKv:
      SnapKvScores(shape, st, plan);
      layer_mark.resize(Hkv * n);
      for (int64_t l = 0; l < L; ++l) {
        Safeguard(shape, policy, st, l, plan, head_mark);
        // Head budgets: how many of the layer's best Hkv * n_kept fall in each head.
        std::fill(layer_mark.begin(), layer_mark.end(), 0);
        plan.MarkBestInLayer(l, Hkv * kept, layer_mark.data());
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t budget =
              std::count(layer_mark.begin() + g * n, layer_mark.begin() + (g + 1) * n, 1);
          const int64_t first = Truncate(static_cast<double>(budget) * first_stage);
          CriticalStages(shape, policy, st, l, g, budget, first, plan, head_mark);
        }
      }
      break;
    case PolicyKind::kCake:
      layer_sums = Cake(shape, policy, st, plan);
      break;
  }
  if (!plan.stopped().ok()) return plan.stopped();
  if (!plan.status().ok()) return plan.status();
  LAPROX_RETURN_IF_ERROR(CheckStop(stop));
  KeepPlan result = BuildKeepPlan(shape, plan.all_kept(), plan.OutputScores(), outputs);
  result.layer_sums = std::move(layer_sums);
  return result;
}

}  // namespace laprox::kernels::policy
