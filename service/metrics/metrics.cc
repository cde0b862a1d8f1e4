#include "service/metrics/metrics.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <utility>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"

namespace laprox::service {
namespace {

constexpr std::array<const char*, kNumMethods> kMethodNames = {
    "GetServerInfo", "RegisterRegion",  "UnregisterRegion", "ListRegions",
    "RegisterModel", "UnregisterModel", "ComputeKeepMask",  "ComputeKeepPlans",
};

// grpc::StatusCode names, by value (the gRPC spelling, as clients print them).
constexpr std::array<const char*, 17> kCodeNames = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

constexpr std::array<const char*, 5> kStageNames = {"queue", "validate", "score", "select",
                                                    "respond"};

// 100 us to 60 s, roughly 1-2.5-5 per decade.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
      0.1,  0.25,   0.5,  1,    2.5,    5,    10,   30,    60};
  return *buckets;
}

const prometheus::Histogram::BucketBoundaries& RatioBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  return *buckets;
}

prometheus::ClientMetric GaugeSample(std::vector<prometheus::ClientMetric::Label> labels,
                                     double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  return m;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  return {std::move(name), std::move(help), prometheus::MetricType::Gauge, {}};
}

}  // namespace

const char* MethodName(Method m) { return kMethodNames[static_cast<int>(m)]; }

// Reads the Core's state on every scrape.
class Metrics::StateCollector : public prometheus::Collectable {
 public:
  explicit StateCollector(std::function<StateSnapshot()> snapshot)
      : snapshot_(std::move(snapshot)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    if (!snapshot_) return {};
    const StateSnapshot s = snapshot_();
    auto regions = GaugeFamily("laprox_registered_regions",
                               "Regions registered now (draining ones included), by kind.");
    auto bytes = GaugeFamily("laprox_registered_region_bytes",
                             "Bytes of the regions registered now, by kind.");
    for (const char* kind : {"shm", "cuda_ipc"}) {
      auto it = s.regions_by_kind.find(kind);
      const StateSnapshot::RegionTotals t =
          it == s.regions_by_kind.end() ? StateSnapshot::RegionTotals{} : it->second;
      regions.metric.push_back(GaugeSample({{"kind", kind}}, static_cast<double>(t.count)));
      bytes.metric.push_back(GaugeSample({{"kind", kind}}, static_cast<double>(t.bytes)));
    }
    auto models = GaugeFamily("laprox_registered_models", "Models registered now.");
    models.metric.push_back(GaugeSample({}, static_cast<double>(s.models)));
    auto prepared = GaugeFamily(
        "laprox_prepared_model_bytes",
        "Bytes the registered models' prepared factors occupy (host memory for the CPU backend, "
        "device memory for CUDA).");
    prepared.metric.push_back(GaugeSample({}, static_cast<double>(s.prepared_bytes)));
    auto shrunk = GaugeFamily("laprox_shrunk_regions",
                              "Registered regions whose client shrank the shm object below them: "
                              "unusable until unregistered.");
    shrunk.metric.push_back(GaugeSample({}, static_cast<double>(s.shrunk_regions)));
    prometheus::MetricFamily faults = {
        "laprox_region_faults_total",
        "SIGBUS faults inside registered shm regions that laproxd absorbed (the client shrank the "
        "object while a request read or wrote it).",
        prometheus::MetricType::Counter,
        {}};
    prometheus::ClientMetric fault_count;
    fault_count.counter.value = static_cast<double>(s.region_faults);
    faults.metric.push_back(std::move(fault_count));
    auto reserved = GaugeFamily("laprox_memory_reserved_bytes",
                                "Bytes reserved now against a memory budget: budget=\"request\" "
                                "(requests computing), budget=\"model\" (prepared models).");
    auto limit = GaugeFamily("laprox_memory_limit_bytes",
                             "The memory budgets' limits (--max_request_memory, "
                             "--max_model_memory).");
    for (const auto& [name, budget] : s.memory_budgets) {
      reserved.metric.push_back(
          GaugeSample({{"budget", name}}, static_cast<double>(budget.reserved)));
      limit.metric.push_back(GaugeSample({{"budget", name}}, static_cast<double>(budget.limit)));
    }
    std::vector<prometheus::MetricFamily> out;
    for (auto* family : {&regions, &bytes, &models, &prepared, &shrunk, &faults}) {
      out.push_back(std::move(*family));
    }
    if (!s.memory_budgets.empty()) {
      out.push_back(std::move(reserved));
      out.push_back(std::move(limit));
    }
    if (!s.device_memory_used_bytes.empty()) {
      auto device = GaugeFamily("laprox_device_memory_used_bytes",
                                "Device memory in use on the GPU the CUDA backend computes on.");
      for (const auto& [uuid, used] : s.device_memory_used_bytes) {
        device.metric.push_back(GaugeSample({{"device", uuid}}, static_cast<double>(used)));
      }
      out.push_back(std::move(device));
    }
    return out;
  }

