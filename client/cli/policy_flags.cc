#include "client/cli/policy_flags.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "laprox/v1/laprox.pb.h"
#include "laprox/v1/policy_wire.h"

ABSL_FLAG(int64_t, budget, 128, "kept tokens per KV head (window included)");
ABSL_FLAG(double, compression_ratio, -1.0, "if >= 0: keep int((1 - cr) * n) per head instead");
// Policy fields (unset: not set in the request).
ABSL_FLAG(std::optional<std::string>, kind, std::nullopt,
          "policy kind: laprox|streaming_llm|snapkv|pyramidkv|adakv|criticalkv|critical_adakv|"
          "cake (unset: laprox)");
ABSL_FLAG(std::optional<std::string>, policy, std::nullopt, "the same as --kind");
ABSL_FLAG(std::optional<std::string>, allocation, std::nullopt,
          "LAPROX: global_normalized|global_raw|per_layer|uniform");
ABSL_FLAG(std::optional<std::string>, indicator, std::nullopt,
          "LAPROX: attention_x_projected_value|attention_x_value|attention");
ABSL_FLAG(std::optional<std::string>, gqa_value, std::nullopt,
          "LAPROX: mean_head_norm|summed_projection|mean_head_product|exact_block (unset: "
          "mean_head_product, mean_head_norm with the other indicators)");
ABSL_FLAG(std::optional<std::string>, pool_target, std::nullopt,
          "LAPROX: attention|score (unset: the gqa_value's placement)");
ABSL_FLAG(std::optional<std::string>, preset, std::nullopt,
          "LAPROX: default|paper, fills the policy fields not given");
ABSL_FLAG(std::optional<std::string>, pooling, std::nullopt,
          "avg|max|none|avg_peak (unset: avg_peak for laprox, avg for the baselines)");
ABSL_FLAG(std::optional<std::string>, numeric_mode, std::nullopt,
          "baselines: exact|kvpress_compat");
ABSL_FLAG(std::optional<std::string>, plan_shape, std::nullopt,
          "ragged|layer_uniform|blocks_shared|blocks_per_layer (unset: ragged)");
ABSL_FLAG(std::optional<int>, block_size, std::nullopt,
          "tokens per block of the block shapes (needed here: a dump's keys are not paged)");
ABSL_FLAG(std::optional<int>, window, std::nullopt,
          "observation window w (unset: the policy's default, 32 or 64)");
ABSL_FLAG(std::optional<int>, pool_kernel, std::nullopt,
          "pooling kernel (unset: the policy's default, 31 for laprox, 5 for the baselines)");
ABSL_FLAG(std::optional<int>, sinks, std::nullopt,
          "attention sinks (unset: the policy's default, 0 or 4 for streaming_llm)");
ABSL_FLAG(std::optional<int>, min_per_head, std::nullopt,
          "LAPROX: candidates each head reserves before the global competition (unset: 0)");
ABSL_FLAG(std::optional<double>, max_layer_share, std::nullopt,
          "LAPROX: the most one layer may select, in multiples of the average layer's share "
          "(unset: no cap)");
ABSL_FLAG(bool, head_uniform_layers, false,
          "deprecated: --plan_shape=layer_uniform (the same plans; this older spelling is still "
          "sent)");
ABSL_FLAG(std::optional<double>, pyramid_beta, std::nullopt, "PYRAMIDKV steepness (unset: 20)");
ABSL_FLAG(std::optional<double>, alpha_safeguard, std::nullopt,
          "ADAKV, CRITICAL_ADAKV safeguard share (unset: 0.2)");
ABSL_FLAG(std::optional<double>, epsilon, std::nullopt,
          "CRITICALKV, CRITICAL_ADAKV score offset (unset: 1e-4)");
ABSL_FLAG(std::optional<double>, first_stage_ratio, std::nullopt,
          "CRITICALKV, CRITICAL_ADAKV first-stage share (unset: 0.5)");
ABSL_FLAG(std::optional<double>, cake_tau1, std::nullopt, "CAKE entropy temperature (unset: 1.6)");
ABSL_FLAG(std::optional<double>, cake_tau2, std::nullopt, "CAKE variance temperature (unset: 0.6)");
ABSL_FLAG(std::optional<double>, cake_gamma, std::nullopt,
          "CAKE variance weight of the eviction score (unset: 200)");
