// liblaprox_client against an in-process laproxd (real gRPC over a temporary Unix socket, real
// shared memory): the plan equals the library's, errors keep their code and message, and shared
// buffers are unregistered and unlinked when destroyed.
#include "laprox/client/client.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"
#include "tests/common/test_server.h"

namespace laprox::client {
namespace {

constexpr int kL = 2, kH = 4, kHkv = 2, kD = 8, kHidden = 16, kWindow = 8;
constexpr int64_t kN = 100;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    core_ = std::make_unique<service::Core>(*kernels::CreateBackend("cpu"), service::CoreLimits{});
    work_ = std::make_unique<service::WorkQueue>(2, 16);
    service_ = std::make_unique<service::LaproxService>(*core_, *work_, "client-test",
                                                        laprox::testing::ActAsLaproxd());
    server_ = laprox::testing::TestServer::Start(service_.get(), "laprox-client");
    ASSERT_NE(server_, nullptr);
    auto client = Client::Connect(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  void TearDown() override {
    client_.reset();
    server_.reset();
    work_.reset();
  }

  // Registers a model of the test geometry with seeded random o_proj (kept in `o_proj`, one
  // [kHidden, kH * kD] matrix per layer, for the library's own plan).
  absl::StatusOr<uint64_t> RegisterRandomModel(const std::string& name, std::mt19937& rng,
                                               std::vector<std::vector<float>>& o_proj) {
    std::normal_distribution<float> normal(0.f, 1.f);
    o_proj.assign(kL, std::vector<float>(kHidden * kH * kD));
    for (auto& w : o_proj) {
      for (float& x : w) x = normal(rng);
    }
    std::vector<TensorRef> refs;
    for (const auto& w : o_proj) {
      refs.push_back(TensorRef::Inline(w.data(), DType::kF32, {kHidden, kH * kD}));
    }
    return client_->RegisterModel(name, {kL, kH, kHkv, kD, kHidden, 0.f}, refs);
  }

  std::unique_ptr<service::Core> core_;
  std::unique_ptr<service::WorkQueue> work_;
  std::unique_ptr<service::LaproxService> service_;
  std::unique_ptr<laprox::testing::TestServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientTest, ServerInfo) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, "client-test");
  EXPECT_EQ(info->backend, "cpu");
  EXPECT_GT(info->max_tokens, 0);
  EXPECT_EQ(info->max_request_work, int64_t{1} << 42);  // the CPU backend's default
  EXPECT_EQ(info->heavy_request_work, int64_t{1} << 34);
  EXPECT_EQ(info->supported_policies.size(), 8u);
}

