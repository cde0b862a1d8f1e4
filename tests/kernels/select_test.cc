// The token selection (policy/select.cc) against a sort. Scores drawn from a few values, -0
// beside +0, tie often: the kept candidates of every allocation must still be the best k of each
// step by (score descending, flat index ascending), the order RankedBefore defines, with the
// per-head reserve (min_per_head) taken first.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "policy/budget.h"
#include "policy/select.h"

namespace laprox::kernels {
namespace {

constexpr int64_t kLayers = 3, kHeads = 2, kN = 300;

// Kept marks [L, Hkv, n] by sorting: `scores` are the plan's competing scores.
std::vector<uint8_t> SortedSelection(const RequestShape& shape, const PolicySpec& policy,
                                     const std::vector<float>& scores) {
  std::vector<uint8_t> kept(scores.size(), 0);
  // The best k not-yet-kept candidates of rows [row_begin, row_end).
  auto take = [&](int64_t row_begin, int64_t row_end, int64_t k) {
    std::vector<policy::ScoredToken> open;
    for (int64_t row = row_begin; row < row_end; ++row) {
      for (int64_t i = shape.sinks; i < shape.sinks + shape.candidates; ++i) {
        const int64_t flat = row * shape.n + i;
        if (!kept[flat]) open.push_back({scores[flat], static_cast<uint32_t>(flat)});
      }
    }
    std::sort(open.begin(), open.end(), policy::RankedBefore<float>);
    for (int64_t j = 0; j < std::min<int64_t>(k, open.size()); ++j) kept[open[j].index] = 1;
  };
  const int64_t L = shape.num_layers, Hkv = shape.num_kv_heads, q = shape.quota;
  const int64_t reserve = std::min<int64_t>(policy.min_per_head, q);
  for (int64_t row = 0; row < L * Hkv; ++row) {
    take(row, row + 1, policy.allocation == Allocation::kUniform ? q : reserve);
  }
  if (policy.allocation == Allocation::kPerLayer) {
    for (int64_t l = 0; l < L; ++l) take(l * Hkv, (l + 1) * Hkv, Hkv * (q - reserve));
  } else if (policy.allocation != Allocation::kUniform) {
    take(0, L * Hkv, L * Hkv * (q - reserve));
  }
  for (int64_t row = 0; row < L * Hkv; ++row) {
    for (int64_t i = 0; i < shape.n; ++i) {
      if (i < shape.sinks || i >= shape.sinks + shape.candidates) kept[row * shape.n + i] = 1;
    }
  }
  return kept;
}

TEST(SelectionTest, TiedScoresKeepTheBestByScoreThenIndex) {
  const float values[] = {0.f, -0.f, 1e-30f, 0.25f, 0.5f, 0.5f, 1.f, 3.f};
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(0, 7);
  int cases = 0;
  for (const Allocation allocation : {Allocation::kGlobalNormalized, Allocation::kGlobalRaw,
                                      Allocation::kPerLayer, Allocation::kUniform}) {
    for (const int64_t min_per_head : {0, 5}) {
      for (const int64_t budget : {20, 77, 200, 299}) {
        PolicySpec policy;
        policy.window = 8;
        policy.sinks = 4;
        policy.allocation = allocation;
        policy.min_per_head = min_per_head;
        policy.budget = Budget::TokensPerHead(budget);
        RequestShape shape;
        shape.n = kN;
        shape.num_layers = kLayers;
        shape.num_kv_heads = kHeads;
        shape.group_size = 1;
        shape.head_dim = 4;
        shape.window_rows = 8;
        policy::DeriveBudget(policy, shape);
        std::vector<float> raw(kLayers * kHeads * kN);
        for (float& x : raw) x = values[pick(rng)];
        OutputOptions outputs;
        outputs.scores = true;
        outputs.bitmask = true;
        const absl::StatusOr<KeepPlan> plan = policy::SelectKeepPlan(shape, policy, raw, outputs);
        ASSERT_TRUE(plan.ok()) << plan.status();
        const std::vector<uint8_t> expected = SortedSelection(shape, policy, plan->scores);
        const int64_t mask_bytes = (kN + 7) / 8;
        for (int64_t row = 0; row < kLayers * kHeads; ++row) {
          for (int64_t i = 0; i < kN; ++i) {
            const bool kept = (plan->bitmask[row * mask_bytes + i / 8] >> (i % 8)) & 1;
            ASSERT_EQ(kept, expected[row * kN + i] != 0)
                << "allocation " << static_cast<int>(allocation) << ", min_per_head "
                << min_per_head << ", budget " << budget << ": (layer, head) row " << row
                << ", position " << i << ", score " << plan->scores[row * kN + i];
          }
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 32);
}

}  // namespace
}  // namespace laprox::kernels