 private:
  std::function<StateSnapshot()> snapshot_;
};

Metrics::Metrics(std::shared_ptr<prometheus::Registry> registry, MetricsOptions options)
    : registry_(std::move(registry)),
      state_(std::make_shared<StateCollector>(std::move(options.snapshot))),
      shares_(std::make_shared<BudgetShares>(options.share_caps)) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  prometheus::Registry& r = *registry_;

  auto& requests = BuildCounter()
                       .Name("laprox_requests_total")
                       .Help("Finished calls by RPC method and gRPC status code.")
                       .Register(r);
  auto& request_seconds =
      BuildHistogram()
          .Name("laprox_request_duration_seconds")
          .Help("Wall time from receiving a call to replying, by RPC method (all codes).")
          .Register(r);
  for (int m = 0; m < kNumMethods; ++m) {
    for (size_t c = 0; c < kCodeNames.size(); ++c) {
      requests_[m][c] = &requests.Add({{"method", kMethodNames[m]}, {"code", kCodeNames[c]}});
    }
    request_seconds_[m] = &request_seconds.Add({{"method", kMethodNames[m]}}, LatencyBuckets());
  }
  auto& stages = BuildHistogram()
                     .Name("laprox_keep_plan_stage_duration_seconds")
                     .Help(
                         "Time of each stage of a successful ComputeKeepMask: queue (waiting "
                         "for a worker), validate, score, select, respond.")
                     .Register(r);
  for (size_t s = 0; s < kStageNames.size(); ++s) {
    stage_seconds_[s] = &stages.Add({{"stage", kStageNames[s]}}, LatencyBuckets());
  }
  in_flight_ = &BuildGauge()
                    .Name("laprox_in_flight_requests")
                    .Help("Calls received and not yet answered (queued ones included).")
                    .Register(r)
                    .Add({});
  serving_ = &BuildGauge()
                  .Name("laprox_serving")
                  .Help(
                      "1 while the server accepts calls; 0 while it drains or after a fatal "
                      "backend error (the health service then says NOT_SERVING).")
                  .Register(r)
                  .Add({});
  ready_ = &BuildGauge()
                .Name("laprox_ready")
                .Help(
                    "1 while at least one model is registered (the readiness the health "
                    "service reports for laprox.v1.Laprox).")
                .Register(r)
                .Add({});
  denied_calls_ = &BuildCounter()
                       .Name("laprox_denied_calls_total")
                       .Help(
                           "Calls refused with PERMISSION_DENIED because the caller may not call "
                           "laproxd (--allowed_uids, --allowed_gids).")
                       .Register(r)
                       .Add({});
  reclaimed_regions_ = &BuildCounter()
                            .Name("laprox_reclaimed_regions_total")
                            .Help("Regions unregistered by laproxd because their client is gone.")
                            .Register(r)
                            .Add({});
  reclaimed_region_bytes_ = &BuildCounter()
                                 .Name("laprox_reclaimed_region_bytes_total")
                                 .Help("Bytes of the regions laproxd reclaimed.")
                                 .Register(r)
                                 .Add({});
  reclaimed_models_ = &BuildCounter()
                           .Name("laprox_reclaimed_models_total")
                           .Help("Models unregistered by laproxd because their client is gone.")
                           .Register(r)
                           .Add({});
  tokens_received_ = &BuildCounter()
                          .Name("laprox_tokens_received_total")
                          .Help(
                              "KV entries (layer, KV head, position) of successful keep-plan "
                              "requests: L * Hkv * n per request.")
                          .Register(r)
                          .Add({});
  tokens_kept_ = &BuildCounter()
                      .Name("laprox_tokens_kept_total")
                      .Help("KV entries the successful keep-plans kept.")
                      .Register(r)
                      .Add({});
  kept_ratio_ = &BuildHistogram()
                     .Name("laprox_kept_ratio")
                     .Help("Fraction of the KV entries a keep-plan kept, per request.")
                     .Register(r)
                     .Add({}, RatioBuckets());
  scrape_failures_ = &BuildCounter()
                          .Name("laprox_metrics_scrape_failures_total")
                          .Help(
                              "Scrapes of /metrics that failed to render (host out of memory): "
                              "answered with HTTP 500; laproxd goes on.")
                          .Register(r)
                          .Add({});
  auto& limits = BuildGauge()
                     .Name("laprox_limit")
                     .Help("Configured limits: regions, models (--max_regions, --max_models).")
                     .Register(r);
  limits.Add({{"what", "regions"}}).Set(static_cast<double>(options.max_regions));
  limits.Add({{"what", "models"}}).Set(static_cast<double>(options.max_models));
  BuildGauge()
      .Name("laprox_build_info")
      .Help("Always 1; the labels say which laproxd this is.")
      .Register(r)
      .Add({{"version", options.version}})
      .Set(1);
  BuildGauge()
      .Name("laprox_backend_info")
      .Help("Always 1; the labels say which backend computes the keep-plans.")
      .Register(r)
      .Add({{"backend", options.backend},
            {"device", options.device},
            {"description", options.backend_description}})
      .Set(1);
}

