// laprox-cli: talk to laproxd from a shell.
//
//   laprox-cli info                          server version, backend, limits
//   laprox-cli plan DUMP.safetensors         keep-plan of a KV dump, as a budget table
//   laprox-cli demo [--save=FILE] [--device] generate a realistic sample, plan it, print the table
//   laprox-cli health [--service=NAME]       exit 0 when the grpc.health.v1 service says SERVING
//
// Common flags: --target (default: DefaultTarget()), --budget (tokens per KV head),
// --compression_ratio, --json (print {"counts","kept","layer_sums"}, and "kept_blocks" per unit
// and "block_size" for a block shape), --local (compute
// in-process with the CPU backend instead of asking laproxd; the same library the server runs),
// --device (plan and demo: put the tensors in GPU memory and share them with a CUDA laproxd as
// cuda_ipc regions instead of POSIX shared memory; needs a GPU, a CUDA build of this tool and a
// laproxd on the cuda backend).
//
// Policy flags, one per field of laprox.v1 Policy (laprox.proto documents each; a flag not given
// leaves its field unset, so the policy kind's default or the preset applies): enums by their
// lower-case value names without the enum prefix, --kind (or --policy) laprox|streaming_llm|
// snapkv|pyramidkv|adakv|criticalkv|critical_adakv|cake, --allocation, --indicator,
// --gqa_value (e.g. exact_block), --pool_target, --preset (default|paper), --pooling,
// --numeric_mode, --plan_shape (ragged|layer_uniform|blocks_shared|blocks_per_layer); numbers
// --block_size, --window, --pool_kernel, --sinks, --min_per_head, --max_layer_share,
// --pyramid_beta, --alpha_safeguard, --epsilon, --first_stage_ratio, --cake_tau1, --cake_tau2,
// --cake_gamma;
// --head_uniform_layers. A value that is not a name of its enum is an error naming the flag and
// the accepted names.
//
// A dump holds layers.{l}.keys [Hkv,n,d], layers.{l}.values [Hkv,n,d],
// layers.{l}.window_queries [H,w,d] (or layers.{l}.window_attention [H,w,n]; optionally
// layers.{l}.window_lse [H,w] with the queries), layers.{l}.o_proj [D,H*d] (F32, F16 or BF16), and
// the geometry as JSON in the metadata key "laprox.geometry" ({"num_layers":..,"num_heads":..,
// "num_kv_heads":..,"head_dim":..,"hidden_size":..}) or in the file given by --geometry.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/safetensors.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "laprox/client/client.h"
#include "laprox/kernels/openblas_core.h"
#include "laprox/kernels/registry.h"
#include "laprox/v1/laprox.pb.h"
#include "laprox/v1/policy_wire.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle that signed laproxd's TLS certificate (a --target host:port with TLS)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain, for mutual TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, target, laprox::client::DefaultTarget(),
          "laproxd address (default: laproxd's own default socket for this user)");
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
ABSL_FLAG(std::optional<std::string>, pooling, std::nullopt, "avg|max|none");
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
          "LAPROX: spread each layer's share evenly over its heads");
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
ABSL_FLAG(bool, json, false, "print the plan as JSON");
ABSL_FLAG(bool, local, false, "compute in-process (CPU backend) instead of asking laproxd");
ABSL_FLAG(std::string, geometry, "", "JSON file with the geometry (else the dump's metadata)");
ABSL_FLAG(std::string, save, "", "demo: also write the generated sample to this safetensors file");
ABSL_FLAG(std::string, shm_name, "", "shared-memory name for the upload (default per process)");
ABSL_FLAG(bool, device, false,
          "plan/demo: upload the tensors to GPU memory and register them as a cuda_ipc region "
          "(needs a GPU and laproxd --backend=cuda) instead of shared memory");
ABSL_FLAG(std::string, service, "",
          "health: the service to ask about (\"\" = the server; laprox.v1.Laprox = ready)");

