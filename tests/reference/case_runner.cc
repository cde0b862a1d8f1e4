// laprox_case_runner CASE_DIR...: runs the C++ backend on reference-comparison cases.
//
// For each directory it reads case.json and the .npy tensors it names (the format is described
// in tests/reference/laprox_ref.py), builds strided views over them exactly as described there
// (slice_last, then permute), prepares the model, computes the keep-plan with every output, and
// writes cpp_counts.npy, cpp_kept.npy, cpp_bitmask.npy, cpp_scores.npy, cpp_layer_sums.npy and
// cpp_meta.json — or cpp_error.json {"code", "message"} when the backend rejects the case.
// Baseline policies ("kind" and their fields, see laprox_ref.py) start from the kind's defaults.
// Paged tensor references ("paged" with a table index into case.json "block_tables", see
// laprox_ref.py) become TensorView::Paged views over the pool file; a block-shaped plan also
// writes cpp_blocks.json (KeepPlan::blocks but its scores) and cpp_block_scores.npy.
// Driven by compare_test.py; LAPROX_CASE_THREADS sets the worker count (default 2),
// LAPROX_CASE_WINDOW_BYTES BackendOptions::cpu_window_bytes.
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/registry.h"
#include "npy.h"

namespace laprox::testing {
namespace {

using kernels::DType;
using kernels::TensorView;
using nlohmann::json;

template <typename Enum>
absl::Status ParseEnum(const json& j, const char* key, const std::map<std::string, Enum>& names,
                       Enum* out) {
  if (!j.contains(key)) return absl::OkStatus();
  const std::string value = j.at(key).get<std::string>();
  auto it = names.find(value);
  if (it == names.end()) return absl::InvalidArgumentError(absl::StrCat(key, "=", value));
  *out = it->second;
  return absl::OkStatus();
}

// An optional field: left unset when the key is missing or null.
template <typename Enum>
absl::Status ParseOptionalEnum(const json& j, const char* key,
                               const std::map<std::string, Enum>& names, std::optional<Enum>* out) {
  if (!j.contains(key) || j.at(key).is_null()) return absl::OkStatus();
  Enum value{};
  absl::Status s = ParseEnum(j, key, names, &value);
  if (s.ok()) *out = value;
  return s;
}

absl::StatusOr<kernels::PolicySpec> ParsePolicy(const json& p) {
  using kernels::Allocation;
  using kernels::GqaValue;
  using kernels::Indicator;
  using kernels::NumericMode;
  using kernels::PolicyKind;
  using kernels::Pooling;
  // The kind first: unset fields take its defaults.
  PolicyKind kind = PolicyKind::kLaprox;
  absl::Status s = ParseEnum<PolicyKind>(p, "kind",
                                         {{"LAPROX", PolicyKind::kLaprox},
                                          {"STREAMING_LLM", PolicyKind::kStreamingLlm},
                                          {"SNAPKV", PolicyKind::kSnapKv},
                                          {"PYRAMIDKV", PolicyKind::kPyramidKv},
                                          {"ADAKV", PolicyKind::kAdaKv},
                                          {"CRITICALKV", PolicyKind::kCriticalKv},
                                          {"CRITICAL_ADAKV", PolicyKind::kCriticalAdaKv},
                                          {"CAKE", PolicyKind::kCake}},
                                         &kind);
  if (!s.ok()) return s;
  kernels::PolicySpec spec = kernels::PolicySpec::ForKind(kind);
  s.Update(ParseEnum<NumericMode>(
      p, "numeric_mode",
      {{"EXACT", NumericMode::kExact}, {"KVPRESS_COMPAT", NumericMode::kKvpressCompat}},
      &spec.numeric_mode));
  s.Update(ParseEnum<Allocation>(p, "allocation",
                                 {{"GLOBAL_NORMALIZED", Allocation::kGlobalNormalized},
                                  {"GLOBAL_RAW", Allocation::kGlobalRaw},
                                  {"PER_LAYER", Allocation::kPerLayer},
                                  {"UNIFORM", Allocation::kUniform}},
                                 &spec.allocation));
  s.Update(
      ParseEnum<Indicator>(p, "indicator",
                           {{"ATTENTION_X_PROJECTED_VALUE", Indicator::kAttentionXProjectedValue},
                            {"ATTENTION_X_VALUE", Indicator::kAttentionXValue},
                            {"ATTENTION", Indicator::kAttention}},
                           &spec.indicator));
  s.Update(ParseOptionalEnum<GqaValue>(p, "gqa_value",
                                       {{"MEAN_HEAD_NORM", GqaValue::kMeanHeadNorm},
                                        {"SUMMED_PROJECTION", GqaValue::kSummedProjection},
                                        {"MEAN_HEAD_PRODUCT", GqaValue::kMeanHeadProduct},
                                        {"EXACT_BLOCK", GqaValue::kExactBlock}},
                                       &spec.gqa_value));
  s.Update(ParseEnum<Pooling>(p, "pooling",
                              {{"AVG", Pooling::kAvg},
                               {"MAX", Pooling::kMax},
                               {"NONE", Pooling::kNone},
                               {"AVG_PEAK", Pooling::kAvgPeak}},
                              &spec.pooling));
  s.Update(ParseOptionalEnum<kernels::PoolTarget>(
      p, "pool_target",
      {{"ATTENTION", kernels::PoolTarget::kAttention}, {"SCORE", kernels::PoolTarget::kScore}},
      &spec.pool_target));
  std::optional<kernels::PlanShape> shape;
  s.Update(ParseOptionalEnum<kernels::PlanShape>(
      p, "plan_shape",
      {{"RAGGED", kernels::PlanShape::kRagged},
       {"LAYER_UNIFORM", kernels::PlanShape::kLayerUniform},
       {"BLOCKS_SHARED", kernels::PlanShape::kBlocksShared},
       {"BLOCKS_PER_LAYER", kernels::PlanShape::kBlocksPerLayer}},
      &shape));
  if (!s.ok()) return s;
  spec.plan_shape = shape.value_or(kernels::PlanShape::kRagged);
  if (p.contains("block_size") && !p.at("block_size").is_null()) {
    spec.block_size = p.at("block_size").get<int32_t>();
  }
  spec.window = p.value("window", spec.window);
  spec.pool_kernel = p.value("pool_kernel", spec.pool_kernel);
  spec.sinks = p.value("sinks", spec.sinks);
  spec.min_per_head = p.value("min_per_head", spec.min_per_head);
  spec.head_uniform_layers = p.value("head_uniform_layers", false);
  if (p.contains("max_layer_share") && !p.at("max_layer_share").is_null()) {
    spec.max_layer_share = p.at("max_layer_share").get<double>();
  }
  kernels::BaselineParams& b = spec.baseline;
  for (auto [key, field] : {std::pair{"pyramid_beta", &b.pyramid_beta},
                            {"alpha_safeguard", &b.alpha_safeguard},
                            {"epsilon", &b.epsilon},
                            {"first_stage_ratio", &b.first_stage_ratio},
                            {"cake_tau1", &b.cake_tau1},
                            {"cake_tau2", &b.cake_tau2},
                            {"cake_gamma", &b.cake_gamma}}) {
    *field = p.value(key, *field);
  }
  if (p.contains("compression_ratio") && !p.at("compression_ratio").is_null()) {
    spec.budget = kernels::Budget::CompressionRatio(p.at("compression_ratio").get<double>());
  } else {
    spec.budget = kernels::Budget::TokensPerHead(p.at("tokens_per_head").get<int64_t>());
  }
  return spec;
}

// Owns the loaded files and block tables; views point into them.
class CaseTensors {
 public:
  // The case's "block_tables" (may be absent), before any Load.
  absl::Status LoadTables(const json& c) {
    if (!c.contains("block_tables") || c.at("block_tables").is_null()) return absl::OkStatus();
    for (const json& t : c.at("block_tables")) {
      auto table = kernels::BlockTable::Create(t.at("ids").get<std::vector<int32_t>>(),
                                               t.at("block_size").get<int64_t>());
      if (!table.ok()) return table.status();
      tables_.push_back(std::make_unique<kernels::BlockTable>(*std::move(table)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TensorView> Load(const std::string& dir, const json& ref) {
    if (ref.is_null()) return TensorView();
    auto array = ReadNpy(dir + "/" + ref.at("file").get<std::string>());
    if (!array.ok()) return array.status();
    const std::string dtype = ref.at("dtype").get<std::string>();
    DType type = DType::kF32;
    if (dtype == "f16") type = DType::kF16;
    if (dtype == "bf16") type = DType::kBF16;
    if (ref.contains("paged") && !ref.at("paged").is_null()) {
      // The pool file in C order; the layout's strides are in elements from its start.
      const json& paged = ref.at("paged");
      const size_t table = paged.at("table").get<size_t>();
      if (table >= tables_.size()) return absl::InvalidArgumentError("no such block table");
      kernels::PagedLayout layout{tables_[table].get(), paged.at("block_stride").get<int64_t>(),
                                  paged.at("slot_stride").get<int64_t>(),
                                  paged.at("head_stride").get<int64_t>(),
                                  paged.at("dim_stride").get<int64_t>()};
      const int64_t offset = paged.value("offset", int64_t{0});
      storage_.push_back(std::make_unique<NpyArray>(std::move(array).value()));
      const char* data = storage_.back()->bytes.data() + offset * kernels::DTypeSize(type);
      return TensorView::Paged(data, type, ref.at("shape").get<kernels::Dims>(), layout);
    }
    kernels::Dims shape(array->shape.begin(), array->shape.end());
    kernels::Dims strides = kernels::ContiguousStrides(shape);
    if (ref.contains("slice_last") && !ref.at("slice_last").is_null()) {
      shape.back() = ref.at("slice_last").get<int64_t>();
    }
    if (ref.contains("permute") && !ref.at("permute").is_null()) {
      const auto perm = ref.at("permute").get<std::vector<int>>();
      kernels::Dims s2, t2;
      for (int axis : perm) {
        s2.push_back(shape[axis]);
        t2.push_back(strides[axis]);
      }
      shape = s2;
      strides = t2;
    }
    storage_.push_back(std::make_unique<NpyArray>(std::move(array).value()));
    return TensorView(storage_.back()->bytes.data(), type, shape, strides);
  }

 private:
  std::vector<std::unique_ptr<NpyArray>> storage_;
  std::vector<std::unique_ptr<kernels::BlockTable>> tables_;
};

absl::Status WriteJson(const std::string& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(1);
  return out ? absl::OkStatus() : absl::InternalError("cannot write " + path);
}

// cpp_blocks.json and cpp_block_scores.npy: a block-shaped plan's KeepPlan::blocks.
absl::Status WriteBlocks(const std::string& dir, const kernels::BlockPlan& b) {
  absl::Status s = WriteJson(dir + "/cpp_blocks.json", {{"block_size", b.block_size},
                                                        {"num_blocks", b.num_blocks},
                                                        {"units", b.units},
                                                        {"offsets", b.offsets},
                                                        {"kept", b.kept},
                                                        {"paged", b.paged()},
                                                        {"new_table", b.new_table},
                                                        {"freed_offsets", b.freed_offsets},
                                                        {"freed", b.freed}});
  if (!b.scores.empty()) {
    s.Update(WriteNpy(dir + "/cpp_block_scores.npy", "<f8", {b.units, b.num_blocks},
                      b.scores.data(), b.scores.size() * 8));
  }
  return s;
}

absl::Status RunCase(const std::string& dir, kernels::Backend& backend) {
  std::ifstream in(dir + "/case.json");
  if (!in) return absl::NotFoundError("no case.json in " + dir);
  const json c = json::parse(in);
  const json& g = c.at("geometry");
  kernels::ModelGeometry geometry;
  geometry.num_layers = g.at("L");
  geometry.num_heads = g.at("H");
  geometry.num_kv_heads = g.at("Hkv");
  geometry.head_dim = g.at("d");
  geometry.hidden_size = g.at("D");
  geometry.softmax_scale = g.at("scale");

  auto policy = ParsePolicy(c.at("policy"));
  if (!policy.ok()) return policy.status();
  kernels::KeepPlanRequest request;
  request.n = c.at("n");
  request.policy = *policy;
  request.outputs = {.positions = true, .bitmask = true, .scores = true};

  CaseTensors tensors;
  if (absl::Status s = tensors.LoadTables(c); !s.ok()) {
    return WriteJson(dir + "/cpp_error.json",
                     {{"code", absl::StatusCodeToString(s.code())}, {"message", s.message()}});
  }
  std::vector<TensorView> o_proj;
  for (const json& layer : c.at("layers")) {
    kernels::LayerInputs in_layer;
    auto load = [&](const char* key, TensorView* view) -> absl::Status {
      if (!layer.contains(key)) return absl::OkStatus();
      auto v = tensors.Load(dir, layer.at(key));
      if (!v.ok()) return v.status();
      *view = *v;
      return absl::OkStatus();
    };
    TensorView o;
    absl::Status s;
    s.Update(load("keys", &in_layer.keys));
    s.Update(load("values", &in_layer.values));
    s.Update(load("queries", &in_layer.window_queries));
    s.Update(load("attention", &in_layer.window_attention));
    s.Update(load("lse", &in_layer.window_lse));
    s.Update(load("o_proj", &o));
    if (!s.ok()) return s;
    request.layers.push_back(in_layer);
    o_proj.push_back(o);
  }

  kernels::PrepareOptions options;
  options.cross_grams = request.policy.gqa_value == kernels::GqaValue::kExactBlock;
  absl::StatusOr<kernels::KeepPlan> plan;
  auto model = backend.PrepareModel(geometry, o_proj, options);
  if (model.ok()) {
    plan = backend.ComputeKeepPlan(**model, request);
  } else {
    plan = model.status();
  }
  if (!plan.ok()) {
    return WriteJson(dir + "/cpp_error.json",
                     {{"code", absl::StatusCodeToString(plan.status().code())},
                      {"message", plan.status().message()}});
  }
  const int64_t L = plan->num_layers, Hkv = plan->num_kv_heads, n = plan->n;
  std::vector<uint8_t> kept(L * Hkv * n, 0);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int32_t pos : plan->kept(l, h)) kept[(l * Hkv + h) * n + pos] = 1;
    }
  }
  absl::Status s;
  s.Update(WriteNpy(dir + "/cpp_counts.npy", "<i4", {L, Hkv}, plan->counts.data(),
                    plan->counts.size() * 4));
  s.Update(WriteNpy(dir + "/cpp_kept.npy", "|u1", {L, Hkv, n}, kept.data(), kept.size()));
  s.Update(WriteNpy(dir + "/cpp_bitmask.npy", "|u1", {L, Hkv, (n + 7) / 8}, plan->bitmask.data(),
                    plan->bitmask.size()));
  s.Update(WriteNpy(dir + "/cpp_scores.npy", "<f4", {L, Hkv, n}, plan->scores.data(),
                    plan->scores.size() * 4));
  s.Update(WriteNpy(dir + "/cpp_layer_sums.npy", "<f8", {L}, plan->layer_sums.data(),
                    plan->layer_sums.size() * 8));
  s.Update(WriteJson(dir + "/cpp_meta.json", {{"quota", plan->quota},
                                              {"total_selected", plan->selected_total},
                                              {"window", plan->window},
                                              {"sinks", plan->sinks}}));
  if (plan->blocks.has_value()) s.Update(WriteBlocks(dir, *plan->blocks));
  return s;
}

}  // namespace
}  // namespace laprox::testing

int main(int argc, char** argv) {
  laprox::kernels::BackendOptions options;
  if (const char* threads = std::getenv("LAPROX_CASE_THREADS")) {
    options.threads = std::atoi(threads);
  }
  // A small budget makes LAPROX compute the window rows in several ranges (one row each at 1).
  if (const char* bytes = std::getenv("LAPROX_CASE_WINDOW_BYTES")) {
    options.cpu_window_bytes = std::atoll(bytes);
  }
  auto backend = laprox::kernels::CreateBackend("cpu", options);
  if (!backend.ok()) {
    std::cerr << backend.status() << "\n";
    return 1;
  }
  int failures = 0;
  for (int i = 1; i < argc; ++i) {
    absl::Status s;
    try {
      s = laprox::testing::RunCase(argv[i], **backend);
    } catch (const std::exception& e) {  // nlohmann::json reports malformed case files by throwing
      s = absl::InvalidArgumentError(e.what());
    }
    if (!s.ok()) {
      std::cerr << argv[i] << ": " << s << "\n";
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}
