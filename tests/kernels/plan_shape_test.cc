// Plan shapes (tests/reference/SEMANTICS.md, "Plan shapes"): LAYER_UNIFORM is
// head_uniform_layers; block-shaped plans keep whole blocks chosen by summed per-token scores,
// hand-checked on synthetic raw scores; their new block tables and freed ids are consistent with
// the engine's pool (attention over the compacted table equals attention with the evicted blocks
// masked); and every invalid combination is refused before anything is read.
//
// The float64 oracle comparison (tests/reference/compare_test.py, cases "shape-...") checks the
// same selection on random inputs; these tests pin the rules a reader can check by hand.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "laprox/kernels/registry.h"
#include "paged_pool.h"
#include "policy/budget.h"
#include "policy/select.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::BuildPool;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::Layout;
using testing::Pool;
using testing::ShuffledIds;
using testing::TinyCase;

// A request shape of L = 2 layers, Hkv = 2 heads, n = 20 in blocks of 4, window 4: blocks 0-3
// are candidates, block 4 (the window) is forced.
RequestShape SmallShape(const PolicySpec& policy) {
  RequestShape shape;
  shape.n = 20;
  shape.num_layers = 2;
  shape.num_kv_heads = 2;
  shape.group_size = 1;
  shape.head_dim = 4;
  shape.window_rows = 4;
  policy::DeriveBudget(policy, shape);
  shape.block_size = 4;
  shape.num_blocks = 5;
  return shape;
}

// Raw scores where layer 0 puts all its weight on block 1 (s = 1/8 there: block sum 1) and
// layer 1 weighs block 2 three times the rest (s = 3/48 there, 1/48 elsewhere: block 2 sums to
// 1/2, blocks 0, 1 and 3 to 1/6 each).
std::vector<float> SmallRaw() {
  std::vector<float> raw(2 * 2 * 20, 0.f);
  for (int g = 0; g < 2; ++g) {
    for (int i = 4; i < 8; ++i) raw[(0 * 2 + g) * 20 + i] = 1.f;
    for (int i = 0; i < 16; ++i) raw[(1 * 2 + g) * 20 + i] = i / 4 == 2 ? 3.f : 1.f;
  }
  return raw;
}

KeepPlan SelectSmall(PlanShape plan_shape, Allocation allocation, int64_t budget) {
  PolicySpec policy;
  policy.window = 4;
  policy.plan_shape = plan_shape;
  policy.allocation = allocation;
  policy.budget = Budget::TokensPerHead(budget);
  const RequestShape shape = SmallShape(policy);
  OutputOptions outputs;
  outputs.scores = true;
  auto plan = policy::SelectKeepPlan(shape, policy, SmallRaw(), outputs);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *std::move(plan);
}

TEST(BlockSelectionTest, SharedBlocksWinBySummedNormalisedScores) {
  // B = 12: floor(12 / 4) = 3 blocks, the window's and the best 2 of 4 candidates. Block sums
  // over both layers: 1/6, 1 + 1/6, 1/2, 1/6.
  const KeepPlan plan = SelectSmall(PlanShape::kBlocksShared, Allocation::kGlobalNormalized, 12);
  ASSERT_TRUE(plan.blocks.has_value());
  EXPECT_EQ(plan.blocks->units, 1);
  EXPECT_EQ(plan.blocks->num_blocks, 5);
  EXPECT_THAT(plan.blocks->kept_blocks(0), ElementsAre(1, 2, 4));
  const std::vector<double>& s = plan.blocks->scores;
  ASSERT_EQ(s.size(), 5u);
  EXPECT_NEAR(s[0], 1.0 / 6, 1e-7);
  EXPECT_NEAR(s[1], 1.0 + 1.0 / 6, 1e-7);
  EXPECT_NEAR(s[2], 0.5, 1e-7);
  EXPECT_NEAR(s[3], 1.0 / 6, 1e-7);
  EXPECT_EQ(s[4], std::numeric_limits<double>::infinity());
  // Every (layer, head) keeps positions 4-11 and the window 16-19.
  for (int lg = 0; lg < 4; ++lg) {
    EXPECT_EQ(plan.counts[lg], 12);
    EXPECT_THAT(plan.kept(lg / 2, lg % 2), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19));
  }
  EXPECT_EQ(plan.selected_total, 4 * 8);
  EXPECT_FALSE(plan.blocks->paged());  // no table: no physical ids
}

