// laproxd: the laprox sidecar. Serves laprox.v1.Laprox, the standard grpc.health.v1 service and
// server reflection on a Unix domain socket (mode 0660; by default where the clients look:
// proto/endpoint/laprox/v1/endpoint.h), TCP only when asked for;
// Prometheus metrics over HTTP on --metrics_listen; optionally grpc.health.v1 alone on a TCP
// port (--health_listen) for Kubernetes probes. Every flag can also be set through the
// environment as LAPROXD_<FLAG> (LAPROXD_METRICS_LISTEN=...); the command line wins.
// SIGTERM or SIGINT stops accepting calls, lets in-flight calls finish for --shutdown_timeout,
// then cancels them, and exits 0. A live socket is never taken over (see socket_path.h).
//
//   laproxd --socket=/run/laprox/laproxd.sock --backend=cpu --threads=2
//   laproxd --listen=127.0.0.1:50051        # the whole API over TCP too
//   laproxd --health_listen=0.0.0.0:9465 --metrics_listen=0.0.0.0:9464   # in a pod
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "laprox/kernels/openblas_core.h"
#include "laprox/v1/endpoint.h"
#include "service/grpc/peer_identity.h"
#include "service/server.h"

ABSL_FLAG(std::string, socket, "auto",
          "Unix domain socket to listen on, created with --socket_mode (its directory with mode "
          "0750 when missing); auto: $XDG_RUNTIME_DIR/laprox/laproxd.sock when not root and "
          "XDG_RUNTIME_DIR is an absolute path, else /run/laprox/laproxd.sock (the clients' "
          "default too: laprox/v1/endpoint.h); empty to disable. A stale socket "
          "there is replaced; a live one, or anything that is not a socket, stops start-up");
ABSL_FLAG(std::string, socket_mode, "0660",
          "the socket's permission bits, octal (who may connect; see docs/daemon.md, \"The "
          "socket and who can call\")");
ABSL_FLAG(absl::Duration, shutdown_timeout, absl::Seconds(30),
          "after SIGTERM or SIGINT, how long in-flight calls may take before they are cancelled");
ABSL_FLAG(std::string, allowed_uids, "",
          "comma-separated uids that may call over the Unix socket (default: laproxd's own); "
          "uid 0 always may. Others get PERMISSION_DENIED (laprox_denied_calls_total)");
ABSL_FLAG(std::string, allowed_gids, "",
          "comma-separated gids whose members (primary or supplementary group) may call over "
          "the Unix socket (default: laproxd's own gid)");
ABSL_FLAG(bool, shared_models, false,
          "let every allowed caller compute with models any of them registered (only the "
          "registering identity may unregister a model); regions always stay private");
ABSL_FLAG(double, lease_seconds, 30,
          "what a local client registered is unregistered once none of its connections is "
          "open and its process has exited (noticed within 0.2 s), or, for a client whose pid "
          "laproxd cannot see, once it has been disconnected this long; 0 disables reclaiming");
ABSL_FLAG(std::string, listen, "",
          "also serve the whole API on this TCP address (host:port; port 0 picks one and "
          "prints it): TLS with --tls_cert_file/--tls_key_file; plaintext only on a loopback "
          "address unless --allow_insecure_tcp");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain for --listen (with --tls_key_file): the TCP port speaks TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: --listen then requires a client certificate signed by it (mTLS)");
