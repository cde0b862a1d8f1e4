// Paged keys and values (TensorView::Paged): a plan read through a block table equals the plan of
// the same numbers laid out contiguously, for the engine layouts, block sizes and dtypes an
// engine uses; every bad table or layout is refused with its exact code before anything is read.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "laprox/kernels/registry.h"
#include "paged_pool.h"
#include "tiny_model.h"

namespace laprox::kernels {
namespace {

using testing::BuildPool;
using ::testing::HasSubstr;
using testing::Layout;
using testing::Pool;
using testing::RoundedToBf16;
using testing::ShuffledIds;
using testing::TinyCase;

struct PagedCase {
  int64_t block_size;
  int64_t n;
  Layout layout;
  DType dtype;
  PolicyKind kind;
};

std::string Name(const ::testing::TestParamInfo<PagedCase>& info) {
  const PagedCase& c = info.param;
  return absl::StrCat("bs", c.block_size, "_n", c.n,
                      c.layout == Layout::kFlashAttention ? "_flash" : "_hnd", "_",
                      DTypeName(c.dtype), "_", PolicyKindName(c.kind));
}

class PagedEqualsContiguousTest : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedEqualsContiguousTest, SamePlan) {
  const PagedCase& p = GetParam();
  constexpr int L = 2, H = 4, Hkv = 2, d = 8, D = 16, kWindow = 8;
  TinyCase c(L, H, Hkv, d, D, p.n, kWindow);
  c.Randomize(static_cast<uint32_t>(p.n * 131 + p.block_size));
  c.policy.kind = p.kind;
  c.policy.window = kWindow;
  c.policy.budget = Budget::TokensPerHead(std::min<int64_t>(p.n, 40));
  if (p.dtype == DType::kBF16) {  // the contiguous side reads the same rounded numbers
    for (int l = 0; l < L; ++l) {
      c.keys[l] = RoundedToBf16(c.keys[l]);
      c.values[l] = RoundedToBf16(c.values[l]);
    }
  }
  auto backend = *CreateBackend("cpu");
  auto model = backend->PrepareModel(c.geometry, c.OProjViews());
  ASSERT_TRUE(model.ok()) << model.status();
  auto contiguous = backend->ComputeKeepPlan(**model, c.Request());
  ASSERT_TRUE(contiguous.ok()) << contiguous.status();

