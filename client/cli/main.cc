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
//
// This file holds the commands and the connection flags; policy_flags.h turns the policy flags
// into a PolicySpec, dump.h reads a dump (and makes the demo sample), plan.h computes the plan
// locally or through laproxd, output.h prints it.
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cli/dump.h"
#include "client/cli/output.h"
#include "client/cli/plan.h"
#include "client/cli/policy_flags.h"
#include "client/cli/safetensors.h"
#include "common/status_macros.h"
#include "laprox/client/client.h"
#include "laprox/kernels/openblas_core.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle that signed laproxd's TLS certificate (a --target host:port with TLS)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain, for mutual TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, target, laprox::client::DefaultTarget(),
          "laproxd address (default: laproxd's own default socket for this user)");
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

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "laprox-cli: %s\n", status.ToString().c_str());
  return 1;
}

int RunPlan(SafeTensorsFile file) {
  auto dump = LoadDump(std::move(file), absl::GetFlag(FLAGS_geometry));
  if (!dump.ok()) return Fail(dump.status());
  if (absl::GetFlag(FLAGS_local) && absl::GetFlag(FLAGS_device)) {
    return Fail(absl::InvalidArgumentError("--device and --local exclude each other"));
  }
  auto policy = PolicyFromFlags();
  if (!policy.ok()) return Fail(policy.status());
  absl::StatusOr<kernels::KeepPlan> plan;
  if (absl::GetFlag(FLAGS_local)) {
    plan = PlanLocal(*dump, *policy);
  } else {
    auto client = Connect();
    if (!client.ok()) return Fail(client.status());
    std::string shm = absl::GetFlag(FLAGS_shm_name);
    if (shm.empty()) shm = absl::StrCat("laprox-cli-", getpid());
    plan = PlanRemote(**client, *dump, *policy, absl::GetFlag(FLAGS_device), shm);
  }
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
  absl::FlagsUsageConfig usage;  // --help lists laprox-cli's flags (those of client/cli/)
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/cli/");
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
    const int rc = RunPlan(std::move(file));
    if (rc == 0 && !absl::GetFlag(FLAGS_json)) {
      std::printf(
          "next: your own KV dump (laprox-cli plan DUMP.safetensors), or laprox inside an engine: "
          "docs/integrations/hf.md (transformers), docs/integrations/vllm.md (vLLM)\n");
    }
    return rc;
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