ABSL_FLAG(bool, allow_insecure_tcp, false,
          "let --listen serve plaintext on a non-loopback address (refused otherwise)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "serve Prometheus metrics over HTTP at /metrics on this address (host:port; port 0 "
          "picks one and prints it); empty to disable");
ABSL_FLAG(std::string, health_listen, "",
          "serve only grpc.health.v1 on this TCP address, for probes (host:port; port 0 picks "
          "one and prints it): service \"\" is SERVING while laproxd runs, service "
          "\"laprox.v1.Laprox\" only while a model is registered; both are NOT_SERVING after a "
          "fatal (sticky) CUDA error");
ABSL_FLAG(std::string, backend, "auto", "compute backend: auto, cpu or cuda");
ABSL_FLAG(int, threads, 2, "CPU backend worker threads per request");
ABSL_FLAG(int64_t, cpu_window_mb, 64,
          "CPU backend, LAPROX: MiB of window probabilities a worker thread holds at most; "
          "longer contexts compute the window rows in several passes over the keys");
ABSL_FLAG(int, device, 0, "CUDA device ordinal (cuda backend)");
ABSL_FLAG(std::string, cuda_kernels, "gemm",
          "cuda backend kernels: gemm (cuBLAS GEMMs, radix-sort select) or fused (the fused "
          "kernel, histogram select; requests it cannot take run on gemm); v0 and v1, their "
          "former names, are taken with a deprecation line");
ABSL_FLAG(int, workers, 2, "keep-plan requests computed concurrently (heavy ones aside)");
ABSL_FLAG(int, heavy_workers, 1,
          "keep-plan requests of more work than --heavy_request_work computed concurrently, on "
          "workers of their own (so that small plans never wait behind them); their backlog is "
          "--max_pending too. 0: heavy plans share the --workers queue (small ones can wait "
          "behind them)");
ABSL_FLAG(int64_t, max_request_work, 0,
          "work units (flops plus bytes read, estimated from shapes) one keep-plan call or model "
          "preparation may do; more is RESOURCE_EXHAUSTED before anything runs. 0: the "
          "backend's default (cpu 2^42: 24-44 s of 2 cores in bench/RESULTS.md; cuda 2^50)");
ABSL_FLAG(int64_t, heavy_request_work, 0,
          "keep-plan calls of more work units than this run on the --heavy_workers; 0: "
          "--max_request_work / 256");
ABSL_FLAG(int64_t, max_pending, 64,
          "requests waiting beyond those running (then RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_regions, 1024, "registered regions at most");
ABSL_FLAG(int64_t, max_models, 64, "registered models at most");
ABSL_FLAG(int64_t, max_share_series_per_model, 1024,
          "budget-share series (laprox_head_budget_share_*) one model may have: one per (layer, "
          "KV head) when they fit, else one per layer over all its KV heads (kv_head=\"all\"), "
          "else per band of layers (monitoring/METRICS.md)");
ABSL_FLAG(int64_t, max_share_series, 2048,
          "budget-share series all models together may have (first come, first served); a "
          "model registered beyond it gets fewer, coarser ones");
ABSL_FLAG(int64_t, max_tokens, int64_t{1} << 20, "n (prompt tokens) per request at most");
ABSL_FLAG(int64_t, max_batch_sequences, 256,
          "sequences per ComputeKeepPlans call at most (each is also bounded by max_tokens, and "
          "the batch's memory by max_request_memory)");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{256} << 20,
          "largest request message in bytes (inline tensors count)");
ABSL_FLAG(int64_t, max_response_bytes, (int64_t{1} << 31) - 1,
          "largest ComputeKeepMask response in bytes (at most 2^31 - 1, protobuf's limit); a "
          "larger one is RESOURCE_EXHAUSTED: write outputs into a region instead");
ABSL_FLAG(int64_t, max_request_memory, 0,
          "bytes that the requests computing at once may reserve together for their workspace "
          "and plans, each sized before anything is allocated (RESOURCE_EXHAUSTED beyond); 0: "
          "half of the memory this process may use (the cgroup limit inside a container, "
          "RLIMIT_AS, or the host's memory)");
ABSL_FLAG(int64_t, max_model_memory, 0,
          "bytes that the registered models' prepared factors may hold together (RegisterModel "
          "beyond it is RESOURCE_EXHAUSTED); 0: a quarter of the memory this process may use");

namespace {

// How long past --shutdown_timeout the watchdog waits for in-flight work to end.
constexpr absl::Duration kWatchdogSlack = absl::Seconds(3);

// Sets every flag defined in this file that is not on the command line from LAPROXD_<FLAG>.
// Returns false (after printing why) when a variable holds a value the flag does not take.
bool ApplyEnvironment(int argc, char** argv) {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), "service/main.cc")) continue;
    std::string variable = "LAPROXD_";
    for (char c : name) variable += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) continue;
    bool on_command_line = false;
    for (int i = 1; i < argc; ++i) {
      const absl::string_view arg = argv[i];
      for (const std::string& prefix : {absl::StrCat("--", name), absl::StrCat("-", name)}) {
        if (arg == prefix || absl::StartsWith(arg, prefix + "=")) on_command_line = true;
      }
    }
    if (on_command_line) continue;
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      std::fprintf(stderr, "laproxd: %s=%s: %s\n", variable.c_str(), value, error.c_str());
      return false;
    }
  }
  return true;
}

