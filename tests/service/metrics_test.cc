// laproxd's metrics after a known sequence of calls, read back through prometheus-cpp's text
// serializer (what /metrics serves): counts by method and code, tokens in and kept, the budget
// share of every (layer, KV head) recomputed from the returned plans, readiness, and the
// per-model series disappearing with their model. Real gRPC over a temporary Unix socket.
#include "service/metrics/metrics.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "laprox/client/client.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"
#include "service/metrics/http_exposer.h"
#include "tests/common/test_server.h"

namespace laprox::service {
namespace {

constexpr int kL = 3, kH = 4, kHkv = 2, kD = 8, kHidden = 16, kWindow = 8;
constexpr int64_t kN = 120;

// The value of one series in Prometheus' text format; nullopt when the series is absent.
std::optional<double> Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series) || line.size() <= series.size() ||
        line[series.size()] != ' ') {
      continue;
    }
    double value = 0;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
  }
  return std::nullopt;
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    core_ = std::make_unique<Core>(*kernels::CreateBackend("cpu"), CoreLimits{.max_regions = 8});
    work_ = std::make_unique<WorkQueue>(2, 16);
    metrics_ = std::make_unique<Metrics>(
        std::make_shared<prometheus::Registry>(),
        MetricsOptions{.version = "test",
                       .backend = "cpu",
                       .backend_description = core_->backend().Describe(),
                       .device = "",
                       .max_regions = 8,
                       .max_models = 64,
                       .snapshot = [this] {
                         StateSnapshot s;
                         for (const RegionInfo& r : core_->regions().List()) {
                           ++s.regions_by_kind["shm"].count;
                           s.regions_by_kind["shm"].bytes += r.byte_size;
                         }
                         s.models = core_->model_totals().count;
                         s.prepared_bytes = core_->model_totals().prepared_bytes;
                         return s;
                       }});
    service_ = std::make_unique<LaproxService>(
        *core_, *work_, "test",
        ServiceOptions{.metrics = metrics_.get(), .models_changed = [this](int64_t models) {
                         metrics_->SetReady(models > 0);
                       }});
    server_ = testing::TestServer::Start(service_.get(), "laprox-metrics");
    ASSERT_NE(server_, nullptr);
    client_ = *client::Client::Connect(server_->target());

    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int l = 0; l < kL; ++l) {
      auto fill = [&](size_t count) {
        std::vector<float> v(count);
        for (float& x : v) x = normal(rng);
        return v;
      };
      o_proj_.push_back(fill(kHidden * kH * kD));
      keys_.push_back(fill(kHkv * kN * kD));
      values_.push_back(fill(kHkv * kN * kD));
      queries_.push_back(fill(kH * kWindow * kD));
    }
  }

  void TearDown() override {
    client_.reset();
    server_.reset();
    work_.reset();
  }

  std::string Text() const { return metrics_->SerializeText(); }

  uint64_t RegisterModel() {
    std::vector<client::TensorRef> o_proj;
    for (const auto& w : o_proj_) {
      o_proj.push_back(
          client::TensorRef::Inline(w.data(), kernels::DType::kF32, {kHidden, kH * kD}));
    }
    auto id = client_->RegisterModel("tiny", {kL, kH, kHkv, kD, kHidden, 0.f}, o_proj);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }

  absl::StatusOr<kernels::KeepPlan> Plan(uint64_t model, int64_t budget) {
    std::vector<client::LayerRefs> layers(kL);
    for (int l = 0; l < kL; ++l) {
      layers[l].keys =
          client::TensorRef::Inline(keys_[l].data(), kernels::DType::kF32, {kHkv, kN, kD});
      layers[l].values =
          client::TensorRef::Inline(values_[l].data(), kernels::DType::kF32, {kHkv, kN, kD});
      layers[l].window_queries =
          client::TensorRef::Inline(queries_[l].data(), kernels::DType::kF32, {kH, kWindow, kD});
    }
    kernels::PolicySpec policy;
    policy.window = kWindow;
    policy.budget = kernels::Budget::TokensPerHead(budget);
    return client_->ComputeKeepPlan(model, kN, layers, policy);
  }

  std::unique_ptr<Core> core_;
  std::unique_ptr<WorkQueue> work_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<LaproxService> service_;
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
  std::vector<std::vector<float>> o_proj_, keys_, values_, queries_;
};

