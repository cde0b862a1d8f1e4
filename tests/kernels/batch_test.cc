// Backend::ComputeKeepPlans: a batch of sequences of one model gives each sequence the plan it
// gets alone (whatever the mix of lengths, policies, shapes and paged inputs), and a bad sequence
// fails the whole call naming the lowest bad index; concurrent callers get the same plans.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "laprox/kernels/registry.h"
#include "paged_pool.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::BuildPool;
using ::testing::HasSubstr;
using testing::Layout;
using testing::Pool;
using testing::ShuffledIds;
using testing::TinyCase;

constexpr int L = 3, H = 4, Hkv = 2, d = 8, D = 16, kRows = 16;

// One sequence's owned tensors and its request.
struct Sequence {
  TinyCase c;
  std::vector<BlockTable> tables;
  std::vector<Pool> pools;
  KeepPlanRequest request;

  Sequence(int64_t n, uint32_t seed, PolicySpec policy, bool paged) : c(L, H, Hkv, d, D, n, kRows) {
    c.Randomize(seed);
    c.policy = policy;
    request = c.Request();
    if (!paged) return;
    const int64_t bs = 16, blocks = (n + bs - 1) / bs;
    tables.push_back(*BlockTable::Create(ShuffledIds(blocks, blocks + 2, seed), bs));
    for (int l = 0; l < L; ++l) {
      pools.push_back(BuildPool(c.keys[l], c.values[l], Hkv, n, d, tables[0], blocks + 2,
                                Layout::kFlashAttention, DType::kF32));
    }
    for (int l = 0; l < L; ++l) {
      request.layers[l].keys =
          TensorView::Paged(pools[l].data(), DType::kF32, {Hkv, n, d}, pools[l].keys);
      request.layers[l].values =
          TensorView::Paged(pools[l].values_data(), DType::kF32, {Hkv, n, d}, pools[l].values);
    }
  }
};

PolicySpec Policy(PolicyKind kind, int64_t budget, PlanShape plan_shape = PlanShape::kRagged) {
  PolicySpec policy = PolicySpec::ForKind(kind);
  policy.window = 8;
  policy.budget = Budget::TokensPerHead(budget);
  policy.plan_shape = plan_shape;
  return policy;
}

class BatchTest : public ::testing::TestWithParam<int> {
 protected:
  BatchTest() : backend_(*CreateBackend("cpu", {.threads = GetParam()})) {
    TinyCase shape(L, H, Hkv, d, D, 1, kRows);
    shape.Randomize(1);
    model_ = *backend_->PrepareModel(shape.geometry, shape.OProjViews());
  }

  // The sequences' o_proj differ from the model's: only the model's are used, by both paths.
  std::vector<std::unique_ptr<Sequence>> MixedBatch() {
    std::vector<std::unique_ptr<Sequence>> batch;
    batch.push_back(std::make_unique<Sequence>(200, 11, Policy(PolicyKind::kLaprox, 40), false));
    batch.push_back(std::make_unique<Sequence>(37, 12, Policy(PolicyKind::kSnapKv, 20), false));
    batch.push_back(std::make_unique<Sequence>(
        300, 13, Policy(PolicyKind::kLaprox, 64, PlanShape::kBlocksShared), true));
    batch.push_back(std::make_unique<Sequence>(90, 14, Policy(PolicyKind::kCake, 30), true));
    batch.push_back(std::make_unique<Sequence>(1, 15, Policy(PolicyKind::kLaprox, 8), false));
    batch.push_back(std::make_unique<Sequence>(
        150, 16, Policy(PolicyKind::kAdaKv, 50, PlanShape::kBlocksPerLayer), true));
    batch.push_back(
        std::make_unique<Sequence>(120, 17, Policy(PolicyKind::kCriticalAdaKv, 33), false));
    return batch;
  }

  static std::vector<KeepPlanRequest> Requests(
      const std::vector<std::unique_ptr<Sequence>>& batch) {
    std::vector<KeepPlanRequest> requests;
    for (const auto& s : batch) requests.push_back(s->request);
    return requests;
  }

  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const PreparedModel> model_;
};