// Where this start's region and model ids begin: 1 + a random multiple of 2^20 below 2^51
// (ids stay exact in a JSON double), so ids from before a restart name nothing now.
uint64_t RandomFirstId() {
  uint32_t r = 0;
  if (getrandom(&r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) r = 0;
  return (static_cast<uint64_t>(r & 0x7fffffffu) << 20) + 1;
}

// An octal number of at most 4 digits ("0660", "660"); Server checks that it is a permission
// mode, in [0, 0777].
std::optional<mode_t> ParseMode(const std::string& text) {
  if (text.empty() || text.size() > 4) return std::nullopt;
  mode_t mode = 0;
  for (char c : text) {
    if (c < '0' || c > '7') return std::nullopt;
    mode = mode * 8 + static_cast<mode_t>(c - '0');
  }
  return mode;
}

// The flags as ServerOptions; INVALID_ARGUMENT (naming the flag) for what only the command line
// can get wrong. Server::Start checks the rest.
absl::StatusOr<laprox::service::ServerOptions> OptionsFromFlags() {
  laprox::service::ServerOptions o;
  const int64_t cpu_window_mb = absl::GetFlag(FLAGS_cpu_window_mb);
  if (cpu_window_mb < 1 || cpu_window_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu_window_mb=", cpu_window_mb, " is outside [1, 2^20]"));
  }
  bool deprecated = false;
  absl::StatusOr<std::string> cuda_kernels =
      laprox::kernels::CanonicalCudaKernels(absl::GetFlag(FLAGS_cuda_kernels), &deprecated);
  if (!cuda_kernels.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_kernels: ", cuda_kernels.status().message()));
  }
  if (deprecated) {
    std::fprintf(stderr, "laproxd: --cuda_kernels=%s is deprecated; it means %s\n",
                 absl::GetFlag(FLAGS_cuda_kernels).c_str(), cuda_kernels->c_str());
  }
  o.backend = absl::GetFlag(FLAGS_backend);
  o.backend_options = {.threads = absl::GetFlag(FLAGS_threads),
                       .cpu_window_bytes = cpu_window_mb << 20,
                       .device = absl::GetFlag(FLAGS_device),
                       .cuda_kernels = *cuda_kernels};
  o.limits = {.max_regions = absl::GetFlag(FLAGS_max_regions),
              .max_models = absl::GetFlag(FLAGS_max_models),
              .max_tokens = absl::GetFlag(FLAGS_max_tokens),
              .max_batch_sequences = absl::GetFlag(FLAGS_max_batch_sequences),
              .max_request_memory = absl::GetFlag(FLAGS_max_request_memory),
              .max_model_memory = absl::GetFlag(FLAGS_max_model_memory),
              .max_request_work = absl::GetFlag(FLAGS_max_request_work),
              .heavy_request_work = absl::GetFlag(FLAGS_heavy_request_work)};
  o.core = {.shared_models = absl::GetFlag(FLAGS_shared_models), .first_id = RandomFirstId()};
  o.workers = absl::GetFlag(FLAGS_workers);
  o.heavy_workers = absl::GetFlag(FLAGS_heavy_workers);  // checked with the others by Server
  o.max_pending = absl::GetFlag(FLAGS_max_pending);

  o.socket = absl::GetFlag(FLAGS_socket);
  if (o.socket == "auto") o.socket = laprox::v1::DefaultSocketPath();
  const std::optional<mode_t> socket_mode = ParseMode(absl::GetFlag(FLAGS_socket_mode));
  if (!socket_mode) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket_mode=", absl::GetFlag(FLAGS_socket_mode), " is not an octal number"));
  }
  o.socket_mode = *socket_mode;
  for (const auto& [name, flag, ids] :
       {std::tuple{"allowed_uids", &FLAGS_allowed_uids, &o.access.uids},
        std::tuple{"allowed_gids", &FLAGS_allowed_gids, &o.access.gids}}) {
    const std::string text = absl::GetFlag(*flag);
    if (text.empty()) continue;  // the default: laproxd's own
    absl::StatusOr<std::vector<uint32_t>> parsed =
        laprox::service::AccessPolicy::ParseIds(text, name);
    if (!parsed.ok()) return parsed.status();
    ids->assign(parsed->begin(), parsed->end());
  }
  o.lease_seconds = absl::GetFlag(FLAGS_lease_seconds);  // checked with the others by Server
  o.listen = absl::GetFlag(FLAGS_listen);
  o.tls = {.cert_file = absl::GetFlag(FLAGS_tls_cert_file),
           .key_file = absl::GetFlag(FLAGS_tls_key_file),
           .client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file),
           .allow_insecure = absl::GetFlag(FLAGS_allow_insecure_tcp)};
  o.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  o.max_response_bytes = absl::GetFlag(FLAGS_max_response_bytes);
  o.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o.health_listen = absl::GetFlag(FLAGS_health_listen);
  o.share_caps = {.per_model = absl::GetFlag(FLAGS_max_share_series_per_model),
                  .total = absl::GetFlag(FLAGS_max_share_series)};
  return o;
}