TEST(BlockSelectionTest, PerLayerBlocksCompeteModelWide) {
  // 2 layers x 2 candidate blocks = 4 slots over (layer, block) pairs: (0, 1) = 1,
  // (1, 2) = 1/2, then the ties at 1/6 go to the lower (layer, block): (1, 0) and (1, 1).
  // Layer 0 keeps one candidate block, layer 1 three: the budget follows the scores.
  const KeepPlan plan = SelectSmall(PlanShape::kBlocksPerLayer, Allocation::kGlobalNormalized, 12);
  ASSERT_TRUE(plan.blocks.has_value());
  EXPECT_EQ(plan.blocks->units, 2);
  EXPECT_THAT(plan.blocks->kept_blocks(0), ElementsAre(1, 4));
  EXPECT_THAT(plan.blocks->kept_blocks(1), ElementsAre(0, 1, 2, 4));
  EXPECT_EQ(plan.count(0, 0), 8);
  EXPECT_EQ(plan.count(0, 1), 8);
  EXPECT_EQ(plan.count(1, 0), 16);
}

TEST(BlockSelectionTest, PerLayerAllocationGivesEachLayerItsQuota) {
  // Layer 0: block 1, then the lowest of the zero-score blocks; layer 1: block 2, then block 0.
  const KeepPlan plan = SelectSmall(PlanShape::kBlocksPerLayer, Allocation::kPerLayer, 12);
  EXPECT_THAT(plan.blocks->kept_blocks(0), ElementsAre(0, 1, 4));
  EXPECT_THAT(plan.blocks->kept_blocks(1), ElementsAre(0, 2, 4));
}

TEST(BlockSelectionTest, BudgetEdges) {
  // floor(7 / 4) = 1 block: the window's alone.
  EXPECT_THAT(SelectSmall(PlanShape::kBlocksShared, Allocation::kGlobalNormalized, 7)
                  .blocks->kept_blocks(0),
              ElementsAre(4));
  // Below the window: still the window's block (forced blocks are always kept).
  EXPECT_THAT(SelectSmall(PlanShape::kBlocksShared, Allocation::kGlobalNormalized, 2)
                  .blocks->kept_blocks(0),
              ElementsAre(4));
  // B = 19 < n: floor(19 / 4) = 4 blocks; B = 20 = n keeps everything.
  EXPECT_THAT(SelectSmall(PlanShape::kBlocksShared, Allocation::kGlobalNormalized, 19)
                  .blocks->kept_blocks(0),
              ElementsAre(0, 1, 2, 4));
  EXPECT_THAT(SelectSmall(PlanShape::kBlocksShared, Allocation::kGlobalNormalized, 20)
                  .blocks->kept_blocks(0),
              ElementsAre(0, 1, 2, 3, 4));
}

// A partial last block is forced (it holds the window) and counts as a whole block: n = 18 in
// blocks of 4 has 5 blocks, the last of 2 positions; B = 12 keeps 3 blocks, 10 positions.
TEST(BlockSelectionTest, PartialBlockCountsAsAWholeBlock) {
  PolicySpec policy;
  policy.window = 2;
  policy.plan_shape = PlanShape::kBlocksShared;
  policy.budget = Budget::TokensPerHead(12);
  RequestShape shape = SmallShape(policy);
  shape.n = 18;
  policy::DeriveBudget(policy, shape);
  std::vector<float> raw(2 * 2 * 18, 1.f);
  for (int lg = 0; lg < 4; ++lg) raw[lg * 18 + 9] = 5.f;  // block 2 wins, then block 0 (ties)
  auto plan = policy::SelectKeepPlan(shape, policy, raw, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->blocks->kept_blocks(0), ElementsAre(0, 2, 4));
  EXPECT_EQ(plan->count(0, 0), 4 + 4 + 2);
}

// The same request computed by the CPU backend, its keys and values read from engine pools.
class PagedBlockPlanTest : public ::testing::Test {
 protected:
  static constexpr int L = 2, H = 4, Hkv = 2, d = 8, D = 16, kWindow = 8, kBlock = 16;
  static constexpr int64_t kN = 300;  // 19 blocks, the last one partial
  static constexpr int64_t kBlocks = (kN + kBlock - 1) / kBlock, kPhysical = kBlocks + 5;

