// ComputeKeepPlans over gRPC: a batch's plans equal the single ComputeKeepMask answers for the
// same sequences, and a batch is all or nothing: one bad sequence fails the call naming it, and
// nothing is written into any destination region.
#include <cstring>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/service/server_fixture.h"

namespace laprox::service {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

class BatchServiceTest : public ServerTest {};

// Sequences of different lengths, policies and shapes, each in its own region, one model.
TEST_F(BatchServiceTest, BatchPlansEqualTheSinglePlans) {
  Prefill a(41), b(42, 200), c(43, 97);
  const uint64_t model = RegisterModel(a);
  v1::ComputeKeepPlansRequest batch;
  *batch.add_sequences() = GoodRequest(model, RegisterRegion(a), a);
  *batch.add_sequences() = GoodRequest(model, RegisterRegion(b), b);
  batch.mutable_sequences(1)->mutable_policy()->set_kind(v1::POLICY_KIND_SNAPKV);
  batch.mutable_sequences(1)->mutable_policy()->set_window(kWindow);
  *batch.add_sequences() = GoodRequest(model, RegisterRegion(c), c);
  batch.mutable_sequences(2)->mutable_policy()->set_plan_shape(v1::PLAN_SHAPE_BLOCKS_SHARED);
  batch.mutable_sequences(2)->mutable_policy()->set_block_size(16);
  batch.mutable_sequences(2)->mutable_budget()->set_tokens_per_head(48);
  v1::ComputeKeepPlansResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(response.plans_size(), 3);
  EXPECT_GT(response.timing().total_seconds(), 0);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    v1::ComputeKeepMaskResponse single;
    s = Call(&v1::Laprox::Stub::ComputeKeepMask, batch.sequences(i), &single);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::ComputeKeepMaskResponse& got = response.plans(i);
    EXPECT_EQ(got.n(), batch.sequences(i).n());
    EXPECT_THAT(got.counts(), ElementsAreArray(single.counts()));
    EXPECT_THAT(v1::PositionsOf(got), ElementsAreArray(v1::PositionsOf(single)));
    EXPECT_EQ(got.bitmask(), single.bitmask());
    EXPECT_THAT(got.layer_sums(), ElementsAreArray(single.layer_sums()));
    EXPECT_EQ(got.effective_policy().SerializeAsString(),
              single.effective_policy().SerializeAsString());
    EXPECT_EQ(got.blocks().SerializeAsString(), single.blocks().SerializeAsString());
  }
  EXPECT_EQ(response.plans(2).blocks().kept_blocks_size(), 3);  // 48 tokens in blocks of 16
}

TEST_F(BatchServiceTest, ABadSequenceFailsTheBatchAndWritesNothing) {
  Prefill a(44), b(45), out(46);
  const uint64_t model = RegisterModel(a);
  const uint64_t region_a = RegisterRegion(a), region_b = RegisterRegion(b);
  const uint64_t destination = RegisterRegion(out, /*writable=*/true);
  v1::ComputeKeepPlansRequest batch;
  *batch.add_sequences() = GoodRequest(model, region_a, a);
  batch.mutable_sequences(0)->mutable_outputs()->mutable_destination()->set_region_id(destination);
  batch.mutable_sequences(0)->mutable_outputs()->mutable_destination()->set_positions_offset(0);
  *batch.add_sequences() = GoodRequest(model, region_b, b);
  batch.mutable_sequences(1)->mutable_layers(2)->mutable_keys()->set_shape(1, kN + 1);
  v1::ComputeKeepPlansResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sequences[1].layers[2].keys has shape"));
  EXPECT_EQ(response.plans_size(), 0);
  // The destination still holds the prefill's own bytes: nothing was written.
  auto first_word = [&] {
    const int fd = shm_open(("/" + out.name()).c_str(), O_RDONLY, 0);
    int32_t word = 0;
    EXPECT_EQ(pread(fd, &word, sizeof(word), 0), static_cast<ssize_t>(sizeof(word)));
    close(fd);
    return word;
  };
  int32_t original = 0;
  std::memcpy(&original, out.layer(0), sizeof(original));
  EXPECT_EQ(first_word(), original);

  // Fixed, the batch writes sequence 0's positions there.
  batch.mutable_sequences(1)->mutable_layers(2)->mutable_keys()->set_shape(1, kN);
  s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(v1::PositionsOf(response.plans(0)).size(), 0);  // in the region instead
  EXPECT_GT(v1::PositionsOf(response.plans(1)).size(), 0);
  // The region's first int32 is sequence 0's first kept position, as ComputeKeepMask gives it.
  v1::ComputeKeepMaskResponse single;
  v1::ComputeKeepMaskRequest alone = batch.sequences(0);
  alone.mutable_outputs()->clear_destination();
  ASSERT_TRUE(Call(&v1::Laprox::Stub::ComputeKeepMask, alone, &single).ok());
  EXPECT_EQ(first_word(), v1::PositionsOf(single).at(0));
}

TEST_F(BatchServiceTest, RefusesWhatABatchCannotBe) {
  Prefill a(47), b(48);
  const uint64_t model_a = RegisterModel(a), model_b = RegisterModel(b);
  const uint64_t region_a = RegisterRegion(a, /*writable=*/true), region_b = RegisterRegion(b);
  v1::ComputeKeepPlansResponse response;
  v1::ComputeKeepPlansRequest batch;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sequences: the batch is empty"));

  *batch.add_sequences() = GoodRequest(model_a, region_a, a);
  *batch.add_sequences() = GoodRequest(model_b, region_b, b);
  s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("sequences[1].model_id = " + std::to_string(model_b) +
                        ", but sequences[0] names model " + std::to_string(model_a)));

  // Sequence 1 writes its positions over sequence 0's keys: outputs never overwrite inputs.
  batch.mutable_sequences(1)->set_model_id(model_a);
  auto* to = batch.mutable_sequences(1)->mutable_outputs()->mutable_destination();
  to->set_region_id(region_a);
  to->set_positions_offset(0);
  s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sequences[1].outputs.destination.positions (region " +
                                           std::to_string(region_a) + ", bytes [0, +"));
  EXPECT_THAT(s.error_message(), HasSubstr("overlaps the input sequences[0].layers[0].keys"));

  // Two sequences' areas in one region overlap each other.
  batch.mutable_sequences(1)->mutable_outputs()->clear_destination();
  for (int i = 0; i < 2; ++i) {
    *batch.mutable_sequences(i) = GoodRequest(model_a, region_b, b);
    auto* d = batch.mutable_sequences(i)->mutable_outputs()->mutable_destination();
    d->set_region_id(region_a);
    d->set_counts_offset(64 + 4 * i);
  }
  s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sequences[0].outputs.destination.counts"));
  EXPECT_THAT(s.error_message(), HasSubstr("overlaps sequences[1].outputs.destination.counts"));

  StartServer({.max_batch_sequences = 1});
  s = Call(&v1::Laprox::Stub::ComputeKeepPlans, batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("more than this server's limit of 1"));
}

}  // namespace
}  // namespace laprox::service
