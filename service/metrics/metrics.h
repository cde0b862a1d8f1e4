// Metrics: laproxd's Prometheus metrics (monitoring/METRICS.md is the catalogue).
//
// Every family is declared once, in the constructor; every child the request path touches is
// created there too (per method x gRPC code, per stage), so recording a call is a few atomic
// adds. The budget shares of each registered model (per layer x KV head) are kept apart, capped
// in number (budget_shares.h), and exist only while their model is registered. Values that are
// state rather than events (regions, models, prepared bytes) are read from the Core when
// Prometheus scrapes, so they cannot drift from the truth.
#ifndef LAPROX_SERVICE_METRICS_METRICS_H_
#define LAPROX_SERVICE_METRICS_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/keep_plan.h"
#include "service/metrics/budget_shares.h"

namespace prometheus {
class Collectable;
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace laprox::service {

// The RPCs of laprox.v1.Laprox, in proto order.
enum class Method {
  kGetServerInfo,
  kRegisterRegion,
  kUnregisterRegion,
  kListRegions,
  kRegisterModel,
  kUnregisterModel,
  kComputeKeepMask,
  kComputeKeepPlans,
};
inline constexpr int kNumMethods = 8;
const char* MethodName(Method m);

// The stages of one ComputeKeepMask (the response's Timing).
struct StageSeconds {
  double queue = 0, validate = 0, score = 0, select = 0, respond = 0;
};

// State read at scrape time.
struct StateSnapshot {
  struct RegionTotals {
    int64_t count = 0;
    int64_t bytes = 0;
  };
  std::map<std::string, RegionTotals> regions_by_kind;  // "shm", "cuda_ipc"
  int64_t models = 0;
  int64_t prepared_bytes = 0;
  std::map<std::string, int64_t> device_memory_used_bytes;  // by device uuid (CUDA only)
  int64_t shrunk_regions = 0;  // regions their client shrank, still registered
  int64_t region_faults = 0;   // SIGBUS faults absorbed in guarded mappings, ever
  struct Budget {
    int64_t reserved = 0;
    int64_t limit = 0;
  };
  std::map<std::string, Budget> memory_budgets;  // "request", "model"
};

struct MetricsOptions {
  std::string version;
  std::string backend;              // "cpu" or "cuda"
  std::string backend_description;  // one line
  std::string device;               // device UUID, or "" for the CPU backend
  int64_t max_regions = 0;
  int64_t max_models = 0;
  std::function<StateSnapshot()> snapshot;  // called on every scrape
  // How many budget-share series a model, and all models, may have (budget_shares.h).
  BudgetShares::Caps share_caps;
};

class Metrics {
 public:
  Metrics(std::shared_ptr<prometheus::Registry> registry, MetricsOptions options);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }
  // The scrape-time state (regions, models, memory); an exposer registers it beside registry().
  std::shared_ptr<prometheus::Collectable> state_collectable() const;
  // Everything, in Prometheus' text format (what /metrics serves). At most the capped number of
  // budget-share series (budget_shares.h). May throw std::bad_alloc (or whatever the snapshot
  // callback throws): the failure is counted in laprox_metrics_scrape_failures_total, which the
  // next scrape reports, and rethrown (the HTTP exposer answers that scrape with 500).
  std::string SerializeText() const;

  // A finished call: its method, gRPC status code (0..16) and wall time from arrival to reply.
  void RecordCall(Method method, int grpc_code, double seconds);
  void CallStarted();
  void CallFinished();
  // A call refused because its caller may not call laproxd at all (--allowed_uids,
  // --allowed_gids; also counted by RecordCall as PERMISSION_DENIED).
  void RecordDenied();
  // Registrations of clients that went away, taken back by laproxd (leases.h).
  void RecordReclaimed(int64_t regions, int64_t region_bytes, int64_t models);
  // The stages of a successful ComputeKeepMask.
  void RecordStages(const StageSeconds& stages);
  // A successful plan for a registered model: tokens in and kept, kept ratio, and the budget
  // share of every (layer, KV head) and layer.
  void RecordPlan(uint64_t model_id, const kernels::KeepPlan& plan);

  // The budget-share series exist only while their model is registered (BudgetShares):
  //  - ModelSeriesBytes(g): the most host bytes AddModel keeps for a model of geometry g, at
  //    most ~0.6 MB at the default caps whatever g is; reserve it with the model's memory before
  //    AddModel. O(1).
  //  - AddModel: creates them, O(that model's series), at a granularity fixed now from the caps.
  //    OK; RESOURCE_EXHAUSTED when the host has no memory for them, or INVALID_ARGUMENT for a
  //    geometry without layers or KV heads, and then nothing is kept. Never throws. Adding an
  //    id again replaces its series.
  //  - RemoveModel: drops them, O(that model's series); an unknown id is a no-op.
  // All three are thread-safe.
  absl::Status AddModel(uint64_t model_id, const std::string& name,
                        const kernels::ModelGeometry& g) noexcept;
  void RemoveModel(uint64_t model_id) noexcept;
  int64_t ModelSeriesBytes(const kernels::ModelGeometry& g) const noexcept;
  const BudgetShares& budget_shares() const { return *shares_; }

  // 1 while the server accepts calls, 0 while it drains or after a fatal backend error.
  void SetServing(bool serving);
  // 1 once a model is registered (the readiness the health service reports).
  void SetReady(bool ready);

 private:
  class StateCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StateCollector> state_;

  std::array<std::array<prometheus::Counter*, 17>, kNumMethods> requests_{};
  std::array<prometheus::Histogram*, kNumMethods> request_seconds_{};
  std::array<prometheus::Histogram*, 5> stage_seconds_{};
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Gauge* serving_ = nullptr;
  prometheus::Gauge* ready_ = nullptr;
  prometheus::Counter* denied_calls_ = nullptr;
  prometheus::Counter* reclaimed_regions_ = nullptr;
  prometheus::Counter* reclaimed_region_bytes_ = nullptr;
  prometheus::Counter* reclaimed_models_ = nullptr;
  prometheus::Counter* tokens_received_ = nullptr;
  prometheus::Counter* tokens_kept_ = nullptr;
  prometheus::Histogram* kept_ratio_ = nullptr;
  prometheus::Counter* scrape_failures_ = nullptr;

  std::shared_ptr<BudgetShares> shares_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_METRICS_METRICS_H_