  PagedBlockPlanTest() : c_(L, H, Hkv, d, D, kN, kWindow) {
    c_.Randomize(29);
    c_.policy.window = kWindow;
    c_.policy.budget = Budget::TokensPerHead(100);  // 6 blocks of 16
    for (int l = 0; l < L; ++l) {
      tables_.push_back(*BlockTable::Create(ShuffledIds(kBlocks, kPhysical, 5 + l), kBlock));
    }
    for (int l = 0; l < L; ++l) {
      pools_.push_back(BuildPool(c_.keys[l], c_.values[l], Hkv, kN, d, tables_[l], kPhysical,
                                 Layout::kFlashAttention, DType::kF32));
    }
  }

  KeepPlanRequest Request(PlanShape plan_shape) const {
    KeepPlanRequest request = c_.Request();
    request.policy.plan_shape = plan_shape;
    for (int l = 0; l < L; ++l) {
      request.layers[l].keys =
          TensorView::Paged(pools_[l].data(), DType::kF32, {Hkv, kN, d}, pools_[l].keys);
      request.layers[l].values =
          TensorView::Paged(pools_[l].values_data(), DType::kF32, {Hkv, kN, d}, pools_[l].values);
    }
    return request;
  }

  absl::StatusOr<KeepPlan> Compute(const KeepPlanRequest& request) {
    auto model = backend_->PrepareModel(c_.geometry, c_.OProjViews());
    if (!model.ok()) return model.status();
    return backend_->ComputeKeepPlan(**model, request);
  }

  // Softmax attention of query `q` (d floats) over the positions `rows` of head g's keys and
  // values in layer l, reading each row through `ids` (logical block -> physical id) and the
  // pool, as an engine's attention kernel reads its block table. Output: d floats.
  std::vector<double> Attend(int l, int g, const std::vector<float>& q,
                             const std::vector<int32_t>& ids,
                             const std::vector<int64_t>& rows) const {
    const Pool& pool = pools_[l];
    const float* base = static_cast<const float*>(pool.data());
    const float* values = static_cast<const float*>(pool.values_data());
    std::vector<double> logits;
    for (int64_t r : rows) {
      const int64_t at = ids[r / kBlock] * pool.keys.block_stride +
                         (r % kBlock) * pool.keys.slot_stride + g * pool.keys.head_stride;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double{q[c]} * base[at + c];
      logits.push_back(dot);
    }
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double& x : logits) sum += (x = std::exp(x - top));
    std::vector<double> out(d, 0.0);
    for (size_t j = 0; j < rows.size(); ++j) {
      const int64_t r = rows[j];
      const int64_t at = ids[r / kBlock] * pool.keys.block_stride +
                         (r % kBlock) * pool.keys.slot_stride + g * pool.keys.head_stride;
      for (int c = 0; c < d; ++c) out[c] += logits[j] / sum * values[at + c];
    }
    return out;
  }

  TinyCase c_;
  std::vector<BlockTable> tables_;
  std::vector<Pool> pools_;
  std::unique_ptr<Backend> backend_ = *CreateBackend("cpu");
};

