// Server: laproxd without its command line. Builds the backend, Core, the work queues, the
// metrics, the health state and the laprox.v1.Laprox service, and serves them on a Unix socket
// (callers identified by SO_PEERCRED, what they registered reclaimed when they are gone), on TCP
// when asked (TLS, or plaintext on loopback), with grpc.health.v1 and reflection; optionally
// grpc.health.v1 alone on a probe port and Prometheus metrics over HTTP. service/main.cc turns
// flags into ServerOptions; tests start the same Server on a temporary socket.
//
//   ServerOptions options;
//   options.socket = "/tmp/laprox-test.sock";
//   absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(std::move(options));
//   ... (*server)->Shutdown(absl::Seconds(30));
#ifndef LAPROX_SERVICE_SERVER_H_
#define LAPROX_SERVICE_SERVER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/peer_identity.h"
#include "service/grpc/tcp_security.h"
#include "service/metrics/metrics.h"

namespace laprox::service {

// laproxd's version: GetServerInfo, laprox_build_info, its start-up line.
inline constexpr char kLaproxdVersion[] = "0.1.0";

// Every field is the laproxd flag of the same name (service/main.cc documents them); an
// out-of-range value is INVALID_ARGUMENT from Server::Start, naming the flag.
struct ServerOptions {
  std::string version = kLaproxdVersion;
  std::string backend = "auto";  // cpu, cuda or auto
  kernels::BackendOptions backend_options;
  CoreLimits limits;
  CoreOptions core;
  int workers = 2;
  // 0: heavy plans wait on the compute queue with the others (the stall a separate queue
  // prevents; tests use 0 to show it). Checked, with every other option, by CheckOptions
  // (server.cc) when the server starts.
  int heavy_workers = 1;
  int64_t max_pending = 64;
  // A path (laprox::v1::DefaultSocketPath(), laprox/v1/endpoint.h, resolves laproxd's "auto");
  // empty: no Unix socket.
  std::string socket;
  mode_t socket_mode = 0660;
  AccessPolicy access = AccessPolicy::OwnUser();
  // Registrations of local clients that are gone are reclaimed after this; zero: never.
  double lease_seconds = 30;
  std::string listen;  // TCP host:port for the whole API; empty: none
  TcpSecurityOptions tls;
  int64_t max_request_bytes = int64_t{256} << 20;
  int64_t max_response_bytes = (int64_t{1} << 31) - 1;
  std::string metrics_listen;  // host:port; empty: no metrics endpoint
  std::string health_listen;   // host:port; empty: no probe port
  BudgetShares::Caps share_caps;
};

// The Core laproxd computes with: options.backend with options.backend_options, options.limits
// and options.core (Server::Start's first step; the fuzz harness builds its Core here too).
// Errors are CreateBackend's.
absl::StatusOr<std::unique_ptr<Core>> BuildCore(const ServerOptions& options);

class Server {
 public:
  // Checks the options, builds everything and starts serving. Errors name what failed (a flag,
  // the socket path, an address); nothing keeps running after one.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();  // Shutdown(absl::ZeroDuration()) unless already shut down
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Health NOT_SERVING, no new connections or calls; in-flight calls get `grace`, then are
  // cancelled (a computation stops at its next check); the work queues run what they accepted
  // (jobs of cancelled calls end at once). The socket and its lock file stay until the Server
  // is destroyed.
  void Shutdown(absl::Duration grace);
  // Removes the socket and its lock file now, while Shutdown may still block in another thread
  // (laproxd's shutdown watchdog, just before it exits the process). Call it at most once, and
  // never concurrently with the destructor.
  void RemoveSocketFiles();

  // "unix:PATH tcp port N (TLS); health on tcp port M; metrics on http port K": what laproxd
  // prints as it starts (only the parts that are on).
  std::string Endpoints() const;
  int tcp_port() const { return tcp_port_; }
  int health_port() const { return health_port_; }
  int metrics_port() const;
  const std::string& socket() const { return options_.socket; }

  Core& core() { return *core_; }
  WorkQueue& work() { return *work_; }
  Metrics& metrics() { return *metrics_; }

 private:
  struct Parts;  // the gRPC and transport objects (kept out of this header)
  explicit Server(ServerOptions options);
  absl::Status Build();

  const ServerOptions options_;
  std::unique_ptr<Core> core_;
  std::unique_ptr<WorkQueue> work_;
  std::unique_ptr<WorkQueue> heavy_;
  std::unique_ptr<WorkQueue> control_;
  std::unique_ptr<WorkQueue> admin_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Parts> parts_;
  int tcp_port_ = 0;
  int health_port_ = 0;
  bool tcp_insecure_ = false;
  bool shut_down_ = false;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_SERVER_H_