namespace laprox::cli {
namespace {

using nlohmann::json;

struct Dump {
  kernels::ModelGeometry geometry;
  int64_t n = 0;
  SafeTensorsFile file;
  const SafeTensor& Get(int layer, const char* what) const {
    return file.tensors.at(absl::StrCat("layers.", layer, ".", what));
  }
  const SafeTensor* Find(int layer, const char* what) const {
    auto it = file.tensors.find(absl::StrCat("layers.", layer, ".", what));
    return it == file.tensors.end() ? nullptr : &it->second;
  }
};

absl::StatusOr<Dump> LoadDump(SafeTensorsFile file) {
  Dump dump;
  std::string geometry_text;
  if (!absl::GetFlag(FLAGS_geometry).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_geometry));
    if (!in) return absl::NotFoundError("cannot open " + absl::GetFlag(FLAGS_geometry));
    std::getline(in, geometry_text, '\0');
  } else if (auto it = file.metadata.find("laprox.geometry"); it != file.metadata.end()) {
    geometry_text = it->second;
  } else {
    return absl::InvalidArgumentError(
        "no geometry: give --geometry=FILE or metadata \"laprox.geometry\"");
  }
  const json g = json::parse(geometry_text, nullptr, false);
  if (g.is_discarded()) return absl::InvalidArgumentError("the geometry is not valid JSON");
  dump.geometry = {g.value("num_layers", 0),   g.value("num_heads", 0),
                   g.value("num_kv_heads", 0), g.value("head_dim", 0),
                   g.value("hidden_size", 0),  g.value("softmax_scale", 0.f)};
  if (absl::Status s = dump.geometry.Validate(); !s.ok()) return s;
  dump.file = std::move(file);
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    for (const char* what : {"keys", "values", "o_proj"}) {
      if (dump.Find(l, what) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("the dump lacks layers.", l, ".", what));
      }
    }
    if (dump.Find(l, "window_queries") == nullptr && dump.Find(l, "window_attention") == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("the dump lacks layers.", l, ".window_queries (or .window_attention)"));
    }
  }
  const auto& keys = dump.Get(0, "keys").shape;
  if (keys.size() != 3) return absl::InvalidArgumentError("layers.0.keys is not [Hkv, n, d]");
  dump.n = keys[1];
  return dump;
}

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

// The policy the flags describe, resolved as laproxd resolves a request (v1::PolicyFromProto:
// the kind's defaults, every flag that is set, then the preset), and validated.
absl::StatusOr<kernels::PolicySpec> Policy() {
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

// EXACT_BLOCK needs the model's cross-Grams (PrepareOptions::cross_grams).
bool NeedsCrossGrams(const kernels::PolicySpec& policy) {
  return policy.kind == kernels::PolicyKind::kLaprox &&
         policy.EffectiveGqaValue() == kernels::GqaValue::kExactBlock;
}

// In-process: views straight over the loaded bytes.
absl::StatusOr<kernels::KeepPlan> PlanLocal(const Dump& dump) {
  auto backend = kernels::CreateBackend("cpu");
  if (!backend.ok()) return backend.status();
  auto view = [](const SafeTensor& t) {
    return kernels::TensorView(t.bytes.data(), t.dtype,
                               kernels::Dims(t.shape.begin(), t.shape.end()));
  };
  std::vector<kernels::TensorView> o_proj;
  kernels::KeepPlanRequest request;
  request.n = dump.n;
  auto policy = Policy();
  if (!policy.ok()) return policy.status();
  request.policy = *policy;
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    o_proj.push_back(view(dump.Get(l, "o_proj")));
    kernels::LayerInputs& in = request.layers.emplace_back();
    in.keys = view(dump.Get(l, "keys"));
    in.values = view(dump.Get(l, "values"));
    if (const SafeTensor* t = dump.Find(l, "window_attention")) {
      in.window_attention = view(*t);
    } else {
      in.window_queries = view(dump.Get(l, "window_queries"));
      if (const SafeTensor* lse = dump.Find(l, "window_lse")) in.window_lse = view(*lse);
    }
  }
  kernels::PrepareOptions options;
  options.cross_grams = NeedsCrossGrams(*policy);
  auto model = (*backend)->PrepareModel(dump.geometry, o_proj, options);
  if (!model.ok()) return model.status();
  return (*backend)->ComputeKeepPlan(**model, request);
}

// The dump's tensors in one device allocation, registered with laproxd as a cuda_ipc region.
struct DeviceUpload {
  client::DeviceAllocation memory;
  uint64_t region_id = 0;
};

