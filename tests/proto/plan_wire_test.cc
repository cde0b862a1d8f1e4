// plan_wire: a keep plan, its output options and destination, the geometry and the policy kinds
// survive the trip to the wire and back exactly (what the server sends is what the C++ client
// reads), and a malformed destination is refused naming its field. Positions and scores travel
// as bytes fields that a reader of the earlier schema (packed repeated fields) reads unchanged.
#include "laprox/v1/plan_wire.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace laprox {
namespace {

using ::testing::HasSubstr;

kernels::KeepPlan SamplePlan() {
  kernels::KeepPlan plan;
  plan.num_layers = 2;
  plan.num_kv_heads = 1;
  plan.n = 9;
  plan.window = 2;
  plan.sinks = 1;
  plan.quota = 3;
  plan.selected_total = 6;
  plan.tokens_per_head = 6;
  plan.counts = {6, 6};
  plan.offsets = {0, 6, 12};
  plan.positions = {0, 2, 3, 5, 7, 8, 0, 1, 4, 6, 7, 8};
  plan.bitmask = {0xad, 0x01, 0x53, 0x01};
  plan.scores = {1.5f, -0.f, 3e38f};
  plan.layer_sums = {0.25, 1e300};
  plan.timing = {.validate_seconds = 0.5, .score_seconds = 1.25, .select_seconds = 2.0};
  return plan;
}

// The response as the schema said before positions and scores became bytes fields:
// `repeated sfixed32 positions = 6` and `repeated float scores = 8`, packed (proto3).
class EarlierSchema {
 public:
  EarlierSchema() {
    google::protobuf::FileDescriptorProto file;
    file.set_name("laprox_earlier_schema");
    file.set_package("earlier");
    file.set_syntax("proto3");
    google::protobuf::DescriptorProto* message = file.add_message_type();
    message->set_name("Response");
    for (const auto& [name, number, type] :
         {std::tuple{"positions", 6, google::protobuf::FieldDescriptorProto::TYPE_SFIXED32},
          std::tuple{"scores", 8, google::protobuf::FieldDescriptorProto::TYPE_FLOAT}}) {
      google::protobuf::FieldDescriptorProto* field = message->add_field();
      field->set_name(name);
      field->set_number(number);
      field->set_type(type);
      field->set_label(google::protobuf::FieldDescriptorProto::LABEL_REPEATED);
    }
    descriptor_ = pool_.BuildFile(file)->message_type(0);
  }

  // `serialized` parsed as the earlier Response: its positions and scores.
  std::pair<std::vector<int32_t>, std::vector<float>> Parse(const std::string& serialized) {
    std::unique_ptr<google::protobuf::Message> message(factory_.GetPrototype(descriptor_)->New());
    EXPECT_TRUE(message->ParseFromString(serialized));
    const google::protobuf::Reflection* reflection = message->GetReflection();
    const auto& positions = reflection->GetRepeatedFieldRef<int32_t>(
        *message, descriptor_->FindFieldByName("positions"));
    const auto& scores =
        reflection->GetRepeatedFieldRef<float>(*message, descriptor_->FindFieldByName("scores"));
    return {{positions.begin(), positions.end()}, {scores.begin(), scores.end()}};
  }

  // The earlier Response with these values, serialized.
  std::string Serialize(const std::vector<int32_t>& positions, const std::vector<float>& scores) {
    std::unique_ptr<google::protobuf::Message> message(factory_.GetPrototype(descriptor_)->New());
    const google::protobuf::Reflection* reflection = message->GetReflection();
    for (int32_t p : positions) {
      reflection->AddInt32(message.get(), descriptor_->FindFieldByName("positions"), p);
    }
    for (float f : scores) {
      reflection->AddFloat(message.get(), descriptor_->FindFieldByName("scores"), f);
    }
    return message->SerializeAsString();
  }