// The engine applies a block plan by compacting each layer's table to new_block_table (the
// sequence is then num_kept_blocks * block_size long, the partial block last) and freeing the
// freed ids. Attention through the compacted table must equal attention over the whole table
// with the evicted blocks masked, and the freed ids must be exactly the table's other ids.
TEST_F(PagedBlockPlanTest, NewTableGivesTheAttentionOfTheMaskedCache) {
  for (PlanShape plan_shape : {PlanShape::kBlocksShared, PlanShape::kBlocksPerLayer}) {
    SCOPED_TRACE(PlanShapeName(plan_shape));
    auto plan = Compute(Request(plan_shape));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(plan->blocks.has_value());
    const BlockPlan& blocks = *plan->blocks;
    ASSERT_TRUE(blocks.paged());
    EXPECT_EQ(blocks.block_size, kBlock);
    EXPECT_EQ(blocks.num_blocks, kBlocks);
    EXPECT_EQ(blocks.units, plan_shape == PlanShape::kBlocksShared ? 1 : L);
    // 100 tokens per head = 6 blocks per unit, the partial window block among them (per layer
    // the model-wide competition may give one layer more than another).
    EXPECT_EQ(blocks.kept.size(), 6u * blocks.units);
    std::vector<float> q(d);
    for (int c = 0; c < d; ++c) q[c] = 0.3f * static_cast<float>(c % 3) - 0.2f;
    for (int l = 0; l < L; ++l) {
      const int unit = blocks.units == 1 ? 0 : l;
      const auto kept = blocks.kept_blocks(unit);
      const auto new_table = blocks.new_block_table(unit);
      const auto freed = blocks.freed_ids(unit);
      EXPECT_EQ(kept.back(), kBlocks - 1);
      // kBlocksShared reports layer 0's table (vLLM: one table for every layer).
      const std::vector<int32_t>& ids = tables_[unit].ids();
      std::multiset<int32_t> all(new_table.begin(), new_table.end());
      all.insert(freed.begin(), freed.end());
      EXPECT_EQ(all, std::multiset<int32_t>(ids.begin(), ids.end()));
      for (size_t j = 0; j < kept.size(); ++j) EXPECT_EQ(new_table[j], ids[kept[j]]);
      if (unit != l) continue;  // only the table's own layer can be compacted with it
      // Compacted: rows 0..len of the new table; the kept tokens in order.
      std::vector<int32_t> compact(new_table.begin(), new_table.end());
      std::vector<int64_t> compact_rows, masked_rows;
      int64_t row = 0;
      for (int32_t b : kept) {
        const int64_t len = std::min<int64_t>(kBlock, kN - int64_t{b} * kBlock);
        for (int64_t i = 0; i < len; ++i) {
          compact_rows.push_back(row++);
          masked_rows.push_back(int64_t{b} * kBlock + i);
        }
        row += kBlock - len;  // a partial block is last, so nothing follows it
      }
      for (int g = 0; g < Hkv; ++g) {
        EXPECT_EQ(plan->count(l, g), static_cast<int32_t>(masked_rows.size()));
        const auto positions = plan->kept(l, g);
        EXPECT_EQ(std::vector<int64_t>(positions.begin(), positions.end()), masked_rows);
        const std::vector<double> through_table = Attend(l, g, q, compact, compact_rows);
        const std::vector<double> masked = Attend(l, g, q, ids, masked_rows);
        for (int c = 0; c < d; ++c) EXPECT_NEAR(through_table[c], masked[c], 1e-12) << c;
      }
    }
  }
}

// BLOCKS_SHARED takes its block size from layers[0].keys' table, or from the policy.
TEST_F(PagedBlockPlanTest, BlockSizeFromTheTableOrThePolicy) {
  KeepPlanRequest request = Request(PlanShape::kBlocksShared);
  auto from_table = Compute(request);
  ASSERT_TRUE(from_table.ok()) << from_table.status();
  request.policy.block_size = kBlock;
  auto from_policy = Compute(request);
  ASSERT_TRUE(from_policy.ok()) << from_policy.status();
  EXPECT_EQ(from_table->blocks->kept, from_policy->blocks->kept);
  request.policy.block_size = 32;
  auto mismatch = Compute(request);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatch.status().message(),
              HasSubstr("layers[0].keys is read through a block table of block size 16, but the "
                        "plan's blocks have 32 (policy.block_size)"));
}

// Contiguous keys take a block plan too, with the policy's block size and no physical ids; the
// plan is the paged one's.
TEST_F(PagedBlockPlanTest, ContiguousKeysNeedThePolicyBlockSize) {
  KeepPlanRequest request = c_.Request();
  request.policy.plan_shape = PlanShape::kBlocksShared;
  auto missing = Compute(request);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(),
              HasSubstr("policy.plan_shape = BLOCKS_SHARED needs a block size: set "
                        "policy.block_size, or page layers[0].keys through a block table"));
  request.policy.block_size = kBlock;
  auto contiguous = Compute(request);
  ASSERT_TRUE(contiguous.ok()) << contiguous.status();
  EXPECT_FALSE(contiguous->blocks->paged());
  auto paged = Compute(Request(PlanShape::kBlocksShared));
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ(contiguous->blocks->kept, paged->blocks->kept);
  EXPECT_EQ(contiguous->positions, paged->positions);
}

