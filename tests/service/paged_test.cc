// Paged keys and values over gRPC: the pool lives in a shared-memory region, the block table
// travels in the request, and a bad table or layout gets its exact code and field.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "tests/service/server_fixture.h"

namespace laprox::service {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBlock = 20, kBlocks = kN / kBlock;  // 15 blocks of 20 rows per head
static_assert(kN % kBlock == 0);

class PagedServiceTest : public ServerTest {
 protected:
  // Rewrites the prefill's shared memory so that logical block b of every head of every layer's
  // keys and values sits at physical block ids[b] of that tensor (DirectPlan keeps reading the
  // unshuffled host copy).
  static void ShuffleBlocks(const Prefill& prefill, const std::vector<int32_t>& ids) {
    const int fd = shm_open(("/" + prefill.name()).c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    void* p = mmap(nullptr, prefill.Bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(p, MAP_FAILED);
    auto* pool = static_cast<float*>(p);
    for (int l = 0; l < kL; ++l) {
      for (int64_t tensor = 0; tensor < 2; ++tensor) {
        const int64_t base = l * prefill.LayerFloats() + tensor * prefill.KvFloats();
        for (int64_t h = 0; h < kHkv; ++h) {
          for (int64_t b = 0; b < kBlocks; ++b) {
            std::memcpy(
                pool + base + h * kN * kD + ids[b] * kBlock * kD,
                prefill.layer(l) + tensor * prefill.KvFloats() + h * kN * kD + b * kBlock * kD,
                kBlock * kD * sizeof(float));
          }
        }
      }
    }
    munmap(p, prefill.Bytes());
  }

  // The fixture's good request with every layer's keys and values paged through one table (as
  // vLLM shares one block table across layers).
  static v1::ComputeKeepMaskRequest PagedRequest(uint64_t model, uint64_t region,
                                                 const Prefill& prefill,
                                                 const std::vector<int32_t>& ids) {
    v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
    v1::BlockTable* table = request.add_block_tables();
    table->mutable_block_ids()->Assign(ids.begin(), ids.end());
    table->set_block_size(kBlock);
    for (v1::LayerInputs& in : *request.mutable_layers()) {
      for (v1::TensorRef* t : {in.mutable_keys(), in.mutable_values()}) {
        v1::PagedLayout* paged = t->mutable_paged();
        paged->set_block_table(0);
        paged->set_block_stride(kBlock * kD);
        paged->set_slot_stride(kD);
        paged->set_head_stride(kN * kD);
        paged->set_dim_stride(1);
      }
    }
    return request;
  }

  static std::vector<int32_t> Shuffled() {
    std::vector<int32_t> ids(kBlocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
    return ids;
  }
};

TEST_F(PagedServiceTest, ShuffledBlocksGiveTheLibrarysPlan) {
  Prefill prefill(31);
  const std::vector<int32_t> ids = Shuffled();
  ShuffleBlocks(prefill, ids);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask,
                        PagedRequest(model, region, prefill, ids), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const kernels::KeepPlan direct = DirectPlan(prefill);
  EXPECT_THAT(v1::PositionsOf(response), ::testing::ElementsAreArray(direct.positions));
  EXPECT_THAT(response.counts(), ::testing::ElementsAreArray(direct.counts));

  // The table is what is read: the identity table over the shuffled pool gives another plan.
  std::vector<int32_t> identity(kBlocks);
  std::iota(identity.begin(), identity.end(), 0);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, PagedRequest(model, region, prefill, identity),
           &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(v1::PositionsOf(response),
              ::testing::Not(::testing::ElementsAreArray(direct.positions)));
}

// A block-shaped plan over the wire: the kept blocks are the library's on the same numbers, the
// new table and freed ids come from the request's table, and effective_policy names the shape
// and the block size taken from the table.
TEST_F(PagedServiceTest, BlocksSharedPlanCarriesTheNewTableAndFreedIds) {
  Prefill prefill(33);
  const std::vector<int32_t> ids = Shuffled();
  ShuffleBlocks(prefill, ids);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskRequest request = PagedRequest(model, region, prefill, ids);
  request.mutable_policy()->set_plan_shape(v1::PLAN_SHAPE_BLOCKS_SHARED);
  request.mutable_outputs()->set_scores(true);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();

  kernels::PolicySpec policy;
  policy.plan_shape = kernels::PlanShape::kBlocksShared;
  policy.block_size = kBlock;
  const kernels::KeepPlan direct = DirectPlan(prefill, policy);
  ASSERT_TRUE(direct.blocks.has_value());
  const v1::BlockPlan& blocks = response.blocks();
  EXPECT_EQ(blocks.block_size(), kBlock);
  EXPECT_EQ(blocks.num_blocks(), kBlocks);
  EXPECT_THAT(blocks.offsets(), ::testing::ElementsAreArray(direct.blocks->offsets));
  EXPECT_THAT(blocks.kept_blocks(), ::testing::ElementsAreArray(direct.blocks->kept));
  ASSERT_EQ(blocks.block_scores_size(), kBlocks);  // the window's 32 positions: blocks 13, 14
  for (int b = 0; b < kBlocks; ++b) EXPECT_EQ(std::isinf(blocks.block_scores(b)), b >= 13) << b;
  EXPECT_THAT(v1::PositionsOf(response), ::testing::ElementsAreArray(direct.positions));
  // 64 tokens per head in blocks of 20: 3 blocks kept, 12 freed.
  ASSERT_EQ(blocks.kept_blocks_size(), 3);
  ASSERT_EQ(blocks.new_block_table_size(), 3);
  EXPECT_THAT(blocks.freed_offsets(), ::testing::ElementsAre(0, kBlocks - 3));
  std::vector<int32_t> all(blocks.new_block_table().begin(), blocks.new_block_table().end());
  for (int j = 0; j < 3; ++j) EXPECT_EQ(blocks.new_block_table(j), ids[blocks.kept_blocks(j)]);
  all.insert(all.end(), blocks.freed_block_ids().begin(), blocks.freed_block_ids().end());
  std::sort(all.begin(), all.end());
  std::vector<int32_t> sorted_ids = ids;
  std::sort(sorted_ids.begin(), sorted_ids.end());
  EXPECT_EQ(all, sorted_ids);
  EXPECT_EQ(response.effective_policy().plan_shape(), v1::PLAN_SHAPE_BLOCKS_SHARED);
  EXPECT_EQ(response.effective_policy().block_size(), kBlock);

  // A block size the table does not have is refused, naming the field.
  request.mutable_policy()->set_block_size(kBlock * 2);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("(policy.block_size)"));
  request.mutable_policy()->set_block_size(0);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("policy.block_size = 0 is outside [1, 65536]"));
  request.mutable_policy()->clear_block_size();
  request.mutable_policy()->set_plan_shape(static_cast<v1::PlanShape>(9));
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("policy.plan_shape = 9"));
}

// A block table held in a shared-memory region (ids_region) gives the plan of the same table
// sent inline; every bad way to give one is refused with its field before anything is read.
TEST_F(PagedServiceTest, TableInARegionGivesThePlanOfTheInlineTable) {
  Prefill prefill(34);
  const std::vector<int32_t> ids = Shuffled();
  ShuffleBlocks(prefill, ids);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskRequest request = PagedRequest(model, region, prefill, ids);
  v1::ComputeKeepMaskResponse inline_table, region_table;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &inline_table);
  ASSERT_TRUE(s.ok()) << s.error_message();