 private:
  google::protobuf::DescriptorPool pool_;
  google::protobuf::DynamicMessageFactory factory_;
  const google::protobuf::Descriptor* descriptor_ = nullptr;
};

TEST(PlanWireTest, PositionsAndScoresReadTheSameUnderTheEarlierSchema) {
  const kernels::KeepPlan plan = SamplePlan();
  v1::ComputeKeepMaskResponse proto;
  v1::KeepPlanToProto(plan, kernels::PolicySpec(), &proto);
  EXPECT_EQ(proto.positions().size(), plan.positions.size() * 4);
  EarlierSchema earlier;
  // What this server sends, read by a client of the earlier schema.
  const auto [positions, scores] = earlier.Parse(proto.SerializeAsString());
  EXPECT_EQ(positions, plan.positions);
  EXPECT_EQ(scores, plan.scores);
  // What a server of the earlier schema sent, read by this client.
  v1::ComputeKeepMaskResponse from_earlier;
  ASSERT_TRUE(from_earlier.ParseFromString(earlier.Serialize(plan.positions, plan.scores)));
  EXPECT_EQ(v1::PositionsOf(from_earlier), plan.positions);
  EXPECT_EQ(v1::ScoresOf(from_earlier), plan.scores);
  // A truncated element is not read.
  from_earlier.mutable_positions()->pop_back();
  EXPECT_EQ(v1::PositionsOf(from_earlier).size(), plan.positions.size() - 1);
}

TEST(PlanWireTest, APlanComesBackExactly) {
  const kernels::KeepPlan plan = SamplePlan();
  v1::ComputeKeepMaskResponse proto;
  v1::KeepPlanToProto(plan, kernels::PolicySpec(), &proto);
  EXPECT_EQ(proto.tokens_per_head(), 6);
  EXPECT_TRUE(proto.has_effective_policy());
  const kernels::KeepPlan back = v1::KeepPlanFromProto(proto);
  EXPECT_EQ(back.num_layers, plan.num_layers);
  EXPECT_EQ(back.num_kv_heads, plan.num_kv_heads);
  EXPECT_EQ(back.n, plan.n);
  EXPECT_EQ(back.window, plan.window);
  EXPECT_EQ(back.sinks, plan.sinks);
  EXPECT_EQ(back.quota, plan.quota);
  EXPECT_EQ(back.selected_total, plan.selected_total);
  EXPECT_EQ(back.tokens_per_head, plan.tokens_per_head);
  EXPECT_EQ(back.counts, plan.counts);
  EXPECT_EQ(back.offsets, plan.offsets);
  EXPECT_EQ(back.positions, plan.positions);
  EXPECT_EQ(back.bitmask, plan.bitmask);
  EXPECT_EQ(back.scores, plan.scores);
  EXPECT_EQ(back.layer_sums, plan.layer_sums);
  EXPECT_EQ(back.timing.validate_seconds, 0.5);
  EXPECT_EQ(back.timing.score_seconds, 1.25);
  EXPECT_EQ(back.timing.select_seconds, 2.0);
}

TEST(PlanWireTest, OutputsAndDestinationComeBackExactly) {
  const kernels::OutputOptions outputs = {.positions = false, .bitmask = true, .scores = true};
  const kernels::OutputDestination destination = {
      .region_id = 7, .counts_offset = 0, .positions_offset = 64, .scores_offset = 4096};
  v1::OutputOptions proto;
  v1::OutputsToProto(outputs, &destination, &proto);
  kernels::OutputOptions out_back;
  std::optional<kernels::OutputDestination> to_back;
  ASSERT_TRUE(v1::OutputsFromProto(proto, &out_back, &to_back).ok());
  EXPECT_FALSE(out_back.positions);
  EXPECT_TRUE(out_back.bitmask);
  EXPECT_TRUE(out_back.scores);
  ASSERT_TRUE(to_back.has_value());
  EXPECT_EQ(to_back->region_id, 7u);
  EXPECT_EQ(to_back->counts_offset, 0);
  EXPECT_EQ(to_back->offsets_offset, std::nullopt);
  EXPECT_EQ(to_back->positions_offset, 64);
  EXPECT_EQ(to_back->bitmask_offset, std::nullopt);
  EXPECT_EQ(to_back->scores_offset, 4096);
}

TEST(PlanWireTest, UnsetOutputsKeepPositionsAndNoDestination) {
  kernels::OutputOptions outputs = {.positions = false};
  std::optional<kernels::OutputDestination> destination = kernels::OutputDestination{};
  ASSERT_TRUE(v1::OutputsFromProto(v1::OutputOptions(), &outputs, &destination).ok());
  EXPECT_TRUE(outputs.positions);
  EXPECT_FALSE(destination.has_value());
}

TEST(PlanWireTest, RefusesADestinationWithoutRegionOrWithANegativeOffset) {
  kernels::OutputOptions outputs;
  std::optional<kernels::OutputDestination> destination;
  v1::OutputOptions proto;
  proto.mutable_destination()->set_scores_offset(0);
  EXPECT_THAT(std::string(v1::OutputsFromProto(proto, &outputs, &destination).message()),
              HasSubstr("outputs.destination.region_id is 0"));
  proto.mutable_destination()->set_region_id(3);
  proto.mutable_destination()->set_bitmask_offset(-8);
  const absl::Status negative = v1::OutputsFromProto(proto, &outputs, &destination);
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.message()),
              HasSubstr("outputs.destination.bitmask_offset = -8 is negative"));
}

TEST(PlanWireTest, GeometryAndPolicyKindsMapBothWays) {
  const kernels::ModelGeometry geometry = {.num_layers = 30,
                                           .num_heads = 9,
                                           .num_kv_heads = 3,
                                           .head_dim = 64,
                                           .hidden_size = 576,
                                           .softmax_scale = 0.125f};
  v1::ModelGeometry proto;
  v1::GeometryToProto(geometry, &proto);
  const kernels::ModelGeometry back = v1::GeometryFromProto(proto);
  EXPECT_EQ(back.num_layers, 30);
  EXPECT_EQ(back.num_heads, 9);
  EXPECT_EQ(back.num_kv_heads, 3);
  EXPECT_EQ(back.head_dim, 64);
  EXPECT_EQ(back.hidden_size, 576);
  EXPECT_EQ(back.softmax_scale, 0.125f);
  for (int wire = v1::POLICY_KIND_LAPROX; wire <= v1::PolicyKind_MAX; ++wire) {
    const std::optional<kernels::PolicyKind> kind = v1::PolicyKindFromProto(wire);
    ASSERT_TRUE(kind.has_value()) << wire;
    EXPECT_EQ(v1::PolicyKindToProto(*kind), wire);
  }
  EXPECT_EQ(v1::PolicyKindFromProto(v1::POLICY_KIND_UNSPECIFIED), std::nullopt);
  EXPECT_EQ(v1::PolicyKindFromProto(v1::PolicyKind_MAX + 1), std::nullopt);
  EXPECT_EQ(v1::PolicyKindToProto(kernels::PolicyKind::kLaprox), v1::POLICY_KIND_LAPROX);
}

}  // namespace
}  // namespace laprox