Metrics::~Metrics() = default;

std::shared_ptr<prometheus::Collectable> Metrics::state_collectable() const { return state_; }

std::string Metrics::SerializeText() const {
  try {
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    for (auto& f : state_->Collect()) families.push_back(std::move(f));
    for (auto& f : shares_->Collect()) families.push_back(std::move(f));
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, families);
    return out.str();
  } catch (...) {
    scrape_failures_->Increment();  // an atomic add: allocates nothing
    throw;
  }
}

void Metrics::RecordCall(Method method, int grpc_code, double seconds) {
  const int m = static_cast<int>(method);
  const int code =
      grpc_code >= 0 && grpc_code < static_cast<int>(kCodeNames.size()) ? grpc_code : 2;  // UNKNOWN
  requests_[m][code]->Increment();
  request_seconds_[m]->Observe(seconds);
}

void Metrics::CallStarted() { in_flight_->Increment(); }
void Metrics::CallFinished() { in_flight_->Decrement(); }

void Metrics::RecordDenied() { denied_calls_->Increment(); }

void Metrics::RecordReclaimed(int64_t regions, int64_t region_bytes, int64_t models) {
  reclaimed_regions_->Increment(static_cast<double>(regions));
  reclaimed_region_bytes_->Increment(static_cast<double>(region_bytes));
  reclaimed_models_->Increment(static_cast<double>(models));
}

void Metrics::RecordStages(const StageSeconds& s) {
  const std::array<double, 5> values = {s.queue, s.validate, s.score, s.select, s.respond};
  for (size_t i = 0; i < values.size(); ++i) stage_seconds_[i]->Observe(values[i]);
}

void Metrics::RecordPlan(uint64_t model_id, const kernels::KeepPlan& plan) {
  const int64_t entries = int64_t{plan.num_layers} * plan.num_kv_heads * plan.n;
  const int64_t kept = std::accumulate(plan.counts.begin(), plan.counts.end(), int64_t{0});
  tokens_received_->Increment(static_cast<double>(entries));
  tokens_kept_->Increment(static_cast<double>(kept));
  if (entries > 0) kept_ratio_->Observe(static_cast<double>(kept) / static_cast<double>(entries));
  shares_->Record(model_id, plan);
}

absl::Status Metrics::AddModel(uint64_t model_id, const std::string& name,
                               const kernels::ModelGeometry& g) noexcept {
  return shares_->Add(model_id, name, g);
}

void Metrics::RemoveModel(uint64_t model_id) noexcept { shares_->Remove(model_id); }

int64_t Metrics::ModelSeriesBytes(const kernels::ModelGeometry& g) const noexcept {
  return shares_->BytesFor(g);
}

void Metrics::SetServing(bool serving) { serving_->Set(serving ? 1 : 0); }
void Metrics::SetReady(bool ready) { ready_->Set(ready ? 1 : 0); }

}  // namespace laprox::service