absl::StatusOr<DeviceUpload> UploadToDevice(client::Client& server, const Dump& dump,
                                            const std::map<std::string, int64_t>& offsets,
                                            size_t total) {
  auto with_context = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("--device: ", s.message()));
  };
  if (!client::CudaExportBuilt()) {
    return absl::UnimplementedError(
        "--device: this laprox-cli was built without CUDA; drop --device to use shared memory");
  }
  auto info = server.GetServerInfo();
  if (!info.ok()) return info.status();
  if (!info->cuda_ipc) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device: laproxd runs the ", info->backend,
        " backend, which cannot read GPU memory; start it with --backend=cuda or drop --device"));
  }
  auto memory = client::DeviceAllocation::Allocate(total);
  if (!memory.ok()) return with_context(memory.status());
  for (const auto& [name, t] : dump.file.tensors) {
    if (absl::Status s = memory->CopyFromHost(offsets.at(name), t.bytes.data(), t.bytes.size());
        !s.ok()) {
      return with_context(s);
    }
  }
  auto exported = client::ExportCudaBuffer(memory->data(), static_cast<int64_t>(total));
  if (!exported.ok()) return with_context(exported.status());
  auto id = server.RegisterCudaIpcRegion(*exported);
  if (!id.ok()) return with_context(id.status());
  return DeviceUpload{*std::move(memory), *id};
}

// The client of --target, over TLS when any --tls_* flag is given.
absl::StatusOr<std::unique_ptr<client::Client>> Connect() {
  client::ClientOptions options;
  const std::string ca = absl::GetFlag(FLAGS_tls_ca_file),
                    cert = absl::GetFlag(FLAGS_tls_cert_file),
                    key = absl::GetFlag(FLAGS_tls_key_file);
  if (!ca.empty() || !cert.empty() || !key.empty()) {
    LAPROX_ASSIGN_OR_RETURN(options.tls, client::TlsOptionsFromFiles(ca, cert, key));
  }
  return client::Client::Connect(absl::GetFlag(FLAGS_target), options);
}

// Through laproxd: every tensor is copied once into one shared buffer (or, with --device, one
// device allocation) and sent by reference.
absl::StatusOr<kernels::KeepPlan> PlanRemote(const Dump& dump) {
  auto policy = Policy();
  if (!policy.ok()) return policy.status();
  auto client = Connect();
  if (!client.ok()) return client.status();
  size_t total = 0;
  std::map<std::string, int64_t> offsets;
  for (const auto& [name, t] : dump.file.tensors) {
    offsets[name] = static_cast<int64_t>(total);
    total += (t.bytes.size() + 63) / 64 * 64;
  }
  uint64_t region_id = 0;
  std::optional<client::SharedBuffer> buffer;
  std::optional<DeviceUpload> device;
  // Destroyed before `device`: the server closes the region before its memory is freed.
  struct UnregisterOnExit {
    client::Client* client = nullptr;
    uint64_t region_id = 0;
    ~UnregisterOnExit() {
      if (client != nullptr) client->UnregisterRegion(region_id).IgnoreError();
    }
  } unregister_device;
  if (absl::GetFlag(FLAGS_device)) {
    auto upload = UploadToDevice(**client, dump, offsets, total);
    if (!upload.ok()) return upload.status();
    device.emplace(*std::move(upload));
    region_id = device->region_id;
    unregister_device.client = client->get();
    unregister_device.region_id = region_id;
  } else {
    std::string shm = absl::GetFlag(FLAGS_shm_name);
    if (shm.empty()) shm = absl::StrCat("laprox-cli-", getpid());
    auto shared = (*client)->ShareHostBuffer(shm, total);
    if (!shared.ok()) return shared.status();
    for (const auto& [name, t] : dump.file.tensors) {
      std::memcpy(shared->data() + offsets.at(name), t.bytes.data(), t.bytes.size());
    }
    region_id = shared->region_id();
    buffer.emplace(*std::move(shared));
  }
  auto ref = [&](int l, const char* what) {
    const std::string name = absl::StrCat("layers.", l, ".", what);
    const SafeTensor& t = dump.file.tensors.at(name);
    return client::TensorRef::InRegion(region_id, offsets.at(name), t.dtype, t.shape);
  };
  std::vector<client::TensorRef> o_proj;
  std::vector<client::LayerRefs> layers;
  for (int l = 0; l < dump.geometry.num_layers; ++l) {
    o_proj.push_back(ref(l, "o_proj"));
    client::LayerRefs& in = layers.emplace_back();
    in.keys = ref(l, "keys");
    in.values = ref(l, "values");
    if (dump.Find(l, "window_attention") != nullptr) {
      in.window_attention = ref(l, "window_attention");
    } else {
      in.window_queries = ref(l, "window_queries");
      if (dump.Find(l, "window_lse") != nullptr) in.window_lse = ref(l, "window_lse");
    }
  }
  auto model =
      (*client)->RegisterModel("laprox-cli", dump.geometry, o_proj, NeedsCrossGrams(*policy));
  if (!model.ok()) return model.status();
  auto plan = (*client)->ComputeKeepPlan(*model, dump.n, layers, *policy);
  (*client)->UnregisterModel(*model).IgnoreError();
  return plan;
}