  const int64_t blocks = (p.n + p.block_size - 1) / p.block_size;
  // Each layer its own table (engines with per-layer tables), shuffled among 3 spare blocks.
  std::vector<BlockTable> tables;
  std::vector<Pool> pools;
  for (int l = 0; l < L; ++l) {
    tables.push_back(*BlockTable::Create(ShuffledIds(blocks, blocks + 3, 17 + l), p.block_size));
  }
  KeepPlanRequest request = c.Request();
  for (int l = 0; l < L; ++l) {
    pools.push_back(
        BuildPool(c.keys[l], c.values[l], Hkv, p.n, d, tables[l], blocks + 3, p.layout, p.dtype));
  }
  for (int l = 0; l < L; ++l) {
    request.layers[l].keys =
        TensorView::Paged(pools[l].data(), p.dtype, {Hkv, p.n, d}, pools[l].keys);
    request.layers[l].values =
        TensorView::Paged(pools[l].values_data(), p.dtype, {Hkv, p.n, d}, pools[l].values);
  }
  auto paged = backend->ComputeKeepPlan(**model, request);
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ(paged->counts, contiguous->counts);
  EXPECT_EQ(paged->positions, contiguous->positions);
  EXPECT_EQ(paged->scores, contiguous->scores);
  EXPECT_EQ(paged->layer_sums, contiguous->layer_sums);
}

std::vector<PagedCase> Cases() {
  std::vector<PagedCase> cases;
  for (int64_t bs : {1, 16, 32}) {
    for (int64_t n : {int64_t{100}, int64_t{1100}}) {  // partial last blocks; 1100 > one chunk
      for (Layout layout : {Layout::kFlashAttention, Layout::kInterleavedHnd}) {
        for (DType dtype : {DType::kF32, DType::kBF16}) {
          cases.push_back({bs, n, layout, dtype, PolicyKind::kLaprox});
        }
      }
    }
  }
  // The baselines read values and keys through the same rows.
  for (PolicyKind kind : {PolicyKind::kSnapKv, PolicyKind::kAdaKv, PolicyKind::kCriticalKv}) {
    cases.push_back({16, 700, Layout::kFlashAttention, DType::kF32, kind});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, PagedEqualsContiguousTest, ::testing::ValuesIn(Cases()), Name);

// A repeated id is allowed only when the caller says so; the plan then reads the shared block.
TEST(BlockTableTest, RefusesBadTables) {
  EXPECT_EQ(BlockTable::Create({0, 1}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(BlockTable::Create({0, 1}, 0).status().message(),
              HasSubstr("block_size = 0 is outside [1, 65536]"));
  EXPECT_EQ(BlockTable::Create({0}, BlockTable::kMaxBlockSize + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(BlockTable::Create({3, -4, 5}, 16).status().message(),
              HasSubstr("block id [1] = -4 is negative"));
  EXPECT_THAT(BlockTable::Create({7, 2, 9, 2}, 16).status().message(),
              HasSubstr("block ids [1] and [3] are both physical block 2"));
  auto shared = BlockTable::Create({7, 2, 9, 2}, 16, /*allow_repeated_ids=*/true);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->max_id(), 9);
}

// Views over a valid table that do not fit it: the extent check refuses them before any read.
class PagedViewTest : public ::testing::Test {
 protected:
  static constexpr int64_t kHkv = 2, kN = 40, kD = 8, kBs = 16;  // 3 blocks, the last partial
  BlockTable table_ = *BlockTable::Create({2, 0, 5}, kBs);
  PagedLayout layout_ = {&table_, kBs* kHkv* kD, kHkv* kD, kD, 1};
  float pool_[1] = {};

  absl::Status Extent(const TensorView& view, int64_t* extent) {
    return view.ElementExtent(extent);
  }
};

TEST_F(PagedViewTest, ExtentEndsWithTheLargestIdsBlock) {
  int64_t extent = 0;
  ASSERT_TRUE(Extent(TensorView::Paged(pool_, DType::kF32, {kHkv, kN, kD}, layout_), &extent).ok());
  EXPECT_EQ(extent, 6 * kBs * kHkv * kD);  // blocks 0..5 of 256 elements
}

TEST_F(PagedViewTest, ShortAndLongTablesAreRefused) {
  int64_t extent = 0;
  absl::Status s = Extent(TensorView::Paged(pool_, DType::kF32, {kHkv, 49, kD}, layout_), &extent);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("the block table has 3 ids, but 49 rows in blocks of 16 "
                                     "need ceil(49 / 16) = 4"));
  s = Extent(TensorView::Paged(pool_, DType::kF32, {kHkv, 32, kD}, layout_), &extent);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("has 3 ids, but 32 rows in blocks of 16 need"));
}

TEST_F(PagedViewTest, OverflowingAndNegativeStridesAreRefused) {
  int64_t extent = 0;
  PagedLayout huge = layout_;
  huge.block_stride = int64_t{1} << 62;  // id 5 * 2^62 overflows
  absl::Status s = Extent(TensorView::Paged(pool_, DType::kF32, {kHkv, kN, kD}, huge), &extent);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("(block id 5) overflows int64"));
  PagedLayout negative = layout_;
  negative.slot_stride = -1;
  s = Extent(TensorView::Paged(pool_, DType::kF32, {kHkv, kN, kD}, negative), &extent);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("negative stride"));
}

// Through a backend: only keys and values may be paged, and the messages name the layer and
// field. (A backend that cannot read paged views, CUDA for now, answers UNIMPLEMENTED from
// Backend::CheckKeepPlanRequest; no GPU here to show it.)
TEST(PagedRequestTest, BadPagedInputsNameTheirField) {
  TinyCase c(2, 2, 1, 4, 4, 40, 4);
  c.Randomize(5);
  c.policy.window = 4;
  c.policy.budget = Budget::TokensPerHead(16);
  auto backend = *CreateBackend("cpu");
  auto model = *backend->PrepareModel(c.geometry, c.OProjViews());
  BlockTable short_table = *BlockTable::Create({0, 1}, 16);  // 40 rows need 3 blocks
  std::vector<float> pool(4 * 16 * 4);
  KeepPlanRequest request = c.Request();
  request.layers[1].values =
      TensorView::Paged(pool.data(), DType::kF32, {1, 40, 4}, {&short_table, 64, 4, 4, 1});
  auto plan = backend->ComputeKeepPlan(*model, request);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("layers[1].values: the block table has 2 ids, but 40 rows"));

  BlockTable table = *BlockTable::Create({0, 1, 2}, 16);
  request = c.Request();
  request.layers[0].window_queries =
      TensorView::Paged(pool.data(), DType::kF32, {2, 4, 4}, {&table, 64, 4, 4, 1});
  plan = backend->ComputeKeepPlan(*model, request);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("layers[0].window_queries is paged; only keys and values may be"));
}

}  // namespace
}  // namespace laprox::kernels