TEST_F(PagedBlockPlanTest, LayerUniformIsHeadUniformLayers) {
  KeepPlanRequest request = c_.Request();
  request.policy.head_uniform_layers = true;
  auto old_spelling = Compute(request);
  request.policy.head_uniform_layers = false;
  request.policy.plan_shape = PlanShape::kLayerUniform;
  auto new_spelling = Compute(request);
  request.policy.plan_shape = PlanShape::kRagged;
  auto ragged = Compute(request);
  ASSERT_TRUE(old_spelling.ok() && new_spelling.ok() && ragged.ok());
  EXPECT_EQ(old_spelling->positions, new_spelling->positions);
  EXPECT_NE(ragged->counts, new_spelling->counts);  // the recount changes this case
  EXPECT_FALSE(new_spelling->blocks.has_value());
}

// At a block shape the heads share every block: ADAKV's per-head budgets have nothing to act on
// and its block plan is SNAPKV's. STREAMING_LLM keeps its sinks' block and the most recent ones.
TEST_F(PagedBlockPlanTest, BaselinesAtBlockShapes) {
  KeepPlanRequest request = Request(PlanShape::kBlocksShared);
  request.policy = PolicySpec::ForKind(PolicyKind::kSnapKv);
  request.policy.window = kWindow;
  request.policy.budget = Budget::TokensPerHead(100);
  request.policy.plan_shape = PlanShape::kBlocksShared;
  auto snapkv = Compute(request);
  request.policy.kind = PolicyKind::kAdaKv;
  auto adakv = Compute(request);
  ASSERT_TRUE(snapkv.ok() && adakv.ok()) << snapkv.status() << adakv.status();
  EXPECT_EQ(snapkv->blocks->kept, adakv->blocks->kept);
  EXPECT_EQ(snapkv->positions, adakv->positions);

  request.policy = PolicySpec::ForKind(PolicyKind::kStreamingLlm);
  request.policy.budget = Budget::TokensPerHead(100);
  request.policy.plan_shape = PlanShape::kBlocksPerLayer;
  auto streaming = Compute(request);
  ASSERT_TRUE(streaming.ok()) << streaming.status();
  for (int u = 0; u < L; ++u) {
    EXPECT_THAT(streaming->blocks->kept_blocks(u), ElementsAre(0, 14, 15, 16, 17, 18));
  }
}

TEST_F(PagedBlockPlanTest, RefusesShapesThePolicyDoesNotDefine) {
  struct Bad {
    PolicyKind kind;
    PlanShape plan_shape;
    bool head_uniform_layers;
    int32_t block_size;
    const char* message;
  };
  for (const Bad& bad : {
           Bad{PolicyKind::kLaprox, PlanShape::kBlocksShared, true, 0,
               "policy.head_uniform_layers = true asks for LAYER_UNIFORM plans, but "
               "policy.plan_shape = BLOCKS_SHARED"},
           Bad{PolicyKind::kCake, PlanShape::kBlocksPerLayer, false, 0,
               "policy.plan_shape = BLOCKS_PER_LAYER is not defined for policy.kind = CAKE"},
           Bad{PolicyKind::kCriticalKv, PlanShape::kBlocksShared, false, 0,
               "is not defined for policy.kind = CRITICALKV"},
           Bad{PolicyKind::kAdaKv, PlanShape::kLayerUniform, false, 0,
               "policy.plan_shape = LAYER_UNIFORM is not defined for policy.kind = ADAKV"},
           Bad{PolicyKind::kLaprox, PlanShape::kRagged, false, 16,
               "policy.block_size = 16 is set, but policy.plan_shape = RAGGED is not a block "
               "shape"},
           Bad{PolicyKind::kLaprox, PlanShape::kBlocksShared, false, 65537,
               "policy.block_size = 65537 is outside [1, 65536]"},
           Bad{PolicyKind::kLaprox, PlanShape::kBlocksShared, false, -1,
               "policy.block_size = -1 is outside [1, 65536]"},
       }) {
    KeepPlanRequest request = Request(PlanShape::kRagged);
    request.policy = PolicySpec::ForKind(bad.kind);
    request.policy.window = kWindow;
    request.policy.plan_shape = bad.plan_shape;
    request.policy.head_uniform_layers = bad.head_uniform_layers;
    request.policy.block_size = bad.block_size;
    auto plan = Compute(request);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_THAT(plan.status().message(), HasSubstr(bad.message));
  }
}

}  // namespace
}  // namespace laprox::kernels
