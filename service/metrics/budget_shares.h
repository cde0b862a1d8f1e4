// BudgetShares: the budget-share series of the registered models — how the tokens a keep-plan
// kept were spread over layers and KV heads — bounded in number, in memory and in scrape size.
//
// Each model gets, from its registration to its unregistration:
//   laprox_head_budget_share_ratio{model, model_id, layer, kv_head}         gauge, latest plan
//   laprox_head_budget_share_distribution{...}                              histogram, all plans
//   laprox_layer_budget_share{model, model_id, layer}                       gauge, latest plan
//   laprox_layer_budget_share_distribution{...}                             histogram, all plans
//   laprox_budget_share_series{model, model_id, granularity}                its head series
// A share is the tokens a series' (layer, KV head) pairs kept over their even share of the
// plan's kept tokens: 1 is an even split, whatever the granularity.
//
// Granularity. A model gets at most Caps::per_model head series, and all models together at most
// Caps::total (first come, first served; fixed when the model registers, not revised when others
// leave). A model that fits has one series per (layer, KV head) (granularity "head"); one that
// does not gets one per layer over all its KV heads (kv_head="all", granularity "layer"), and,
// when its layers alone do not fit, one per band of consecutive layers (layer="lo-hi",
// granularity "band"). A model always gets at least one series (a band of all its layers), so
// the total can be passed by one series per model registered after it is used up. The layer
// series follow the same layers or bands, so they never outnumber the head series.
//
// The values live in compact arrays of this class (no prometheus-cpp children), so adding or
// removing a model costs O(its series), and a scrape builds at most the capped number of series.
// Thread safety: every method may be called concurrently.
#ifndef LAPROX_SERVICE_METRICS_BUDGET_SHARES_H_
#define LAPROX_SERVICE_METRICS_BUDGET_SHARES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "laprox/kernels/geometry.h"
#include "laprox/kernels/keep_plan.h"

namespace laprox::service {

class BudgetShares : public prometheus::Collectable {
 public:
  struct Caps {
    int64_t per_model = 1024;  // head series of one model (Llama-3.1-405B has 126 x 8 = 1008)
    int64_t total = 2048;      // head series of all models together
  };
  enum class Granularity { kHead, kLayer, kBand };
  static const char* GranularityName(Granularity g);

  explicit BudgetShares(Caps caps);

  // The most bytes Add(geometry) keeps for a model, whatever else is registered: what the model
  // memory budget reserves for them. O(1); never throws.
  int64_t BytesFor(const kernels::ModelGeometry& geometry) const noexcept;

  // Creates the model's series (all 0), O(its series). Its granularity is chosen here from the
  // caps and the head series the registered models hold, and kept until Remove. RESOURCE_EXHAUSTED,
  // and nothing kept, when the host has no memory for them; never throws. Adding an id again
  // replaces its series.
  absl::Status Add(uint64_t model_id, const std::string& name,
                   const kernels::ModelGeometry& geometry) noexcept;
  // Drops the model's series: O(its series); the head series it held go back to the total.
  void Remove(uint64_t model_id) noexcept;
  // Sets the gauges and observes the histograms of the model's series from a plan's counts,
  // O(L * Hkv) under the lock, no allocation (a plan of another geometry, an unknown model or a
  // plan that kept nothing is ignored).
  void Record(uint64_t model_id, const kernels::KeepPlan& plan) noexcept;

  // The granularity Add gave a model, and its number of head series (for tests and logs);
  // false when the model has no series.
  bool Describe(uint64_t model_id, Granularity* granularity, int64_t* head_series) const;
  // Head series of all models together.
  int64_t head_series() const;

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  // Consecutive layers [layer_begin, layer_end) and KV heads [head_begin, head_end) of a model,
  // exported as one series.
  struct Group {
    int32_t layer_begin = 0, layer_end = 0, head_begin = 0, head_end = 0;
    std::string layer, kv_head;  // label values
  };
  struct Histogram {
    std::vector<uint64_t> buckets;  // per bound, not cumulative; the last is +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  struct Series {
    std::vector<Group> groups;
    std::vector<double> gauge;
    std::vector<Histogram> histogram;
  };
  struct Model {
    std::string name, id;
    kernels::ModelGeometry geometry;
    Granularity granularity = Granularity::kHead;
    Series heads, layers;
  };

  // Layers per coarse series, for an allowance of `allow` >= 1 head series: 0 when every
  // (layer, KV head) pair gets its own (granularity head), else 1 (layer) or more (band).
  static int64_t LayersPerSeries(int64_t layers, int64_t kv_heads, int64_t allow);
  // The head series a model of that geometry gets for that allowance.
  static int64_t HeadSeriesFor(int64_t layers, int64_t kv_heads, int64_t allow);
  // The model's series for an allowance of `allow` head series.
  static std::unique_ptr<Model> Build(uint64_t model_id, const std::string& name,
                                      const kernels::ModelGeometry& geometry, int64_t allow);
  static void Observe(Histogram& histogram, double value) noexcept;

  const Caps caps_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Model>> models_ ABSL_GUARDED_BY(mu_);
  // Head series of the registered models, and of those being added (reserved before they are
  // built, so that concurrent Adds cannot together pass the total cap).
  int64_t head_series_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_METRICS_BUDGET_SHARES_H_