TEST_F(MetricsTest, KnownCallsGiveKnownValues) {
  std::string text = Text();
  EXPECT_EQ(Sample(text, "laprox_ready"), 0);
  EXPECT_EQ(Sample(text, "laprox_registered_models"), 0);
  EXPECT_EQ(Sample(text, "laprox_limit{what=\"regions\"}"), 8);
  EXPECT_EQ(Sample(text, "laprox_build_info{version=\"test\"}"), 1);

  const uint64_t model = RegisterModel();
  text = Text();
  EXPECT_EQ(Sample(text, "laprox_ready"), 1);
  EXPECT_EQ(Sample(text, "laprox_registered_models"), 1);
  EXPECT_GT(Sample(text, "laprox_prepared_model_bytes").value_or(0), 0);

  // Three good plans with different budgets, then two refused requests.
  int64_t kept_total = 0;
  kernels::KeepPlan last;
  for (int64_t budget : {16, 40, 24}) {
    auto plan = Plan(model, budget);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int32_t c : plan->counts) kept_total += c;
    last = *plan;
  }
  EXPECT_EQ(Plan(model + 100, 16).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Plan(model, -1).status().code(), absl::StatusCode::kInvalidArgument);

  text = Text();
  const std::string compute = "method=\"ComputeKeepMask\"";
  EXPECT_EQ(Sample(text, "laprox_requests_total{code=\"OK\"," + compute + "}"), 3);
  EXPECT_EQ(Sample(text, "laprox_requests_total{code=\"NOT_FOUND\"," + compute + "}"), 1);
  EXPECT_EQ(Sample(text, "laprox_requests_total{code=\"INVALID_ARGUMENT\"," + compute + "}"), 1);
  EXPECT_EQ(Sample(text, "laprox_requests_total{code=\"OK\",method=\"RegisterModel\"}"), 1);
  EXPECT_EQ(Sample(text, "laprox_request_duration_seconds_count{" + compute + "}"), 5);
  EXPECT_EQ(Sample(text, "laprox_keep_plan_stage_duration_seconds_count{stage=\"score\"}"), 3);
  EXPECT_EQ(Sample(text, "laprox_in_flight_requests"), 0);
  EXPECT_EQ(Sample(text, "laprox_tokens_received_total"), 3 * kL * kHkv * kN);
  EXPECT_EQ(Sample(text, "laprox_tokens_kept_total"), kept_total);
  EXPECT_EQ(Sample(text, "laprox_kept_ratio_count"), 3);

  // Budget share of the last plan, recomputed from its counts.
  int64_t last_kept = 0;
  for (int32_t c : last.counts) last_kept += c;
  const double per_head = static_cast<double>(last_kept) / (kL * kHkv);
  for (int l = 0; l < kL; ++l) {
    int64_t layer_kept = 0;
    for (int h = 0; h < kHkv; ++h) {
      const std::string labels = absl::StrCat("{kv_head=\"", h, "\",layer=\"", l,
                                              "\",model=\"tiny\",model_id=\"", model, "\"}");
      const auto share = Sample(text, "laprox_head_budget_share_ratio" + labels);
      ASSERT_TRUE(share.has_value()) << labels;
      EXPECT_NEAR(*share, last.count(l, h) / per_head, 1e-9) << labels;
      EXPECT_EQ(Sample(text, "laprox_head_budget_share_distribution_count" + labels), 3);
      layer_kept += last.count(l, h);
    }
    EXPECT_NEAR(*Sample(text, absl::StrCat("laprox_layer_budget_share{layer=\"", l,
                                           "\",model=\"tiny\",model_id=\"", model, "\"}")),
                layer_kept / (static_cast<double>(last_kept) / kL), 1e-9);
  }

  // The model's series go with it.
  ASSERT_TRUE(client_->UnregisterModel(model).ok());
  text = Text();
  EXPECT_EQ(Sample(text, "laprox_ready"), 0);
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("laprox_head_budget_share_ratio{")));
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("laprox_layer_budget_share{")));
}

TEST_F(MetricsTest, RegionsAreCountedAtScrapeTime) {
  {
    auto buffer = client_->ShareHostBuffer(absl::StrCat("laprox-metrics-", getpid()), 4096);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    const std::string text = Text();
    EXPECT_EQ(Sample(text, "laprox_registered_regions{kind=\"shm\"}"), 1);
    EXPECT_EQ(Sample(text, "laprox_registered_region_bytes{kind=\"shm\"}"), 4096);
    EXPECT_EQ(Sample(text, "laprox_registered_regions{kind=\"cuda_ipc\"}"), 0);
  }  // the buffer unregisters its region
  EXPECT_EQ(Sample(Text(), "laprox_registered_regions{kind=\"shm\"}"), 0);
}

TEST(HttpExposerTest, ServesTheBodyAndRefusesBadAddresses) {
  auto exposer = HttpExposer::Start("127.0.0.1:0", [] { return std::string("x_total 1\n"); });
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  EXPECT_GT((*exposer)->port(), 0);
  EXPECT_EQ((*exposer)->Render(), "x_total 1\n");
  // A second exposer on the same port cannot listen.
  auto clash = HttpExposer::Start(absl::StrCat("127.0.0.1:", (*exposer)->port()),
                                  [] { return std::string(); });
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(HttpExposer::Start("nonsense", [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpExposer::Start("1.2.3:80", [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace laprox::service
