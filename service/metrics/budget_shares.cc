#include "service/metrics/budget_shares.h"

#include <algorithm>
#include <array>
#include <exception>
#include <limits>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::service {
namespace {

// Budget share: kept / even share; 1 means the even split.
constexpr std::array<double, 12> kShareBounds = {0,    0.25, 0.5, 0.75, 0.9, 1.1,
                                                 1.25, 1.5,  2,   3,    5,   10};
constexpr size_t kBuckets = kShareBounds.size() + 1;  // and +Inf

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  return {std::move(name), std::move(help), type, {}};
}

}  // namespace

const char* BudgetShares::GranularityName(Granularity g) {
  switch (g) {
    case Granularity::kHead:
      return "head";
    case Granularity::kLayer:
      return "layer";
    case Granularity::kBand:
      break;
  }
  return "band";
}

BudgetShares::BudgetShares(Caps caps)
    : caps_{std::max<int64_t>(caps.per_model, 1), std::max<int64_t>(caps.total, 1)} {}

int64_t BudgetShares::BytesFor(const kernels::ModelGeometry& g) const noexcept {
  const int64_t L = std::max(g.num_layers, 1), Hkv = std::max(g.num_kv_heads, 1);
  const int64_t pairs =
      L > std::numeric_limits<int64_t>::max() / Hkv ? std::numeric_limits<int64_t>::max() : L * Hkv;
  // Whatever the allowance Add finds: every pair when they fit the per-model cap, else at most
  // one series per layer (fewer when the allowance is smaller).
  const int64_t head_groups = pairs <= caps_.per_model ? pairs : std::min(L, caps_.per_model);
  const int64_t layer_groups = std::min(L, caps_.per_model);
  // A group, its gauge and its histogram (vectors sized exactly by Build), with room for the
  // allocator's headers and a layer label too long for the string's inline buffer.
  constexpr int64_t kPerGroup =
      sizeof(Group) + sizeof(double) + sizeof(Histogram) + kBuckets * sizeof(uint64_t) + 64;
  return (head_groups + layer_groups) * kPerGroup + int64_t{sizeof(Model)} + 512;
}

int64_t BudgetShares::LayersPerSeries(int64_t layers, int64_t kv_heads, int64_t allow) {
  if (layers * kv_heads <= allow) return 0;
  return layers <= allow ? 1 : (layers + allow - 1) / allow;
}

int64_t BudgetShares::HeadSeriesFor(int64_t layers, int64_t kv_heads, int64_t allow) {
  const int64_t band = LayersPerSeries(layers, kv_heads, allow);
  return band == 0 ? layers * kv_heads : (layers + band - 1) / band;
}

std::unique_ptr<BudgetShares::Model> BudgetShares::Build(uint64_t model_id, const std::string& name,
                                                         const kernels::ModelGeometry& g,
                                                         int64_t allow) {
  auto model = std::make_unique<Model>();
  model->id = absl::StrCat(model_id);
  model->name = name.empty() ? model->id : name;
  model->geometry = g;
  const int32_t L = g.num_layers, Hkv = g.num_kv_heads;
  const int64_t layers_per_series = LayersPerSeries(L, Hkv, allow);
  // Per layer series: 1 at granularity head or layer.
  const int64_t band = std::max<int64_t>(layers_per_series, 1);
  const auto layer_series = static_cast<size_t>((L + band - 1) / band);
  // Sized exactly, so that BytesFor bounds what stays allocated.
  model->heads.groups.reserve(static_cast<size_t>(HeadSeriesFor(L, Hkv, allow)));
  model->layers.groups.reserve(layer_series);
  if (layers_per_series == 0) {
    model->granularity = Granularity::kHead;
    for (int32_t l = 0; l < L; ++l) {
      for (int32_t h = 0; h < Hkv; ++h) {
        model->heads.groups.push_back({l, l + 1, h, h + 1, absl::StrCat(l), absl::StrCat(h)});
      }
    }
  } else {
    model->granularity = band == 1 ? Granularity::kLayer : Granularity::kBand;
  }
  for (int64_t l = 0; l < L; l += band) {
    const auto end = static_cast<int32_t>(std::min<int64_t>(L, l + band));
    const auto begin = static_cast<int32_t>(l);
    Group layer = {
        begin, end, 0, Hkv, band == 1 ? absl::StrCat(begin) : absl::StrCat(begin, "-", end - 1),
        "all"};
    if (model->granularity != Granularity::kHead) model->heads.groups.push_back(layer);
    model->layers.groups.push_back(std::move(layer));
  }
  for (Series* s : {&model->heads, &model->layers}) {
    s->gauge.assign(s->groups.size(), 0.0);
    s->histogram.assign(s->groups.size(), Histogram{std::vector<uint64_t>(kBuckets, 0), 0, 0});
  }
  return model;
}