namespace laprox::cli {
namespace {

using EnumFlag = absl::Flag<std::optional<std::string>>;

// Sets the enum field `name` of `policy` to the value --name names (its lower-case name without
// the enum prefix: --gqa_value=exact_block is GQA_VALUE_EXACT_BLOCK); unset flag, unset field.
absl::Status SetEnumField(const EnumFlag& flag, const char* name, v1::Policy* policy) {
  const std::optional<std::string> value = absl::GetFlag(flag);
  if (!value) return absl::OkStatus();
  const google::protobuf::FieldDescriptor* field = v1::Policy::descriptor()->FindFieldByName(name);
  const google::protobuf::EnumDescriptor* type = field->enum_type();
  // Value 0 is <PREFIX>UNSPECIFIED (the proto contract test checks it).
  const size_t prefix = type->value(0)->name().size() - std::strlen("UNSPECIFIED");
  std::vector<std::string> accepted;
  for (int i = 1; i < type->value_count(); ++i) {
    accepted.push_back(absl::AsciiStrToLower(type->value(i)->name().substr(prefix)));
    if (accepted.back() == *value) {
      policy->GetReflection()->SetEnumValue(policy, field, type->value(i)->number());
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, "=", *value, " is not one of ", absl::StrJoin(accepted, ", ")));
}

}  // namespace

absl::StatusOr<kernels::PolicySpec> PolicyFromFlags() {
  v1::Policy policy;
  const std::optional<std::string> kind = absl::GetFlag(FLAGS_kind);
  const std::optional<std::string> alias = absl::GetFlag(FLAGS_policy);
  if (kind && alias && *kind != *alias) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kind=", *kind, " and --policy=", *alias, " disagree"));
  }
  const std::pair<const EnumFlag*, const char*> enums[] = {
      {kind ? &FLAGS_kind : &FLAGS_policy, "kind"},
      {&FLAGS_allocation, "allocation"},
      {&FLAGS_indicator, "indicator"},
      {&FLAGS_gqa_value, "gqa_value"},
      {&FLAGS_pool_target, "pool_target"},
      {&FLAGS_preset, "preset"},
      {&FLAGS_pooling, "pooling"},
      {&FLAGS_numeric_mode, "numeric_mode"},
      {&FLAGS_plan_shape, "plan_shape"}};
  for (const auto& [flag, name] : enums) {
    LAPROX_RETURN_IF_ERROR(SetEnumField(*flag, name, &policy));
  }
  if (auto w = absl::GetFlag(FLAGS_window)) policy.set_window(*w);
  if (auto k = absl::GetFlag(FLAGS_pool_kernel)) policy.set_pool_kernel(*k);
  if (auto s = absl::GetFlag(FLAGS_sinks)) policy.set_sinks(*s);
  if (auto m = absl::GetFlag(FLAGS_min_per_head)) policy.set_min_per_head(*m);
  if (auto b = absl::GetFlag(FLAGS_block_size)) policy.set_block_size(*b);
  if (auto x = absl::GetFlag(FLAGS_max_layer_share)) policy.set_max_layer_share(*x);
  if (absl::GetFlag(FLAGS_head_uniform_layers)) {
    std::fprintf(stderr,
                 "laprox-cli: --head_uniform_layers is deprecated; use --plan_shape=layer_uniform "
                 "(the same plans)\n");
  }
  policy.set_head_uniform_layers(absl::GetFlag(FLAGS_head_uniform_layers));
  if (auto x = absl::GetFlag(FLAGS_pyramid_beta)) policy.set_pyramid_beta(*x);
  if (auto x = absl::GetFlag(FLAGS_alpha_safeguard)) policy.set_alpha_safeguard(*x);
  if (auto x = absl::GetFlag(FLAGS_epsilon)) policy.set_epsilon(*x);
  if (auto x = absl::GetFlag(FLAGS_first_stage_ratio)) policy.set_first_stage_ratio(*x);
  if (auto x = absl::GetFlag(FLAGS_cake_tau1)) policy.set_cake_tau1(*x);
  if (auto x = absl::GetFlag(FLAGS_cake_tau2)) policy.set_cake_tau2(*x);
  if (auto x = absl::GetFlag(FLAGS_cake_gamma)) policy.set_cake_gamma(*x);
  v1::Budget budget;
  if (const double cr = absl::GetFlag(FLAGS_compression_ratio); cr >= 0) {
    budget.set_compression_ratio(cr);
  } else {
    budget.set_tokens_per_head(absl::GetFlag(FLAGS_budget));
  }
  LAPROX_ASSIGN_OR_RETURN(kernels::PolicySpec spec, v1::PolicyFromProto(policy, budget));
  LAPROX_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

bool NeedsCrossGrams(const kernels::PolicySpec& policy) {
  return policy.kind == kernels::PolicyKind::kLaprox &&
         policy.EffectiveGqaValue() == kernels::GqaValue::kExactBlock;
}

}  // namespace laprox::cli