  // The ids at byte 8 of a 128-byte object of their own.
  const std::string name = absl::StrCat("laprox-itest-table-", getpid());
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 128), 0);
  ASSERT_EQ(pwrite(fd, ids.data(), ids.size() * 4, 8), static_cast<ssize_t>(ids.size() * 4));
  close(fd);
  const absl::Cleanup unlink = [&] { shm_unlink(("/" + name).c_str()); };
  v1::RegisterRegionRequest shm;
  shm.mutable_shm()->set_name(name);
  shm.mutable_shm()->set_byte_size(128);
  v1::RegisterRegionResponse registered;
  ASSERT_TRUE(Call(&v1::Laprox::Stub::RegisterRegion, shm, &registered).ok());
  const uint64_t table_region = registered.region_id();

  v1::BlockTable* table = request.mutable_block_tables(0);
  table->clear_block_ids();
  table->mutable_ids_region()->set_region_id(table_region);
  table->mutable_ids_region()->set_byte_offset(8);
  table->set_ids_count(kBlocks);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &region_table);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(v1::PositionsOf(region_table),
              ::testing::ElementsAreArray(v1::PositionsOf(inline_table)));
  EXPECT_THAT(region_table.counts(), ::testing::ElementsAreArray(inline_table.counts()));

  struct Bad {
    const char* what;
    std::function<void(v1::BlockTable&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Bad> cases = {
      {"ids both inline and in a region", [](auto& t) { t.add_block_ids(3); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0] has both block_ids (1 ids) and ids_region"},
      {"a count that does not fit n", [](auto& t) { t.set_ids_count(kBlocks - 1); },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables[0] has 14 ids, but n = 300"},
      // Fuzz finding (UBSan: memcpy from a zero-length copy's null pointer), and its relatives:
      // counts outside [1, n] are refused before anything is sized or read, whatever the block
      // size says.
      {"a zero count with an invalid block size",
       [](auto& t) {
         t.set_ids_count(0);
         t.set_block_size(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables[0].ids_count = 0 is outside [1, n = 300]"},
      {"a negative count",
       [](auto& t) {
         t.set_ids_count(-5);
         t.set_block_size(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "ids_count = -5 is outside [1, n = 300]"},
      {"a count that would overflow in bytes",
       [](auto& t) {
         t.set_ids_count(int64_t{1} << 62);
         t.set_block_size(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "is outside [1, n = 300]"},
      {"a count without a region", [](auto& t) { t.clear_ids_region(); },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables[0].ids_count = 15 without ids_region"},
      {"a misaligned offset", [](auto& t) { t.mutable_ids_region()->set_byte_offset(6); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0].ids_region.byte_offset = 6 is not aligned to the 4-byte ids"},
      {"ids past the region's end", [](auto& t) { t.mutable_ids_region()->set_byte_offset(72); },
       grpc::StatusCode::OUT_OF_RANGE, "block_tables[0].ids_region"},
      {"a negative offset", [](auto& t) { t.mutable_ids_region()->set_byte_offset(-4); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0].ids_region.byte_offset = -4 is negative"},
      {"an unknown region", [](auto& t) { t.mutable_ids_region()->set_region_id(1 << 30); },
       grpc::StatusCode::NOT_FOUND, "block_tables[0].ids_region"},
      {"ids starting at the wrong place (a repeated id)",
       [](auto& t) { t.mutable_ids_region()->set_byte_offset(4); },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables[0]: block id"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    v1::ComputeKeepMaskRequest broken = request;
    bad.mutate(*broken.mutable_block_tables(0));
    v1::ComputeKeepMaskResponse response;
    s = Call(&v1::Laprox::Stub::ComputeKeepMask, broken, &response);
    EXPECT_EQ(s.error_code(), bad.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(bad.message));
  }
  ExpectServes(35);  // a fresh prefill: this one's blocks are shuffled
}

struct BadPaged {
  const char* what;
  std::function<void(v1::ComputeKeepMaskRequest&)> mutate;
  grpc::StatusCode code;
  std::string message;
};

TEST_F(PagedServiceTest, BadTablesAndLayoutsAreRefusedWithTheirField) {
  Prefill prefill(32);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  std::vector<int32_t> identity(kBlocks);
  std::iota(identity.begin(), identity.end(), 0);
  auto keys = [](v1::ComputeKeepMaskRequest& r, int l) {
    return r.mutable_layers(l)->mutable_keys();
  };
  auto ids = [](v1::ComputeKeepMaskRequest& r) {
    return r.mutable_block_tables(0)->mutable_block_ids();
  };
  const std::vector<BadPaged> cases = {
      {"an id beyond the region", [&](auto& r) { ids(r)->Set(14, 1 << 20); },
       grpc::StatusCode::OUT_OF_RANGE, "layers[0].keys: bytes ["},
      {"a negative id", [&](auto& r) { ids(r)->Set(3, -1); }, grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0]: block id [3] = -1 is negative"},
      {"a repeated id", [&](auto& r) { ids(r)->Set(9, 2); }, grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0]: block ids [2] and [9] are both physical block 2"},
      {"a short table", [&](auto& r) { ids(r)->RemoveLast(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0] has 14 ids, but n = 300 tokens in blocks of 20 need ceil(300 / 20) = 15"},
      {"a long table", [&](auto& r) { ids(r)->Add(15); }, grpc::StatusCode::INVALID_ARGUMENT,
       "block_tables[0] has 16 ids"},
      {"a table for a shorter sequence",
       [&](auto& r) {
         r.set_n(280);  // the tensors' shapes still say 300
         ids(r)->RemoveLast();
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "layers[0].keys: the block table has 14 ids, but 300 rows in blocks of 20 need"},
      {"block size 0", [&](auto& r) { r.mutable_block_tables(0)->set_block_size(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables[0]: block_size = 0 is outside [1, 65536]"},
      {"an unknown table", [&](auto& r) { keys(r, 2)->mutable_paged()->set_block_table(1); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "layers[2].keys.paged.block_table = 1 but the request has 1 block tables"},
      {"an overflowing block stride",
       [&](auto& r) { keys(r, 1)->mutable_paged()->set_block_stride(int64_t{1} << 61); },
       grpc::StatusCode::OUT_OF_RANGE, "layers[1].keys: extent of"},
      {"a negative stride", [&](auto& r) { keys(r, 1)->mutable_paged()->set_dim_stride(-1); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[1].keys: negative stride"},
      {"strides beside the layout", [&](auto& r) { keys(r, 0)->add_strides(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].keys.strides must be empty"},
      {"a misaligned pool", [&](auto& r) { keys(r, 0)->mutable_region()->set_byte_offset(2); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].keys.region.byte_offset = 2 is not aligned"},
      {"paged window queries",
       [&](auto& r) { r.mutable_layers(0)->mutable_window_queries()->mutable_paged(); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "layers[0].window_queries.paged is set; only keys and values may be paged"},
      {"an inline pool",
       [&](auto& r) { keys(r, 0)->set_inline_bytes(std::string(4 * kHkv * kN * kD, '\0')); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].keys.paged needs the pool in a region"},
      {"more tables than 2 per layer",
       [&](auto& r) {
         for (int t = 0; t < 2 * kL; ++t) *r.add_block_tables() = r.block_tables(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "block_tables has 7 tables; at most 2 * 3 layers = 6"},
  };
  for (const BadPaged& c : cases) {
    v1::ComputeKeepMaskRequest request = PagedRequest(model, region, prefill, identity);
    c.mutate(request);
    v1::ComputeKeepMaskResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.what;
  }
  // The identity table reads the unshuffled pool: the library's plan.
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask,
                        PagedRequest(model, region, prefill, identity), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(v1::PositionsOf(response),
              ::testing::ElementsAreArray(DirectPlan(prefill).positions));
  ExpectServes(33);
}

}  // namespace
}  // namespace laprox::service