absl::Status BudgetShares::Add(uint64_t model_id, const std::string& name,
                               const kernels::ModelGeometry& geometry) noexcept {
  if (geometry.num_layers <= 0 || geometry.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model_id, " has ", geometry.num_layers, " layers and ", geometry.num_kv_heads,
        " KV heads; its budget-share series need at least one of each"));
  }
  int64_t allow = 0, reserved = 0;
  {
    // The series are taken from the total now, before they are built outside the lock, so that
    // concurrent Adds cannot pass the cap together.
    absl::MutexLock lock(&mu_);
    int64_t used = head_series_;
    if (auto it = models_.find(model_id); it != models_.end()) {
      used -= static_cast<int64_t>(it->second->heads.groups.size());
    }
    allow = std::max<int64_t>(1, std::min(caps_.per_model, caps_.total - used));
    reserved = HeadSeriesFor(geometry.num_layers, geometry.num_kv_heads, allow);
    head_series_ += reserved;
  }
  std::unique_ptr<Model> replaced;  // freed outside the lock
  try {
    std::unique_ptr<Model> model = Build(model_id, name, geometry, allow);
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = models_.try_emplace(model_id);
    if (!inserted) {
      head_series_ -= static_cast<int64_t>(it->second->heads.groups.size());
      replaced = std::move(it->second);
    }
    it->second = std::move(model);
    return absl::OkStatus();
  } catch (const std::exception& e) {  // std::bad_alloc
    {
      absl::MutexLock lock(&mu_);
      head_series_ -= reserved;
    }
    try {
      return absl::ResourceExhaustedError(absl::StrCat("cannot create the metrics series of model ",
                                                       model_id, " (", reserved,
                                                       " head series): ", e.what()));
    } catch (...) {
      return absl::Status(absl::StatusCode::kResourceExhausted, "");  // allocates nothing
    }
  }
}

void BudgetShares::Remove(uint64_t model_id) noexcept {
  std::unique_ptr<Model> gone;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) return;
  head_series_ -= static_cast<int64_t>(it->second->heads.groups.size());
  gone = std::move(it->second);
  models_.erase(it);
}

void BudgetShares::Observe(Histogram& histogram, double value) noexcept {
  size_t b = 0;
  while (b < kShareBounds.size() && value > kShareBounds[b]) ++b;
  ++histogram.buckets[b];
  histogram.sum += value;
  ++histogram.count;
}

void BudgetShares::Record(uint64_t model_id, const kernels::KeepPlan& plan) noexcept {
  const int64_t L = plan.num_layers, Hkv = plan.num_kv_heads;
  if (L <= 0 || Hkv <= 0 || static_cast<int64_t>(plan.counts.size()) != L * Hkv) return;
  int64_t kept = 0;
  for (int32_t c : plan.counts) kept += c;
  if (kept <= 0) return;  // no share to speak of
  const double even = static_cast<double>(kept) / static_cast<double>(L * Hkv);  // per pair
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) return;  // unregistered while the request ran
  Model& model = *it->second;
  if (model.geometry.num_layers != L || model.geometry.num_kv_heads != Hkv) return;
  // Each series set covers every pair once: O(L * Hkv) in all, and nothing allocated.
  for (Series* s : {&model.heads, &model.layers}) {
    for (size_t i = 0; i < s->groups.size(); ++i) {
      const Group& g = s->groups[i];
      int64_t sum = 0;
      for (int64_t l = g.layer_begin; l < g.layer_end; ++l) {
        for (int64_t h = g.head_begin; h < g.head_end; ++h) sum += plan.counts[l * Hkv + h];
      }
      const double pairs =
          static_cast<double>(g.layer_end - g.layer_begin) * (g.head_end - g.head_begin);
      const double share = static_cast<double>(sum) / (pairs * even);
      s->gauge[i] = share;
      Observe(s->histogram[i], share);
    }
  }
}