TEST_P(BatchTest, EverySequenceGetsItsSinglePlan) {
  const auto batch = MixedBatch();
  auto plans = backend_->ComputeKeepPlans(*model_, Requests(batch));
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    SCOPED_TRACE(i);
    auto single = backend_->ComputeKeepPlan(*model_, batch[i]->request);
    ASSERT_TRUE(single.ok()) << single.status();
    const KeepPlan& got = (*plans)[i];
    EXPECT_EQ(got.n, single->n);
    EXPECT_EQ(got.counts, single->counts);
    EXPECT_EQ(got.positions, single->positions);
    EXPECT_EQ(got.bitmask, single->bitmask);
    EXPECT_EQ(got.scores, single->scores);
    EXPECT_EQ(got.layer_sums, single->layer_sums);
    EXPECT_EQ(got.selected_total, single->selected_total);
    ASSERT_EQ(got.blocks.has_value(), single->blocks.has_value());
    if (got.blocks) {
      EXPECT_EQ(got.blocks->kept, single->blocks->kept);
      EXPECT_EQ(got.blocks->new_table, single->blocks->new_table);
      EXPECT_EQ(got.blocks->freed, single->blocks->freed);
    }
  }
  // Different sequences got different plans: the test would see a mix-up.
  EXPECT_NE((*plans)[0].counts, (*plans)[1].counts);
}

TEST_P(BatchTest, ABadSequenceFailsTheCallNamingTheLowestIndex) {
  auto batch = MixedBatch();
  // Sequence 3 is malformed (checked before anything is read) and sequence 5 holds a NaN (found
  // while reading): the call names sequence 3.
  batch[3]->request.n = 91;
  batch[5]->c.keys[1][7] = std::nanf("");  // its layer 1 keys read from here, not the pool
  batch[5]->request.layers[1].keys =
      TensorView(batch[5]->c.keys[1].data(), DType::kF32, {Hkv, 150, d});
  auto plans = backend_->ComputeKeepPlans(*model_, Requests(batch));
  EXPECT_EQ(plans.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plans.status().message(), HasSubstr("sequences[3].layers[0].keys has shape"));

  batch[3]->request.n = 90;
  plans = backend_->ComputeKeepPlans(*model_, Requests(batch));
  EXPECT_EQ(plans.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plans.status().message(), HasSubstr("sequences[5].layers[1].keys"));
  EXPECT_THAT(plans.status().message(), HasSubstr("layers[1].keys"));

  EXPECT_EQ(backend_->ComputeKeepPlans(*model_, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// laproxd computes several requests at once on one backend (--workers, --heavy_workers): callers
// on four threads at once, each sequence in another order, share the backend's worker pool
// (common/parallel.h) and must still get the plan each sequence gets alone.
TEST_P(BatchTest, ConcurrentCallersGetTheirSinglePlans) {
  const auto batch = MixedBatch();
  std::vector<KeepPlan> alone;
  for (const auto& s : batch) {
    auto plan = backend_->ComputeKeepPlan(*model_, s->request);
    ASSERT_TRUE(plan.ok()) << plan.status();
    alone.push_back(*std::move(plan));
  }
  constexpr int kCallers = 4;
  std::vector<std::vector<KeepPlan>> got(kCallers, std::vector<KeepPlan>(batch.size()));
  std::vector<absl::Status> statuses(kCallers);
  std::vector<std::thread> callers;
  callers.reserve(kCallers);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (size_t j = 0; j < batch.size(); ++j) {
        const size_t i = (j + c) % batch.size();
        auto plan = backend_->ComputeKeepPlan(*model_, batch[i]->request);
        if (!plan.ok()) {
          statuses[c] = plan.status();
          return;
        }
        got[c][i] = *std::move(plan);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    ASSERT_TRUE(statuses[c].ok()) << "caller " << c << ": " << statuses[c];
    for (size_t i = 0; i < batch.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("caller ", c, ", sequence ", i));
      EXPECT_EQ(got[c][i].counts, alone[i].counts);
      EXPECT_EQ(got[c][i].positions, alone[i].positions);
      EXPECT_EQ(got[c][i].scores, alone[i].scores);
      EXPECT_EQ(got[c][i].layer_sums, alone[i].layer_sums);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, BatchTest, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "threads" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace laprox::kernels