void PrintJson(const kernels::KeepPlan& plan) {
  json counts = json::array(), kept = json::array();
  for (int l = 0; l < plan.num_layers; ++l) {
    json c = json::array(), k = json::array();
    for (int h = 0; h < plan.num_kv_heads; ++h) {
      c.push_back(plan.count(l, h));
      auto positions = plan.kept(l, h);
      k.push_back(std::vector<int32_t>(positions.begin(), positions.end()));
    }
    counts.push_back(c);
    kept.push_back(k);
  }
  json out = {{"counts", counts}, {"kept", kept}, {"layer_sums", plan.layer_sums}};
  if (plan.blocks) {
    json units = json::array();
    for (int32_t u = 0; u < plan.blocks->units; ++u) {
      const auto blocks = plan.blocks->kept_blocks(u);
      units.push_back(std::vector<int32_t>(blocks.begin(), blocks.end()));
    }
    out["kept_blocks"] = units;
    out["block_size"] = plan.blocks->block_size;
  }
  std::printf("%s\n", out.dump().c_str());
}

// Budget share: kept tokens of each (layer, head) over the uniform share (kept per head on
// average), so 1.00 is "exactly its share"; the last column is the layer's mean.
void PrintTable(const kernels::KeepPlan& plan) {
  const double uniform = plan.window + plan.sinks + static_cast<double>(plan.quota);
  std::printf("n=%lld window=%d sinks=%d uniform share=%.0f tokens per head\n",
              static_cast<long long>(plan.n), plan.window, plan.sinks, uniform);
  std::printf("layer  budget share per KV head%*s| layer\n", plan.num_kv_heads * 6 - 24, "");
  for (int l = 0; l < plan.num_layers; ++l) {
    double sum = 0;
    std::printf("%5d ", l);
    for (int h = 0; h < plan.num_kv_heads; ++h) {
      const double share = plan.count(l, h) / uniform;
      sum += share;
      std::printf(" %5.2f", share);
    }
    std::printf(" | %5.2f\n", sum / plan.num_kv_heads);
  }
}