bool BudgetShares::Describe(uint64_t model_id, Granularity* granularity,
                            int64_t* head_series) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) return false;
  *granularity = it->second->granularity;
  *head_series = static_cast<int64_t>(it->second->heads.groups.size());
  return true;
}

int64_t BudgetShares::head_series() const {
  absl::MutexLock lock(&mu_);
  return head_series_;
}

std::vector<prometheus::MetricFamily> BudgetShares::Collect() const {
  using prometheus::MetricType;
  auto head = Family("laprox_head_budget_share_ratio",
                     "Latest keep-plan: tokens a (layer, KV head) kept divided by the even share "
                     "(all kept tokens / (L * Hkv)); 1 is an even split. Beyond the series caps "
                     "one series covers all KV heads of a layer (kv_head=\"all\") or a band of "
                     "layers (layer=\"lo-hi\"): laprox_budget_share_series says which.",
                     MetricType::Gauge);
  auto head_hist = Family("laprox_head_budget_share_distribution",
                          "Budget share of each (layer, KV head) series over all keep-plans.",
                          MetricType::Histogram);
  auto layer = Family("laprox_layer_budget_share",
                      "Latest keep-plan: tokens a layer (or band of layers) kept divided by the "
                      "even share (all kept tokens / L per layer); 1 is an even split.",
                      MetricType::Gauge);
  auto layer_hist =
      Family("laprox_layer_budget_share_distribution",
             "Budget share of each layer series over all keep-plans.", MetricType::Histogram);
  auto series = Family("laprox_budget_share_series",
                       "Head series of a registered model's budget shares, by granularity: head "
                       "(one per layer and KV head), layer (kv_head=\"all\") or band (bands of "
                       "layers), set by --max_share_series_per_model and --max_share_series.",
                       MetricType::Gauge);
  const auto gauge = [](std::vector<prometheus::ClientMetric::Label> labels, double value) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    m.gauge.value = value;
    return m;
  };
  const auto histogram = [](std::vector<prometheus::ClientMetric::Label> labels,
                            const Histogram& h) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    m.histogram.sample_count = h.count;
    m.histogram.sample_sum = h.sum;
    uint64_t cumulative = 0;
    for (size_t b = 0; b < kBuckets; ++b) {
      cumulative += h.buckets[b];
      prometheus::ClientMetric::Bucket bucket;
      bucket.cumulative_count = cumulative;
      bucket.upper_bound =
          b < kShareBounds.size() ? kShareBounds[b] : std::numeric_limits<double>::infinity();
      m.histogram.bucket.push_back(bucket);
    }
    return m;
  };
  absl::MutexLock lock(&mu_);
  for (const auto& [id, model] : models_) {
    // Labels in name order, as prometheus-cpp's own families give them.
    for (size_t i = 0; i < model->heads.groups.size(); ++i) {
      const Group& g = model->heads.groups[i];
      std::vector<prometheus::ClientMetric::Label> labels = {{"kv_head", g.kv_head},
                                                             {"layer", g.layer},
                                                             {"model", model->name},
                                                             {"model_id", model->id}};
      head.metric.push_back(gauge(labels, model->heads.gauge[i]));
      head_hist.metric.push_back(histogram(std::move(labels), model->heads.histogram[i]));
    }
    for (size_t i = 0; i < model->layers.groups.size(); ++i) {
      std::vector<prometheus::ClientMetric::Label> labels = {
          {"layer", model->layers.groups[i].layer},
          {"model", model->name},
          {"model_id", model->id}};
      layer.metric.push_back(gauge(labels, model->layers.gauge[i]));
      layer_hist.metric.push_back(histogram(std::move(labels), model->layers.histogram[i]));
    }
    series.metric.push_back(gauge({{"granularity", GranularityName(model->granularity)},
                                   {"model", model->name},
                                   {"model_id", model->id}},
                                  static_cast<double>(model->heads.groups.size())));
  }
  std::vector<prometheus::MetricFamily> out;
  for (auto* family : {&head, &head_hist, &layer, &layer_hist, &series}) {
    if (!family->metric.empty()) out.push_back(std::move(*family));
  }
  return out;
}

}  // namespace laprox::service