TEST_F(ClientTest, KeepPlanThroughSharedBufferEqualsTheLibrary) {
  const int64_t kv = int64_t{kHkv} * kN * kD, q = int64_t{kH} * kWindow * kD;
  const int64_t layer_floats = 2 * kv + q;
  auto buffer = client_->ShareHostBuffer(absl::StrCat("laprox-client-test-", getpid()),
                                         kL * layer_floats * sizeof(float));
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto* floats = reinterpret_cast<float*>(buffer->data());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < kL * layer_floats; ++i) floats[i] = normal(rng);
  std::vector<std::vector<float>> o_proj(kL, std::vector<float>(kHidden * kH * kD));
  for (auto& w : o_proj) {
    for (float& x : w) x = normal(rng);
  }

  const ModelGeometry geometry{kL, kH, kHkv, kD, kHidden, 0.f};
  std::vector<TensorRef> o_proj_refs;
  for (const auto& w : o_proj) {
    o_proj_refs.push_back(TensorRef::Inline(w.data(), DType::kF32, {kHidden, kH * kD}));
  }
  auto model = client_->RegisterModel("tiny", geometry, o_proj_refs);
  ASSERT_TRUE(model.ok()) << model.status();

  std::vector<LayerRefs> layers;
  for (int l = 0; l < kL; ++l) {
    const int64_t base = l * layer_floats * 4;
    const uint64_t region = buffer->region_id();
    LayerRefs& refs = layers.emplace_back();
    refs.keys = TensorRef::InRegion(region, base, DType::kF32, {kHkv, kN, kD});
    refs.values = TensorRef::InRegion(region, base + kv * 4, DType::kF32, {kHkv, kN, kD});
    refs.window_queries =
        TensorRef::InRegion(region, base + 2 * kv * 4, DType::kF32, {kH, kWindow, kD});
  }
  PolicySpec policy;
  policy.window = kWindow;
  policy.budget = kernels::Budget::TokensPerHead(30);
  ServerTiming server;
  const absl::Time sent = absl::Now();
  auto plan = client_->ComputeKeepPlan(*model, kN, layers, policy, {.bitmask = true}, &server);
  const double round_trip = absl::ToDoubleSeconds(absl::Now() - sent);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The server's stage times come back: every stage inside its total, the total inside the
  // round trip the client saw.
  const kernels::PlanTiming& stages = plan->timing;
  EXPECT_GT(stages.score_seconds, 0);
  EXPECT_GT(stages.select_seconds, 0);
  EXPECT_GT(server.total_seconds, 0);
  EXPECT_LE(server.queue_seconds + stages.validate_seconds + stages.score_seconds +
                stages.select_seconds + server.respond_seconds,
            server.total_seconds * (1 + 1e-9));
  EXPECT_LT(server.total_seconds, round_trip);

  // The library on the same memory.
  auto backend = *kernels::CreateBackend("cpu");
  std::vector<kernels::TensorView> o_views;
  for (const auto& w : o_proj) {
    o_views.emplace_back(w.data(), DType::kF32, kernels::Dims{kHidden, kH * kD});
  }
  auto prepared = *backend->PrepareModel(geometry, o_views);
  kernels::KeepPlanRequest request;
  request.n = kN;
  request.policy = policy;
  for (int l = 0; l < kL; ++l) {
    const float* base = floats + l * layer_floats;
    kernels::LayerInputs& in = request.layers.emplace_back();
    in.keys = {base, DType::kF32, {kHkv, kN, kD}};
    in.values = {base + kv, DType::kF32, {kHkv, kN, kD}};
    in.window_queries = {base + 2 * kv, DType::kF32, {kH, kWindow, kD}};
  }
  const kernels::KeepPlan direct = *backend->ComputeKeepPlan(*prepared, request);
  EXPECT_EQ(plan->counts, direct.counts);
  EXPECT_EQ(plan->positions, direct.positions);
  EXPECT_EQ(plan->layer_sums, direct.layer_sums);
  EXPECT_EQ(plan->kept(1, 1).size(), static_cast<size_t>(direct.count(1, 1)));
  EXPECT_EQ(plan->bitmask.size(), static_cast<size_t>(kL * kHkv * ((kN + 7) / 8)));

  // The same plan written into a writable region (positions after the bitmask, both
  // 4-aligned), left out of the returned plan.
  const size_t mask_bytes = plan->bitmask.size(), positions_at = (mask_bytes + 3) / 4 * 4;
  auto out = client_->ShareHostBuffer(absl::StrCat("laprox-client-test-out-", getpid()),
                                      positions_at + direct.positions.size() * 4,
                                      /*writable=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  std::memset(out->data(), 0xee, out->size());
  const client::OutputDestination to = {
      .region_id = out->region_id(), .positions_offset = positions_at, .bitmask_offset = 0};
  auto written = client_->ComputeKeepPlanInto(*model, kN, layers, policy, to);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->counts, direct.counts);
  EXPECT_EQ(written->offsets, direct.offsets);
  EXPECT_TRUE(written->positions.empty());
  EXPECT_TRUE(written->bitmask.empty());
  std::vector<int32_t> positions(direct.positions.size());
  std::memcpy(positions.data(), out->data() + positions_at, positions.size() * 4);
  EXPECT_EQ(positions, direct.positions);
  EXPECT_EQ(std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(out->data()),
                                 reinterpret_cast<const uint8_t*>(out->data()) + mask_bytes),
            plan->bitmask);
  // The inputs' region was registered read-only: the server refuses to write there.
  const absl::Status refused =
      client_
          ->ComputeKeepPlanInto(*model, kN, layers, policy,
                                {.region_id = buffer->region_id(), .positions_offset = 0})
          .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("read-only"));
  out = absl::CancelledError("released");  // unregisters the output region

  // Baselines, with every option the client sends: the server applies exactly the same policy.
  for (PolicyKind kind : {PolicyKind::kStreamingLlm, PolicyKind::kCriticalAdaKv,
                          PolicyKind::kPyramidKv, PolicyKind::kCake}) {
    PolicySpec baseline = PolicySpec::ForKind(kind);
    baseline.window = kWindow;
    baseline.numeric_mode = NumericMode::kKvpressCompat;
    baseline.budget = kernels::Budget::CompressionRatio(0.6);
    baseline.baseline = {.pyramid_beta = 3,
                         .alpha_safeguard = 0.5,
                         .epsilon = 0.01,
                         .first_stage_ratio = 0.25,
                         .cake_tau1 = 1,
                         .cake_tau2 = 2,
                         .cake_gamma = 10};
    auto remote = client_->ComputeKeepPlan(*model, kN, layers, baseline);
    ASSERT_TRUE(remote.ok()) << remote.status();
    request.policy = baseline;
    const kernels::KeepPlan local = *backend->ComputeKeepPlan(*prepared, request);
    EXPECT_EQ(remote->counts, local.counts) << kernels::PolicyKindName(kind);
    EXPECT_EQ(remote->positions, local.positions) << kernels::PolicyKindName(kind);
    EXPECT_EQ(remote->layer_sums, local.layer_sums) << kernels::PolicyKindName(kind);
  }

  // Destroying the buffer unregisters the region and unlinks the object.
  ASSERT_EQ(core_->regions().List(service::Owner::Laproxd()).size(), 1u);
  const std::string name = buffer->name();
  *buffer = SharedBuffer(std::move(*buffer));  // moves keep it registered
  ASSERT_EQ(core_->regions().List(service::Owner::Laproxd()).size(), 1u);
  buffer = absl::CancelledError("done");
  EXPECT_TRUE(core_->regions().List(service::Owner::Laproxd()).empty());
  EXPECT_EQ(access(("/dev/shm/" + name).c_str(), F_OK), -1);
}

// A decode re-plan (SequenceRequest::cache): layers holding different numbers of entries at
// token positions past the prompt. The plan equals the library's plan of the same entries, its
// positions mapped to tokens; a repeated position is INVALID_ARGUMENT naming it.
TEST_F(ClientTest, DecodeReplanEqualsTheLibraryInTokenPositions) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<std::vector<float>> o_proj;
  auto model = RegisterRandomModel("tiny-decode", rng, o_proj);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelGeometry geometry{kL, kH, kHkv, kD, kHidden, 0.f};

  const std::vector<int64_t> entries = {70, 45};  // layer 0 holds more than layer 1
  std::vector<std::vector<float>> keys(kL), values(kL), queries(kL);
  SequenceRequest sequence;
  sequence.n = 70;
  sequence.policy.window = kWindow;
  sequence.policy.budget = kernels::Budget::TokensPerHead(30);
  sequence.cache.emplace();
  kernels::KeepPlanRequest request;
  request.n = 70;
  request.policy = sequence.policy;
  for (int l = 0; l < kL; ++l) {
    const int64_t n_l = entries[l];
    for (auto* t : {&keys[l], &values[l]}) {
      t->resize(kHkv * n_l * kD);
      for (float& x : *t) x = normal(rng);
    }
    queries[l].resize(kH * kWindow * kD);
    for (float& x : queries[l]) x = normal(rng);
    LayerRefs& refs = sequence.layers.emplace_back();
    refs.keys = TensorRef::Inline(keys[l].data(), DType::kF32, {kHkv, n_l, kD});
    refs.values = TensorRef::Inline(values[l].data(), DType::kF32, {kHkv, n_l, kD});
    refs.window_queries = TensorRef::Inline(queries[l].data(), DType::kF32, {kH, kWindow, kD});
    // Every head keeps every third token before the window, then the window's 8 at 500..507.
    CacheLayer& cache = sequence.cache->emplace_back();
    cache.entries = n_l;
    for (int g = 0; g < kHkv; ++g) {
      for (int64_t i = 0; i < n_l - kWindow; ++i) cache.positions.push_back(3 * i + g);
      for (int64_t i = 0; i < kWindow; ++i) cache.positions.push_back(500 + i);
    }
    kernels::LayerInputs& in = request.layers.emplace_back();
    in.keys = {keys[l].data(), DType::kF32, {kHkv, n_l, kD}};
    in.values = {values[l].data(), DType::kF32, {kHkv, n_l, kD}};
    in.window_queries = {queries[l].data(), DType::kF32, {kH, kWindow, kD}};
  }
  request.layer_entries = entries;
  auto plan = client_->ComputeKeepPlan(*model, sequence);
  ASSERT_TRUE(plan.ok()) << plan.status();

  auto backend = *kernels::CreateBackend("cpu");
  std::vector<kernels::TensorView> o_views;
  for (const auto& w : o_proj) {
    o_views.emplace_back(w.data(), DType::kF32, kernels::Dims{kHidden, kH * kD});
  }
  auto prepared = *backend->PrepareModel(geometry, o_views);
  const kernels::KeepPlan direct = *backend->ComputeKeepPlan(*prepared, request);
  EXPECT_EQ(plan->counts, direct.counts);
  EXPECT_EQ(plan->layer_sums, direct.layer_sums);
  ASSERT_EQ(plan->positions.size(), direct.positions.size());
  for (int l = 0; l < kL; ++l) {
    for (int g = 0; g < kHkv; ++g) {
      const int64_t row = l * kHkv + g;
      for (int64_t k = direct.offsets[row]; k < direct.offsets[row + 1]; ++k) {
        EXPECT_EQ(plan->positions[k],
                  (*sequence.cache)[l].positions[g * entries[l] + direct.positions[k]]);
      }
    }
  }
  // On average the budget: L * Hkv * 30 entries.
  EXPECT_EQ(std::accumulate(plan->counts.begin(), plan->counts.end(), 0), kL * kHkv * 30);

  (*sequence.cache)[1].positions[5] = (*sequence.cache)[1].positions[4];
  const absl::Status repeated = client_->ComputeKeepPlan(*model, sequence).status();
  EXPECT_EQ(repeated.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(repeated.message()),
              ::testing::HasSubstr("cache.layers[1].positions, KV head 0, entries 4 and 5"));
}

// An engine's vLLM FlashAttention pool [2, num_blocks, block_size, Hkv, d] in a shared buffer,
// the sequence's blocks at shuffled ids: the paged plans (ragged and BLOCKS_SHARED, one batch)
// equal the library's plans of the same numbers laid out contiguously, and the block plan's new
// table maps its kept blocks through the sequence's table.
TEST_F(ClientTest, PagedVllmPoolAndABatchEqualTheLibrary) {
  constexpr int64_t kBlock = 16, kBlocks = (kN + kBlock - 1) / kBlock, kPhysical = kBlocks + 3;
  const int64_t pool_floats = 2 * kPhysical * kBlock * kHkv * kD;  // per layer
  const int64_t q_floats = int64_t{kH} * kWindow * kD;
  auto buffer = client_->ShareHostBuffer(absl::StrCat("laprox-client-paged-", getpid()),
                                         kL * (pool_floats + q_floats) * sizeof(float));
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto* floats = reinterpret_cast<float*>(buffer->data());
  std::fill(floats, floats + kL * (pool_floats + q_floats), std::nanf(""));  // spare blocks
  std::vector<int32_t> ids(kPhysical);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(8));
  ids.resize(kBlocks);
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  // Dense copies for the library: keys/values [Hkv, n, d], queries [H, w, d] per layer.
  std::vector<std::vector<float>> keys(kL), values(kL), queries(kL), o_proj(kL);
  for (int l = 0; l < kL; ++l) {
    float* pool = floats + l * (pool_floats + q_floats);
    for (auto* dense : {&keys[l], &values[l]}) dense->resize(kHkv * kN * kD);
    for (int64_t h = 0; h < kHkv; ++h) {
      for (int64_t i = 0; i < kN; ++i) {
        for (int64_t c = 0; c < kD; ++c) {
          const int64_t at =
              ids[i / kBlock] * kBlock * kHkv * kD + (i % kBlock) * kHkv * kD + h * kD + c;
          keys[l][(h * kN + i) * kD + c] = pool[at] = normal(rng);
          values[l][(h * kN + i) * kD + c] = pool[pool_floats / 2 + at] = normal(rng);
        }
      }
    }
    queries[l].resize(q_floats);
    for (int64_t j = 0; j < q_floats; ++j) queries[l][j] = pool[pool_floats + j] = normal(rng);
    o_proj[l].resize(kHidden * kH * kD);
    for (float& x : o_proj[l]) x = normal(rng);
  }
  const ModelGeometry geometry{kL, kH, kHkv, kD, kHidden, 0.f};
  std::vector<TensorRef> o_proj_refs;
  for (const auto& w : o_proj) {
    o_proj_refs.push_back(TensorRef::Inline(w.data(), DType::kF32, {kHidden, kH * kD}));
  }
  auto model = client_->RegisterModel("tiny", geometry, o_proj_refs);
  ASSERT_TRUE(model.ok()) << model.status();

  SequenceRequest paged = {.n = kN, .block_tables = {{.block_ids = ids, .block_size = kBlock}}};
  paged.policy.window = kWindow;
  paged.policy.budget = kernels::Budget::TokensPerHead(40);
  for (int l = 0; l < kL; ++l) {
    const int64_t base = l * (pool_floats + q_floats) * 4;
    const PagedKv kv = PagedKv::VllmFlashAttention(buffer->region_id(), base, DType::kF32,
                                                   kPhysical, kBlock, kHkv, kD, kN, 0);
    paged.layers.push_back(
        {.keys = kv.keys,
         .values = kv.values,
         .window_queries = TensorRef::InRegion(buffer->region_id(), base + pool_floats * 4,
                                               DType::kF32, {kH, kWindow, kD})});
  }
  SequenceRequest blocks = paged;
  blocks.policy.plan_shape = kernels::PlanShape::kBlocksShared;
  const std::vector<SequenceRequest> batch = {paged, blocks};
  auto plans = client_->ComputeKeepPlans(*model, batch);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), 2u);

  auto backend = *kernels::CreateBackend("cpu");
  std::vector<kernels::TensorView> o_views;
  for (const auto& w : o_proj) {
    o_views.emplace_back(w.data(), DType::kF32, kernels::Dims{kHidden, kH * kD});
  }
  auto prepared = *backend->PrepareModel(geometry, o_views);
  for (size_t i = 0; i < batch.size(); ++i) {
    SCOPED_TRACE(i);
    kernels::KeepPlanRequest request;
    request.n = kN;
    request.policy = batch[i].policy;
    if (i == 1) request.policy.block_size = kBlock;  // contiguous here: no table to take it from
    for (int l = 0; l < kL; ++l) {
      kernels::LayerInputs& in = request.layers.emplace_back();
      in.keys = {keys[l].data(), DType::kF32, {kHkv, kN, kD}};
      in.values = {values[l].data(), DType::kF32, {kHkv, kN, kD}};
      in.window_queries = {queries[l].data(), DType::kF32, {kH, kWindow, kD}};
    }
    const kernels::KeepPlan direct = *backend->ComputeKeepPlan(*prepared, request);
    EXPECT_EQ((*plans)[i].counts, direct.counts);
    EXPECT_EQ((*plans)[i].positions, direct.positions);
    auto single = client_->ComputeKeepPlan(*model, batch[i]);
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_EQ(single->positions, direct.positions);
  }
  const kernels::BlockPlan& b = *(*plans)[1].blocks;
  EXPECT_EQ(b.block_size, kBlock);
  ASSERT_TRUE(b.paged());
  const auto kept = b.kept_blocks(0);
  ASSERT_EQ(kept.size(), 2u);  // floor(40 / 16) blocks, the window's among them
  for (size_t j = 0; j < kept.size(); ++j) EXPECT_EQ(b.new_block_table(0)[j], ids[kept[j]]);
  EXPECT_EQ(b.freed_ids(0).size(), static_cast<size_t>(kBlocks - 2));
}

TEST_F(ClientTest, ServerErrorsKeepTheirCodeAndMessage) {
  PolicySpec policy;
  auto plan = client_->ComputeKeepPlan(12345, 10, {}, policy);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plan.status().message(), "model 12345 not found");
  auto region = client_->RegisterShmRegion("not-laprox", 0, 8);
  EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(region.status().message()), ::testing::HasSubstr("laprox-"));
}

TEST_F(ClientTest, ShareHostBufferRefusesAnExistingName) {
  const std::string name = absl::StrCat("laprox-client-dup-", getpid());
  auto first = client_->ShareHostBuffer(name, 64);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(client_->ShareHostBuffer(name, 64).status().code(), absl::StatusCode::kAlreadyExists);
}

// A server whose UnregisterRegion answers `code` to the first `refusals` calls (the busy laproxd
// a full control queue makes, which a test cannot make on demand) and whose UnregisterModel is
// always RESOURCE_EXHAUSTED.
class BusyService final : public v1::Laprox::CallbackService {
 public:
  BusyService(int refusals, grpc::StatusCode code) : refusals_(refusals), code_(code) {}
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest*,
                                             v1::UnregisterRegionResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(++region_calls <= refusals_ ? grpc::Status(code_, "busy") : grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* UnregisterModel(grpc::CallbackServerContext* context,
                                            const v1::UnregisterModelRequest*,
                                            v1::UnregisterModelResponse*) override {
    ++model_calls;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "busy"));
    return reactor;
  }
  std::atomic<int> region_calls{0}, model_calls{0};

 private:
  const int refusals_;
  const grpc::StatusCode code_;
};

// The client's channel retries UnregisterRegion's RESOURCE_EXHAUSTED (the retry policy of
// proto/laprox/v1/service_config.json: 5 attempts), and nothing else.
TEST(ClientRetryTest, ABusyServersUnregisterRegionIsRetried) {
  for (const auto& [refusals, code, status, calls] :
       {std::tuple{3, grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kOk, 4},
        std::tuple{1000, grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kResourceExhausted,
                   5},
        std::tuple{1000, grpc::StatusCode::NOT_FOUND, absl::StatusCode::kNotFound, 1}}) {
    BusyService busy(refusals, code);
    auto server = laprox::testing::TestServer::Start(&busy, "laprox-busy");
    ASSERT_NE(server, nullptr);
    auto client = Client::Connect(server->target(), {.deadline = absl::Seconds(30)});
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->UnregisterRegion(7).code(), status) << refusals << " refusals";
    EXPECT_EQ(busy.region_calls, calls) << refusals << " refusals";
    EXPECT_EQ((*client)->UnregisterModel(3).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(busy.model_calls, 1);  // not a retried method
  }
}

TEST(ClientConnectTest, NothingListeningIsUnavailable) {
  auto client = Client::Connect("unix:/nonexistent/laproxd.sock", {.deadline = absl::Seconds(5)});
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace laprox::client
