// laproxd: the laprox sidecar. Serves laprox.v1.Laprox, the standard grpc.health.v1 service and
// server reflection on a Unix domain socket (mode 0660) by default, TCP only when asked for.
// SIGTERM or SIGINT stops accepting calls, lets in-flight calls finish, and exits 0.
//
//   laproxd --socket=/tmp/laproxd.sock --backend=cpu --threads=2
//   laproxd --listen=127.0.0.1:50051        # TCP, e.g. for a Kubernetes gRPC probe port
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"

ABSL_FLAG(std::string, socket, "/tmp/laproxd.sock",
          "Unix domain socket to listen on (created with mode 0660); empty to disable");
ABSL_FLAG(std::string, listen, "",
          "also listen on this TCP address (host:port; port 0 picks one and prints it)");
ABSL_FLAG(std::string, backend, "auto", "compute backend: auto, cpu or cuda");
ABSL_FLAG(int, threads, 2, "CPU backend worker threads per request");
ABSL_FLAG(int, device, 0, "CUDA device ordinal (cuda backend)");
ABSL_FLAG(int, workers, 2, "requests computed concurrently");
ABSL_FLAG(int64_t, max_pending, 64,
          "requests waiting beyond those running (then RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_regions, 1024, "registered regions at most");
ABSL_FLAG(int64_t, max_models, 64, "registered models at most");
ABSL_FLAG(int64_t, max_tokens, int64_t{1} << 20, "n (prompt tokens) per request at most");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{256} << 20,
          "largest request message in bytes (inline tensors count)");

namespace {

constexpr char kVersion[] = "0.1.0";

// Blocks SIGTERM and SIGINT in every thread (call before any thread starts) and waits for one.
int WaitForStopSignal(const sigset_t& signals) {
  int signal = 0;
  sigwait(&signals, &signal);
  return signal;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("laprox sidecar: KV-cache keep-plans over gRPC");
  absl::ParseCommandLine(argc, argv);

  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto backend = laprox::kernels::CreateBackend(
      absl::GetFlag(FLAGS_backend),
      {.threads = absl::GetFlag(FLAGS_threads), .device = absl::GetFlag(FLAGS_device)});
  if (!backend.ok()) {
    std::fprintf(stderr, "laproxd: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  laprox::service::Core core(*std::move(backend), {.max_regions = absl::GetFlag(FLAGS_max_regions),
                                                   .max_models = absl::GetFlag(FLAGS_max_models),
                                                   .max_tokens = absl::GetFlag(FLAGS_max_tokens)});
  auto work = std::make_unique<laprox::service::WorkQueue>(absl::GetFlag(FLAGS_workers),
                                                           absl::GetFlag(FLAGS_max_pending));
  laprox::service::LaproxService service(core, *work, kVersion);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(static_cast<int>(absl::GetFlag(FLAGS_max_request_bytes)));
  builder.SetMaxSendMessageSize(-1);
  const std::string socket = absl::GetFlag(FLAGS_socket);
  const std::string tcp = absl::GetFlag(FLAGS_listen);
  if (socket.empty() && tcp.empty()) {
    std::fprintf(stderr, "laproxd: give --socket or --listen\n");
    return 1;
  }
  if (!socket.empty()) {
    unlink(socket.c_str());  // a stale socket from a previous run
    builder.AddListeningPort(absl::StrCat("unix:", socket), grpc::InsecureServerCredentials());
  }
  int tcp_port = 0;
  if (!tcp.empty()) builder.AddListeningPort(tcp, grpc::InsecureServerCredentials(), &tcp_port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "laproxd: cannot listen on %s %s\n", socket.c_str(), tcp.c_str());
    return 1;
  }
  if (!socket.empty() && chmod(socket.c_str(), 0660) != 0) {
    std::perror("laproxd: chmod of the socket");
  }
  std::printf("laproxd %s: %s; listening on%s%s%s\n", kVersion, core.backend().Describe().c_str(),
              socket.empty() ? "" : absl::StrCat(" unix:", socket).c_str(),
              tcp.empty() ? "" : " tcp port ", tcp.empty() ? "" : std::to_string(tcp_port).c_str());
  std::fflush(stdout);

  const int signal = WaitForStopSignal(stop_signals);
  std::printf("laproxd: signal %d, finishing in-flight calls\n", signal);
  std::fflush(stdout);
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown();  // waits for in-flight calls (their jobs still run on the work queue)
  work.reset();
  if (!socket.empty()) unlink(socket.c_str());
  std::printf("laproxd: stopped\n");
  return 0;
}
