#include "service/server.h"

#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "service/core/fault_guard.h"
#include "service/core/registry.h"
#include "service/grpc/laprox_service.h"
#include "service/grpc/socket_path.h"
#include "service/health/serving_state.h"
#include "service/metrics/http_exposer.h"

namespace laprox::service {
namespace {

// The health service name that reports readiness (a model is registered).
constexpr char kReadinessService[] = "laprox.v1.Laprox";

// Takes every plugin out of a ServerBuilder. The reflection plugin, once linked, adds itself to
// every builder in the process: without this the health port would also answer
// grpc.reflection (and describe laprox.v1 to whoever reaches the probe port).
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

absl::Status CheckOptions(const ServerOptions& o) {
  if (o.socket.empty() && o.listen.empty()) {
    return absl::InvalidArgumentError("give --socket or --listen");
  }
  if (o.socket_mode > 0777) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--socket_mode=0%o is not in [0, 0777]", o.socket_mode));
  }
  if (o.max_response_bytes < 1 || o.max_response_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_response_bytes=", o.max_response_bytes, " is outside [1, 2^31 - 1]"));
  }
  if (o.max_request_bytes < 1 || o.max_request_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_request_bytes=", o.max_request_bytes, " is outside [1, 2^31 - 1]"));
  }
  if (o.limits.max_batch_sequences < 1) {
    return absl::InvalidArgumentError("--max_batch_sequences must be >= 1");
  }
  for (const auto& [name, value] : {std::pair{"max_request_memory", o.limits.max_request_memory},
                                    std::pair{"max_model_memory", o.limits.max_model_memory},
                                    std::pair{"max_request_work", o.limits.max_request_work},
                                    std::pair{"heavy_request_work", o.limits.heavy_request_work}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be >= 0 (0: derived)"));
    }
  }
  for (const auto& [name, value] : {std::pair{"max_share_series_per_model", o.share_caps.per_model},
                                    std::pair{"max_share_series", o.share_caps.total}}) {
    if (value < 1 || value > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", value, " is outside [1, 2^20]"));
    }
  }
  for (const auto& [name, value, least] :
       {std::tuple{"workers", o.workers, 1}, std::tuple{"heavy_workers", o.heavy_workers, 0}}) {
    if (value < least || value > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, "=", value, " is outside [", least, ", 1024]"));
    }
  }
  if (o.max_pending < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_pending=", o.max_pending, " is < 0"));
  }
  if (!(o.lease_seconds >= 0.0 && o.lease_seconds <= 1e9)) {  // NaN too
    return absl::InvalidArgumentError(absl::StrCat("--lease_seconds=", o.lease_seconds,
                                                   " must be in [0, 1e9] (0: never reclaim)"));
  }
  return absl::OkStatus();
}

// What the metrics report at every scrape: regions, models, memory budgets, device memory.
StateSnapshot Snapshot(Core& core) {
  StateSnapshot s;
  for (const RegionInfo& r : core.regions().List(Owner::Laproxd())) {
    auto& totals = s.regions_by_kind[r.kind == RegionKind::kShm ? "shm" : "cuda_ipc"];
    ++totals.count;
    totals.bytes += r.byte_size;
    s.shrunk_regions += r.shrunk ? 1 : 0;
  }
  s.region_faults = GuardedFaultCount();
  s.memory_budgets["request"] = {.reserved = core.request_memory().in_use(),
                                 .limit = core.request_memory().limit()};
  s.memory_budgets["model"] = {.reserved = core.model_memory().in_use(),
                               .limit = core.model_memory().limit()};
  const Core::ModelTotals models = core.model_totals();
  s.models = models.count;
  s.prepared_bytes = models.prepared_bytes;
  for (const kernels::DeviceDescription& d : core.backend().Devices()) {
    if (d.used_memory_bytes >= 0) s.device_memory_used_bytes[d.uuid] = d.used_memory_bytes;
  }
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> BuildCore(const ServerOptions& options) {
  // CreateBackend checks every backend option (cuda_kernels too) and names what is wrong.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(options.backend, options.backend_options);
  if (!backend.ok()) return backend.status();
  return std::make_unique<Core>(*std::move(backend), options.limits, options.core);
}

// Declared in the order they are built; Shutdown and the destructor take them down in reverse.
struct Server::Parts {
  std::unique_ptr<HttpExposer> exposer;
  ServingState serving{kReadinessService};
  // Every registration's life: leases, the model's metrics series, readiness.
  std::unique_ptr<Registry> registry;
  // The Unix socket's connections, accepted by laproxd itself to learn who each caller is.
  std::optional<SocketClaim> claim;
  std::unique_ptr<UnixListener> listener;
  std::unique_ptr<LaproxService> service;
  std::unique_ptr<grpc::Server> grpc_server;
  // A second server with only the health service, so a probe port exposes nothing else: no
  // plugins (WithoutPlugins), and gRPC's own generic service, which answers every other method
  // UNIMPLEMENTED (and gives the server the polled queue it must have to start).
  grpc::CallbackGenericService health_unimplemented;
  std::unique_ptr<grpc::Server> health_server;
  absl::Notification stop_reclaiming;
  std::thread reclaimer;
};

Server::Server(ServerOptions options)
    : options_(std::move(options)), parts_(std::make_unique<Parts>()) {}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  auto server = std::unique_ptr<Server>(new Server(std::move(options)));
  if (absl::Status s = server->Build(); !s.ok()) return s;  // ~Server stops what started
  return server;
}

