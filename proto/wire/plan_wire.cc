#include "laprox/v1/plan_wire.h"

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "laprox/v1/policy_wire.h"

namespace laprox::v1 {
namespace {

namespace k = ::laprox::kernels;

// Policy kinds travel as the kernels value + 1 (policy_wire.h, which pins the last one); the
// first one and the end of the range are pinned here.
static_assert(POLICY_KIND_LAPROX == static_cast<int>(k::PolicyKind::kLaprox) + 1);
static_assert(PolicyKind_MAX == POLICY_KIND_CAKE);

// positions and scores are copied as they are in memory into little-endian bytes fields.
static_assert(std::endian::native == std::endian::little);

template <typename T>
void SetArray(const std::vector<T>& values, std::string* bytes) {
  if (values.empty()) {
    bytes->clear();
    return;
  }
  bytes->assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

template <typename T>
std::vector<T> ArrayOf(const std::string& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

}  // namespace

void GeometryToProto(const k::ModelGeometry& geometry, ModelGeometry* proto) {
  proto->set_num_layers(geometry.num_layers);
  proto->set_num_heads(geometry.num_heads);
  proto->set_num_kv_heads(geometry.num_kv_heads);
  proto->set_head_dim(geometry.head_dim);
  proto->set_hidden_size(geometry.hidden_size);
  proto->set_softmax_scale(geometry.softmax_scale);
}

k::ModelGeometry GeometryFromProto(const ModelGeometry& proto) {
  return {.num_layers = proto.num_layers(),
          .num_heads = proto.num_heads(),
          .num_kv_heads = proto.num_kv_heads(),
          .head_dim = proto.head_dim(),
          .hidden_size = proto.hidden_size(),
          .softmax_scale = proto.softmax_scale()};
}

PolicyKind PolicyKindToProto(k::PolicyKind kind) {
  return static_cast<PolicyKind>(static_cast<int>(kind) + 1);
}

std::optional<k::PolicyKind> PolicyKindFromProto(int kind) {
  if (kind <= POLICY_KIND_UNSPECIFIED || kind > PolicyKind_MAX) return std::nullopt;
  return static_cast<k::PolicyKind>(kind - 1);
}

void OutputsToProto(const k::OutputOptions& outputs, const k::OutputDestination* destination,
                    OutputOptions* proto) {
  proto->set_positions(outputs.positions);
  proto->set_bitmask(outputs.bitmask);
  proto->set_scores(outputs.scores);
  if (destination == nullptr) return;
  OutputDestination* to = proto->mutable_destination();
  to->set_region_id(destination->region_id);
  if (destination->counts_offset) to->set_counts_offset(*destination->counts_offset);
  if (destination->offsets_offset) to->set_offsets_offset(*destination->offsets_offset);
  if (destination->positions_offset) to->set_positions_offset(*destination->positions_offset);
  if (destination->bitmask_offset) to->set_bitmask_offset(*destination->bitmask_offset);
  if (destination->scores_offset) to->set_scores_offset(*destination->scores_offset);
}

absl::Status OutputsFromProto(const OutputOptions& proto, k::OutputOptions* outputs,
                              std::optional<k::OutputDestination>* destination) {
  outputs->positions = proto.has_positions() ? proto.positions() : true;
  outputs->bitmask = proto.bitmask();
  outputs->scores = proto.scores();
  destination->reset();
  if (!proto.has_destination()) return absl::OkStatus();
  const OutputDestination& d = proto.destination();
  if (d.region_id() == 0) return absl::InvalidArgumentError("outputs.destination.region_id is 0");
  k::OutputDestination& to = destination->emplace();
  to.region_id = d.region_id();
  struct Offset {
    bool given;
    int64_t value;
    std::optional<int64_t>& to;
    const char* name;
  };
  for (const Offset& o :
       {Offset{d.has_counts_offset(), d.counts_offset(), to.counts_offset, "counts"},
        Offset{d.has_offsets_offset(), d.offsets_offset(), to.offsets_offset, "offsets"},
        Offset{d.has_positions_offset(), d.positions_offset(), to.positions_offset, "positions"},
        Offset{d.has_bitmask_offset(), d.bitmask_offset(), to.bitmask_offset, "bitmask"},
        Offset{d.has_scores_offset(), d.scores_offset(), to.scores_offset, "scores"}}) {
    if (!o.given) continue;
    if (o.value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs.destination.", o.name, "_offset = ", o.value, " is negative"));
    }
    o.to = o.value;
  }
  return absl::OkStatus();
}

void KeepPlanToProto(const k::KeepPlan& plan, const k::PolicySpec& effective_policy,
                     ComputeKeepMaskResponse* proto) {
  proto->set_num_layers(plan.num_layers);
  proto->set_num_kv_heads(plan.num_kv_heads);
  proto->set_n(plan.n);
  proto->mutable_counts()->Assign(plan.counts.begin(), plan.counts.end());
  proto->mutable_offsets()->Assign(plan.offsets.begin(), plan.offsets.end());
  SetArray(plan.positions, proto->mutable_positions());
  proto->set_bitmask(plan.bitmask.data(), plan.bitmask.size());
  SetArray(plan.scores, proto->mutable_scores());
  proto->mutable_layer_sums()->Assign(plan.layer_sums.begin(), plan.layer_sums.end());
  proto->set_window(plan.window);
  proto->set_sinks(plan.sinks);
  proto->set_quota(plan.quota);
  proto->set_selected_total(plan.selected_total);
  proto->set_tokens_per_head(plan.tokens_per_head);
  PolicyToProto(effective_policy, proto->mutable_effective_policy());
  if (plan.blocks) {
    const k::BlockPlan& b = *plan.blocks;
    proto->mutable_effective_policy()->set_block_size(static_cast<int32_t>(b.block_size));
    BlockPlan* blocks = proto->mutable_blocks();
    blocks->set_block_size(static_cast<int32_t>(b.block_size));
    blocks->set_num_blocks(b.num_blocks);
    blocks->mutable_offsets()->Assign(b.offsets.begin(), b.offsets.end());
    blocks->mutable_kept_blocks()->Assign(b.kept.begin(), b.kept.end());
    blocks->mutable_block_scores()->Assign(b.scores.begin(), b.scores.end());
    blocks->mutable_new_block_table()->Assign(b.new_table.begin(), b.new_table.end());
    blocks->mutable_freed_block_ids()->Assign(b.freed.begin(), b.freed.end());
    blocks->mutable_freed_offsets()->Assign(b.freed_offsets.begin(), b.freed_offsets.end());
  }
  Timing* timing = proto->mutable_timing();
  timing->set_validate_seconds(plan.timing.validate_seconds);
  timing->set_score_seconds(plan.timing.score_seconds);
  timing->set_select_seconds(plan.timing.select_seconds);
}

k::KeepPlan KeepPlanFromProto(const ComputeKeepMaskResponse& proto) {
  k::KeepPlan plan;
  plan.num_layers = proto.num_layers();
  plan.num_kv_heads = proto.num_kv_heads();
  plan.n = proto.n();
  plan.window = proto.window();
  plan.sinks = proto.sinks();
  plan.quota = proto.quota();
  plan.selected_total = proto.selected_total();
  plan.tokens_per_head = proto.tokens_per_head();
  plan.counts.assign(proto.counts().begin(), proto.counts().end());
  plan.offsets.assign(proto.offsets().begin(), proto.offsets().end());
  plan.positions = PositionsOf(proto);
  plan.bitmask.assign(proto.bitmask().begin(), proto.bitmask().end());
  plan.scores = ScoresOf(proto);
  plan.layer_sums.assign(proto.layer_sums().begin(), proto.layer_sums().end());
  if (proto.has_blocks()) {
    const BlockPlan& b = proto.blocks();
    k::BlockPlan& blocks = plan.blocks.emplace();
    blocks.block_size = b.block_size();
    blocks.num_blocks = b.num_blocks();
    blocks.units = b.offsets_size() > 0 ? b.offsets_size() - 1 : 0;
    blocks.offsets.assign(b.offsets().begin(), b.offsets().end());
    blocks.kept.assign(b.kept_blocks().begin(), b.kept_blocks().end());
    blocks.scores.assign(b.block_scores().begin(), b.block_scores().end());
    blocks.new_table.assign(b.new_block_table().begin(), b.new_block_table().end());
    blocks.freed.assign(b.freed_block_ids().begin(), b.freed_block_ids().end());
    blocks.freed_offsets.assign(b.freed_offsets().begin(), b.freed_offsets().end());
  }
  const Timing& timing = proto.timing();
  plan.timing = {.validate_seconds = timing.validate_seconds(),
                 .score_seconds = timing.score_seconds(),
                 .select_seconds = timing.select_seconds()};
  return plan;
}

std::vector<int32_t> PositionsOf(const ComputeKeepMaskResponse& proto) {
  return ArrayOf<int32_t>(proto.positions());
}

std::vector<float> ScoresOf(const ComputeKeepMaskResponse& proto) {
  return ArrayOf<float>(proto.scores());
}

}  // namespace laprox::v1