// A sample with the structure of real prefills: attention sinks at the first positions, a few
// heavy-hitter tokens the window queries attend to, value norms growing with depth. It has 64
// window query rows, so that every policy's default window fits.
SafeTensorsFile MakeDemo() {
  constexpr int L = 8, H = 9, Hkv = 3, d = 64, D = 576, w = 64;
  constexpr int64_t n = 2048;
  std::mt19937 rng(20261130);
  std::normal_distribution<float> normal(0.f, 1.f);
  SafeTensorsFile file;
  file.metadata["laprox.geometry"] = json{
      {"num_layers", L},
      {"num_heads", H},
      {"num_kv_heads", Hkv},
      {"head_dim", d},
      {"hidden_size", D}}.dump();
  auto tensor = [](std::vector<int64_t> shape, const std::vector<float>& values) {
    SafeTensor t;
    t.dtype = kernels::DType::kBF16;
    t.shape = std::move(shape);
    t.bytes.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t b = kernels::FloatToBf16(values[i]);
      std::memcpy(&t.bytes[i * 2], &b, 2);
    }
    return t;
  };
  for (int l = 0; l < L; ++l) {
    std::vector<float> keys(Hkv * n * d), values(Hkv * n * d), queries(H * w * d),
        o_proj(D * H * d);
    for (float& x : keys) x = normal(rng);
    for (float& x : queries) x = normal(rng) * 0.5f;
    for (float& x : o_proj) x = normal(rng) * 0.04f;
    const float value_scale = 1.f + 2.f * l / L;
    for (float& x : values) x = normal(rng) * value_scale;
    std::uniform_int_distribution<int64_t> position(8, n - w - 1);
    for (int g = 0; g < Hkv; ++g) {
      // Sinks and heavy hitters: keys aligned with the group's last query (inside every window).
      std::vector<int64_t> special = {0, 1, 2, 3};
      for (int i = 0; i < 12 + 4 * l; ++i) special.push_back(position(rng));
      for (int64_t p : special) {
        for (int k = 0; k < d; ++k) {
          keys[(g * n + p) * d + k] = queries[(g * 3 * w + w - 1) * d + k] * 4;
        }
      }
    }
    file.tensors[absl::StrCat("layers.", l, ".keys")] = tensor({Hkv, n, d}, keys);
    file.tensors[absl::StrCat("layers.", l, ".values")] = tensor({Hkv, n, d}, values);
    file.tensors[absl::StrCat("layers.", l, ".window_queries")] = tensor({H, w, d}, queries);
    file.tensors[absl::StrCat("layers.", l, ".o_proj")] = tensor({D, H * d}, o_proj);
  }
  return file;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "laprox-cli: %s\n", status.ToString().c_str());
  return 1;
}

int RunPlan(SafeTensorsFile file) {
  auto dump = LoadDump(std::move(file));
  if (!dump.ok()) return Fail(dump.status());
  if (absl::GetFlag(FLAGS_local) && absl::GetFlag(FLAGS_device)) {
    return Fail(absl::InvalidArgumentError("--device and --local exclude each other"));
  }
  auto plan = absl::GetFlag(FLAGS_local) ? PlanLocal(*dump) : PlanRemote(*dump);
  if (!plan.ok()) return Fail(plan.status());
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(*plan);
  } else {
    PrintTable(*plan);
  }
  return 0;
}

constexpr char kUsage[] =
    "laprox-cli info | plan DUMP.safetensors | demo [--save=FILE] [--device] | health "
    "[--service=NAME]";

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage;  // --help lists this file's flags
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "cli/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string command = args.size() > 1 ? args[1] : "";
  if (command == "info") {
    auto client = Connect();
    if (!client.ok()) return Fail(client.status());
    auto info = (*client)->GetServerInfo();
    if (!info.ok()) return Fail(info.status());
    std::printf("laproxd %s, %s, max n %lld, %d regions, %d models\n", info->version.c_str(),
                info->backend_description.c_str(), static_cast<long long>(info->max_tokens),
                info->max_regions, info->max_models);
    return 0;
  }
  if (command == "health") {  // exit 0 when SERVING: for container HEALTHCHECKs and scripts
    auto serving =
        laprox::client::CheckHealth(absl::GetFlag(FLAGS_target), absl::GetFlag(FLAGS_service));
    if (!serving.ok()) return Fail(serving.status());
    std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
    return *serving ? 0 : 1;
  }
  if (command == "plan" && args.size() == 3) {
    auto file = ReadSafeTensors(args[2]);
    if (!file.ok()) return Fail(file.status());
    return RunPlan(*std::move(file));
  }
  if (command == "demo") {
    SafeTensorsFile file = MakeDemo();
    if (const std::string save = absl::GetFlag(FLAGS_save); !save.empty()) {
      if (absl::Status s = WriteSafeTensors(save, file); !s.ok()) return Fail(s);
    }
    return RunPlan(std::move(file));
  }
  std::fprintf(stderr, "usage: %s\n", kUsage);
  return 2;
}

}  // namespace
}  // namespace laprox::cli

int main(int argc, char** argv) {
  // --local computes here: with the OpenBLAS kernels laproxd runs (the same bits).
  laprox::kernels::RestartWithOpenBlasCore("laprox-cli", argv);
  try {
    return laprox::cli::Main(argc, argv);
  } catch (const std::exception& e) {  // nlohmann::json reports malformed dumps by throwing
    std::fprintf(stderr, "laprox-cli: %s\n", e.what());
    return 1;
  }
}