absl::Status Server::Build() {
  absl::StatusOr<std::unique_ptr<Core>> core = BuildCore(options_);
  if (!core.ok()) return core.status();
  core_ = *std::move(core);
  work_ = std::make_unique<WorkQueue>(options_.workers, options_.max_pending);
  if (options_.heavy_workers > 0) {
    heavy_ = std::make_unique<WorkQueue>(options_.heavy_workers, options_.max_pending);
  }
  // The control plane's queues, so that registering and unregistering answer while every
  // compute worker is busy: region opens on one worker; model preparations and region drains on
  // a few (a drain waits for at most the deadlines of the plans using its region).
  control_ = std::make_unique<WorkQueue>(/*workers=*/1, /*max_pending=*/256);
  admin_ = std::make_unique<WorkQueue>(/*workers=*/4, /*max_pending=*/256);

  const kernels::Backend& compute = core_->backend();
  std::string active_device;
  for (const kernels::DeviceDescription& d : compute.Devices()) {
    if (d.active) active_device = d.uuid;
  }
  metrics_ = std::make_unique<Metrics>(
      std::make_shared<prometheus::Registry>(),
      MetricsOptions{.version = options_.version,
                     .backend = compute.kind() == kernels::BackendKind::kCuda ? "cuda" : "cpu",
                     .backend_description = compute.Describe(),
                     .device = active_device,
                     .max_regions = core_->limits().max_regions,
                     .max_models = core_->limits().max_models,
                     .snapshot = [core = core_.get()] { return Snapshot(*core); },
                     .share_caps = options_.share_caps});
  Parts& p = *parts_;
  if (!options_.metrics_listen.empty()) {
    auto started = HttpExposer::Start(
        options_.metrics_listen, [metrics = metrics_.get()] { return metrics->SerializeText(); });
    if (!started.ok()) return started.status();
    p.exposer = *std::move(started);
  }

  // Health: "" is SERVING while the server runs; kReadinessService while a model is registered.
  // After a sticky backend error (the CUDA context is unusable until a restart) both are
  // NOT_SERVING for good, so the orchestrator restarts the pod.
  p.serving.AddPublisher([metrics = metrics_.get()](const std::string& name, bool up) {
    if (name.empty()) {
      metrics->SetServing(up);
    } else {
      metrics->SetReady(up);
    }
  });
  Metrics& metrics = *metrics_;
  p.registry = std::make_unique<Registry>(
      *core_, absl::Seconds(options_.lease_seconds),
      RegistryHooks{
          // A model's metrics series live as long as it does: their memory is the model's too.
          .model_bytes =
              [&metrics](const kernels::ModelGeometry& g) { return metrics.ModelSeriesBytes(g); },
          .model_added =
              [&metrics](const ModelInfo& m) { return metrics.AddModel(m.id, m.name, m.geometry); },
          .model_removed = [&metrics](uint64_t id) { metrics.RemoveModel(id); },
          .models_changed = [this](int64_t models) { parts_->serving.SetModels(models); },
          .reclaimed =
              [&metrics](const Reclaimed& r) {
                metrics.RecordReclaimed(r.regions, r.region_bytes, r.models);
              }});
  p.service = std::make_unique<LaproxService>(
      *core_, *work_, options_.version,
      [this](const grpc::ServerContextBase& context) {
        return IdentifyCaller(context, parts_->listener.get(), options_.access);
      },
      ServiceOptions{.metrics = metrics_.get(),
                     .registry = p.registry.get(),
                     .backend_unhealthy =
                         [this](const absl::Status& cause) {
                           if (parts_->serving.BackendFailed(cause)) {
                             std::fprintf(
                                 stderr,
                                 "laproxd: the backend failed for good, health is NOT_SERVING: "
                                 "%s\n",
                                 cause.ToString().c_str());
                           }
                         },
                     .max_request_bytes = options_.max_request_bytes,
                     .max_response_bytes = options_.max_response_bytes,
                     .heavy = heavy_.get(),
                     .control = control_.get(),
                     .admin = admin_.get()});

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_request_bytes));
  builder.SetMaxSendMessageSize(-1);
  if (!options_.socket.empty()) {
    absl::StatusOr<SocketClaim> claim = SocketClaim::Acquire(options_.socket);
    if (!claim.ok()) return claim.status();
    p.claim.emplace(*std::move(claim));
    // The socket is born with socket_mode: no moment in which it has other permissions.
    ScopedUmask umask_for_bind(0777 & ~options_.socket_mode);
    absl::StatusOr<std::unique_ptr<UnixListener>> listener = UnixListener::Listen(options_.socket);
    if (!listener.ok()) return listener.status();
    p.listener = *std::move(listener);
  }
  if (!options_.listen.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        TcpCredentials(options_.listen, options_.tls, &tcp_insecure_);
    if (!credentials.ok()) return credentials.status();
    builder.AddListeningPort(options_.listen, *credentials, &tcp_port_);
  }
  builder.RegisterService(p.service.get());
  p.grpc_server = builder.BuildAndStart();
  if (p.grpc_server == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot start the gRPC server (", options_.listen, ")"));
  }
  if (p.claim) p.claim->Bound();
  auto publish_to = [](grpc::HealthCheckServiceInterface* health) {
    return [health](const std::string& name, bool up) { health->SetServingStatus(name, up); };
  };
  p.serving.AddPublisher(publish_to(p.grpc_server->GetHealthCheckService()));
  if (!options_.health_listen.empty()) {
    grpc::ServerBuilder health_builder;
    health_builder.SetOption(std::make_unique<WithoutPlugins>());  // grpc.health.v1 only
    health_builder.RegisterCallbackGenericService(&p.health_unimplemented);
    health_builder.AddListeningPort(options_.health_listen, grpc::InsecureServerCredentials(),
                                    &health_port_);
    p.health_server = health_builder.BuildAndStart();
    if (p.health_server == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve health on ", options_.health_listen));
    }
    p.serving.AddPublisher(publish_to(p.health_server->GetHealthCheckService()));
  }
  // Only now: every early return above destroys the gRPC server while nothing else may reach it.
  if (p.listener) p.listener->Start(p.grpc_server.get());
  // Takes back what clients that are gone registered (--lease_seconds).
  if (p.listener && options_.lease_seconds > 0) {
    p.reclaimer = std::thread([this] {
      Parts& parts = *parts_;
      const auto connected = [&parts](uid_t uid, pid_t pid) {
        return parts.listener->Connected(uid, pid);
      };
      while (!parts.stop_reclaiming.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
        parts.registry->ReclaimLapsed(connected);
      }
    });
  }
  metrics_->SetServing(true);
  p.serving.SetModels(core_->model_totals().count);
  return absl::OkStatus();
}