// Prints "laproxd: " and the status's message (without its code); returns main's exit status 1.
int Fail(const absl::Status& status) {
  std::fprintf(stderr, "laproxd: %s\n", absl::StrCat(status.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  laprox::kernels::RestartWithOpenBlasCore("laproxd", argv);
  absl::SetProgramUsageMessage(
      "laprox sidecar: KV-cache keep-plans over gRPC. Every flag can also come from the "
      "environment as LAPROXD_<FLAG IN UPPER CASE>; the command line wins.");
  // --help lists this file's flags (absl would look for a file named after the binary).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "service/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  if (!ApplyEnvironment(argc, argv)) return 1;
  absl::ParseCommandLine(argc, argv);

  // Blocks SIGTERM and SIGINT in every thread (before any starts); main waits for one below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<laprox::service::ServerOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  // Every shm region keeps its object open (to see a shrink at every lease): allow as many
  // descriptors as the hard limit does.
  if (struct rlimit files{};
      getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  absl::StatusOr<std::unique_ptr<laprox::service::Server>> started =
      laprox::service::Server::Start(*std::move(options));
  if (!started.ok()) {
    if (absl::GetFlag(FLAGS_socket) == "auto") {
      return Fail(absl::Status(started.status().code(),
                               absl::StrCat(started.status().message(), " (--socket=auto is ",
                                            laprox::v1::DefaultSocketPath(),
                                            ": give --socket, or set XDG_RUNTIME_DIR)")));
    }
    return Fail(started.status());
  }
  laprox::service::Server& server = **started;
  std::printf("laproxd %s: %s; listening on %s\n", laprox::service::kLaproxdVersion,
              server.core().backend().Describe().c_str(), server.Endpoints().c_str());
  if (!server.socket().empty()) {
    // What can reach it, each with the address it needs (the default socket needs none).
    const std::string target = "unix:" + server.socket();
    std::printf(
        "laproxd: clients reach it as %s: laprox-cli --target=%s, laprox.Client(\"%s\") and "
        "laprox.hf (Python), LAPROX_VLLM_TARGET=%s for vLLM's plugin\n",
        target.c_str(), target.c_str(), target.c_str(), target.c_str());
  }
  std::fflush(stdout);

  int signal = 0;
  sigwait(&stop_signals, &signal);
  std::printf("laproxd: signal %d, finishing in-flight calls\n", signal);
  std::fflush(stdout);
  // In-flight calls get shutdown_timeout, then are cancelled: a computation stops at its next
  // check (kernels/include/laprox/kernels/stop.h), within milliseconds. Should the work still
  // not end (a stage that does not check, such as a device kernel), a watchdog removes the
  // socket and its lock file and exits 0 all the same: the shutdown deadline is kept.
  const absl::Duration grace = absl::GetFlag(FLAGS_shutdown_timeout);
  absl::Notification stopped;
  std::thread watchdog([&stopped, &server, grace] {
    if (stopped.WaitForNotificationWithTimeout(grace + kWatchdogSlack)) return;
    std::fprintf(stderr,
                 "laproxd: in-flight work did not stop within %s of the shutdown deadline; "
                 "exiting without it\n",
                 absl::FormatDuration(kWatchdogSlack).c_str());
    server.RemoveSocketFiles();  // main() destroys the server only after joining this thread
    std::fflush(stdout);
    std::_Exit(0);
  });
  server.Shutdown(grace);
  stopped.Notify();
  watchdog.join();
  started->reset();  // removes the socket this process created, then releases the lock
  std::printf("laproxd: stopped\n");
  return 0;
}