void Server::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  Parts& p = *parts_;
  p.serving.ShutDown();
  p.stop_reclaiming.Notify();
  if (p.reclaimer.joinable()) p.reclaimer.join();
  if (p.listener) p.listener->Stop();  // no new connections; those open finish below
  if (p.grpc_server) p.grpc_server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  if (p.health_server) p.health_server->Shutdown();
  // Each queue runs what it accepted (jobs of cancelled calls end at once), before the service
  // and the registry its jobs use go with parts_.
  work_.reset();
  heavy_.reset();
  control_.reset();
  admin_.reset();
}

void Server::RemoveSocketFiles() {
  if (parts_->claim) parts_->claim->RemoveFiles();
}

Server::~Server() {
  Shutdown(absl::ZeroDuration());
  parts_.reset();  // the service and servers before Core and the metrics they use
}

int Server::metrics_port() const { return parts_->exposer ? parts_->exposer->port() : 0; }

std::string Server::Endpoints() const {
  std::string endpoints;
  if (!options_.socket.empty()) absl::StrAppend(&endpoints, "unix:", options_.socket);
  if (!options_.listen.empty()) {
    absl::StrAppend(&endpoints, endpoints.empty() ? "" : " ", "tcp port ", tcp_port_,
                    tcp_insecure_                          ? " (plaintext)"
                    : !options_.tls.client_ca_file.empty() ? " (mTLS)"
                                                           : " (TLS)");
  }
  if (health_port_ != 0) absl::StrAppend(&endpoints, "; health on tcp port ", health_port_);
  if (parts_->exposer) absl::StrAppend(&endpoints, "; metrics on http port ", metrics_port());
  return endpoints;
}

}  // namespace laprox::service
