// laprox.v1 over a real gRPC server on a temporary Unix socket, with real POSIX shared memory:
// keep-plans equal to the library called directly, every bad request answered with the named
// status and field, nothing leaked, and concurrent clients getting identical plans.
#include <atomic>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "laprox/kernels/registry.h"
#include "laprox/v1/laprox.grpc.pb.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"
#include "tests/service/server_fixture.h"

namespace laprox::service {
namespace {

class GrpcIntegrationTest : public ServerTest {
 protected:
  // `policy` on a good request through the server and `expected` through the library, on the
  // same prefill: the plans must be equal. Returns the policy the response echoes.
  v1::Policy PlanAsTheLibrary(int seed, const v1::Policy& policy,
                              const kernels::PolicySpec& expected) {
    Prefill prefill(seed);
    const uint64_t region = RegisterRegion(prefill);
    const uint64_t model = RegisterModel(prefill);
    v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
    *request.mutable_policy() = policy;
    v1::ComputeKeepMaskResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    const kernels::KeepPlan direct = DirectPlan(prefill, expected);
    EXPECT_THAT(response.counts(), ::testing::ElementsAreArray(direct.counts));
    EXPECT_THAT(v1::PositionsOf(response), ::testing::ElementsAreArray(direct.positions));
    EXPECT_EQ(response.window(), direct.window);
    return response.effective_policy();
  }
};

TEST_F(GrpcIntegrationTest, ServerInfoDescribesTheBackend) {
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(Call(&v1::Laprox::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.backend(), v1::BACKEND_KIND_CPU);
  EXPECT_THAT(info.backend_description(), ::testing::HasSubstr("cpu"));
  EXPECT_THAT(info.supported_policies(),
              ::testing::ElementsAre(v1::POLICY_KIND_LAPROX, v1::POLICY_KIND_STREAMING_LLM,
                                     v1::POLICY_KIND_SNAPKV, v1::POLICY_KIND_PYRAMIDKV,
                                     v1::POLICY_KIND_ADAKV, v1::POLICY_KIND_CRITICALKV,
                                     v1::POLICY_KIND_CRITICAL_ADAKV, v1::POLICY_KIND_CAKE));
  EXPECT_EQ(info.limits().max_window(), kernels::PolicySpec::kMaxWindow);
  // The work limits as resolved: the CPU backend's default and 1/256 of it.
  EXPECT_EQ(info.limits().max_request_work(), int64_t{1} << 42);
  EXPECT_EQ(info.limits().heavy_request_work(), int64_t{1} << 34);
}

TEST_F(GrpcIntegrationTest, KeepPlanOverSharedMemoryEqualsTheLibrary) {
  Prefill prefill(1);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s =
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const kernels::KeepPlan direct = DirectPlan(prefill);
  EXPECT_THAT(response.counts(), ::testing::ElementsAreArray(direct.counts));
  EXPECT_THAT(v1::PositionsOf(response), ::testing::ElementsAreArray(direct.positions));
  EXPECT_THAT(response.layer_sums(), ::testing::ElementsAreArray(direct.layer_sums));
  EXPECT_EQ(response.bitmask().size(), static_cast<size_t>(kL * kHkv * ((kN + 7) / 8)));
  EXPECT_EQ(response.quota(), 64 - kWindow);
  EXPECT_EQ(response.effective_policy().window(), 32);
  EXPECT_GT(response.timing().total_seconds(), 0.0);
}

// A baseline with its options unset runs with the kind's defaults, which the response echoes.
TEST_F(GrpcIntegrationTest, BaselineWithUnsetOptionsUsesTheKindsDefaults) {
  v1::Policy policy;
  policy.set_kind(v1::POLICY_KIND_CAKE);
  policy.set_cake_gamma(50);
  kernels::PolicySpec cake = kernels::PolicySpec::ForKind(kernels::PolicyKind::kCake);
  cake.baseline.cake_gamma = 50;
  const v1::Policy applied = PlanAsTheLibrary(5, policy, cake);
  EXPECT_EQ(applied.kind(), v1::POLICY_KIND_CAKE);
  EXPECT_EQ(applied.numeric_mode(), v1::NUMERIC_MODE_EXACT);
  EXPECT_EQ(applied.window(), 32);
  EXPECT_EQ(applied.pool_kernel(), 5);
  EXPECT_EQ(applied.cake_gamma(), 50);
  EXPECT_EQ(applied.cake_tau1(), 1.6);
}

// max_layer_share travels to the kernels (the plan is the library's under the cap) and the
// response echoes it; unset, the echo leaves it unset; out of range, INVALID_ARGUMENT names it.
TEST_F(GrpcIntegrationTest, MaxLayerShareIsAppliedAndEchoed) {
  v1::Policy policy;
  policy.set_max_layer_share(1.25);
  policy.set_plan_shape(v1::PLAN_SHAPE_LAYER_UNIFORM);
  kernels::PolicySpec capped;
  capped.max_layer_share = 1.25;
  capped.plan_shape = kernels::PlanShape::kLayerUniform;
  const v1::Policy applied = PlanAsTheLibrary(9, policy, capped);
  ASSERT_TRUE(applied.has_max_layer_share());
  EXPECT_EQ(applied.max_layer_share(), 1.25);
  EXPECT_EQ(applied.plan_shape(), v1::PLAN_SHAPE_LAYER_UNIFORM);
  EXPECT_FALSE(PlanAsTheLibrary(9, v1::Policy(), kernels::PolicySpec()).has_max_layer_share());

  Prefill prefill(9);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
  request.mutable_policy()->set_max_layer_share(0.5);
  v1::ComputeKeepMaskResponse response;
  const grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("policy.max_layer_share = 0.5"));
}

// LAPROX with its options unset runs with the defaults chosen on bench/quality's dev grid and
// joint endpoint (MEAN_HEAD_PRODUCT, AVG_PEAK pool 31 of the score), which the response echoes;
// with indicator ATTENTION an unset gqa_value is MEAN_HEAD_NORM, the only one it takes.
TEST_F(GrpcIntegrationTest, LaproxWithUnsetOptionsUsesTheDefaults) {
  kernels::PolicySpec spelled_out;
  spelled_out.gqa_value = kernels::GqaValue::kMeanHeadProduct;
  spelled_out.pool_target = kernels::PoolTarget::kScore;
  spelled_out.pooling = kernels::Pooling::kAvgPeak;
  v1::Policy applied = PlanAsTheLibrary(7, v1::Policy(), spelled_out);
  EXPECT_EQ(applied.kind(), v1::POLICY_KIND_LAPROX);
  EXPECT_EQ(applied.indicator(), v1::INDICATOR_ATTENTION_X_PROJECTED_VALUE);
  EXPECT_EQ(applied.gqa_value(), v1::GQA_VALUE_MEAN_HEAD_PRODUCT);
  EXPECT_EQ(applied.pooling(), v1::POOLING_AVG_PEAK);
  EXPECT_EQ(applied.pool_kernel(), 31);
  EXPECT_EQ(applied.pool_target(), v1::POOL_TARGET_SCORE);
  EXPECT_EQ(applied.window(), 32);

  v1::Policy attention;
  attention.set_indicator(v1::INDICATOR_ATTENTION);
  kernels::PolicySpec norm;
  norm.indicator = kernels::Indicator::kAttention;
  norm.gqa_value = kernels::GqaValue::kMeanHeadNorm;
  applied = PlanAsTheLibrary(8, attention, norm);
  EXPECT_EQ(applied.indicator(), v1::INDICATOR_ATTENTION);
  EXPECT_EQ(applied.gqa_value(), v1::GQA_VALUE_MEAN_HEAD_NORM);
  EXPECT_EQ(applied.pool_kernel(), 31);
}

// The PAPER preset fills the fields the request leaves unset (an explicit field wins), the plan
// is the library's for those fields, and the response echoes them, pool_target resolved.
TEST_F(GrpcIntegrationTest, PaperPresetFillsTheUnsetFields) {
  v1::Policy policy;
  policy.set_preset(v1::POLICY_PRESET_PAPER);
  policy.set_sinks(2);
  kernels::PolicySpec paper;
  paper.gqa_value = kernels::GqaValue::kSummedProjection;
  paper.pooling = kernels::Pooling::kNone;
  paper.sinks = 2;
  const v1::Policy applied = PlanAsTheLibrary(6, policy, paper);
  EXPECT_EQ(applied.indicator(), v1::INDICATOR_ATTENTION_X_PROJECTED_VALUE);
  EXPECT_EQ(applied.allocation(), v1::ALLOCATION_GLOBAL_NORMALIZED);
  EXPECT_EQ(applied.gqa_value(), v1::GQA_VALUE_SUMMED_PROJECTION);
  EXPECT_EQ(applied.pooling(), v1::POOLING_NONE);
  EXPECT_EQ(applied.pool_target(), v1::POOL_TARGET_ATTENTION);
  EXPECT_EQ(applied.window(), 32);
  EXPECT_EQ(applied.sinks(), 2);
  EXPECT_EQ(applied.min_per_head(), 0);
  EXPECT_EQ(applied.preset(), v1::POLICY_PRESET_UNSPECIFIED);
}

// Each case breaks one thing in a good request; the server answers with the code and a message
// naming the field, stays up, leaks no region, and answers the next good request.
TEST_F(GrpcIntegrationTest, BadRequestsGetPreciseStatusesAndLeakNothing) {
  Prefill prefill(2);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  struct BadCase {
    const char* what;
    std::function<void(v1::ComputeKeepMaskRequest&)> mutate;
    grpc::StatusCode code;
    const char* message;
  };
  const std::vector<BadCase> cases = {
      {"unknown region",
       [](auto& r) { r.mutable_layers(1)->mutable_keys()->mutable_region()->set_region_id(999); },
       grpc::StatusCode::NOT_FOUND, "layers[1].keys: region 999 not found"},
      {"unknown model", [](auto& r) { r.set_model_id(77); }, grpc::StatusCode::NOT_FOUND,
       "model 77 not found"},
      {"offset + extent past the region",
       [&](auto& r) {
         r.mutable_layers(2)->mutable_window_queries()->mutable_region()->set_byte_offset(
             prefill.Bytes() - 100);
       },
       grpc::StatusCode::OUT_OF_RANGE, "layers[2].window_queries: bytes ["},
      {"overflow-sized shape",
       [](auto& r) {
         auto* keys = r.mutable_layers(0)->mutable_keys();
         keys->add_strides(std::numeric_limits<int64_t>::max() / 2);
         keys->add_strides(kD);
         keys->add_strides(1);
       },
       grpc::StatusCode::OUT_OF_RANGE, "layers[0].keys"},
      {"dtype not set",
       [](auto& r) { r.mutable_layers(0)->mutable_values()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].values.dtype = DTYPE_UNSPECIFIED"},
      {"shape contradicts the geometry",
       [](auto& r) { r.mutable_layers(1)->mutable_values()->set_shape(2, kD + 1); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[1].values has shape [2, 300, 17]"},
      {"inline byte count off by one",
       [](auto& r) {
         auto* q = r.mutable_layers(0)->mutable_window_queries();
         q->set_inline_bytes(std::string(Prefill::QFloats() * 4 - 1, '\0'));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "layers[0].window_queries.inline_bytes has 12287 bytes, expected 12288"},
      {"negative budget", [](auto& r) { r.mutable_budget()->set_tokens_per_head(-5); },
       grpc::StatusCode::INVALID_ARGUMENT, "budget.tokens_per_head = -5"},
      {"compression ratio 1.0", [](auto& r) { r.mutable_budget()->set_compression_ratio(1.0); },
       grpc::StatusCode::INVALID_ARGUMENT, "budget.compression_ratio = 1"},
      {"budget missing", [](auto& r) { r.clear_budget(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "budget is missing"},
      {"keys missing", [](auto& r) { r.mutable_layers(2)->clear_keys(); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[2].keys is missing"},
      {"unknown policy kind",
       [](auto& r) { r.mutable_policy()->set_kind(static_cast<v1::PolicyKind>(99)); },
       grpc::StatusCode::INVALID_ARGUMENT, "policy.kind = 99"},
      {"unknown pool target",
       [](auto& r) { r.mutable_policy()->set_pool_target(static_cast<v1::PoolTarget>(3)); },
       grpc::StatusCode::INVALID_ARGUMENT, "policy.pool_target = 3"},
      {"unknown preset",
       [](auto& r) { r.mutable_policy()->set_preset(static_cast<v1::PolicyPreset>(5)); },
       grpc::StatusCode::INVALID_ARGUMENT, "policy.preset = 5"},
      {"preset with a baseline kind",
       [](auto& r) {
         r.mutable_policy()->set_kind(v1::POLICY_KIND_CAKE);
         r.mutable_policy()->set_preset(v1::POLICY_PRESET_PAPER);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "policy.preset = POLICY_PRESET_PAPER needs policy.kind = POLICY_KIND_LAPROX, got "
       "POLICY_KIND_CAKE"},
      {"baseline default window above the rows given",
       [](auto& r) { r.mutable_policy()->set_kind(v1::POLICY_KIND_SNAPKV); },
       grpc::StatusCode::INVALID_ARGUMENT, "policy.window = 64 is larger than the 32"},
      {"baseline parameter out of range",
       [](auto& r) {
         r.mutable_policy()->set_kind(v1::POLICY_KIND_ADAKV);
         r.mutable_policy()->set_window(8);
         r.mutable_policy()->set_alpha_safeguard(1.5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "policy.alpha_safeguard = 1.5"},
  };
  for (const BadCase& c : cases) {
    v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
    c.mutate(request);
    v1::ComputeKeepMaskResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(c.message)) << c.what;
    const auto regions = Regions();
    ASSERT_EQ(regions.size(), 1u) << c.what;
    EXPECT_EQ(regions[0].in_flight_requests(), 0) << c.what;
    EXPECT_TRUE(
        Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response)
            .ok())
        << "after " << c.what;
  }
}

TEST_F(GrpcIntegrationTest, NaNInKeysIsRejectedNamingTheElement) {
  Prefill prefill(3);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  // Overwrite one key in the shared memory the server reads.
  const int fd = shm_open(("/" + prefill.name()).c_str(), O_RDWR, 0);
  auto* p = static_cast<float*>(
      mmap(nullptr, prefill.Bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  p[prefill.LayerFloats() + 5 * kD + 2] = std::numeric_limits<float>::quiet_NaN();
  v1::ComputeKeepMaskResponse response;
  grpc::Status s =
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              ::testing::HasSubstr("layers[1].keys has a non-finite value (nan) at [0, 5, 2]"));
  munmap(p, prefill.Bytes());
}

TEST_F(GrpcIntegrationTest, RegionErrorsAndLimits) {
  v1::RegisterRegionRequest request;
  v1::RegisterRegionResponse response;
  request.mutable_shm()->set_name("kv0");
  request.mutable_shm()->set_byte_size(8);
  grpc::Status s = Call(&v1::Laprox::Stub::RegisterRegion, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("must start with \"laprox-\""));
  request.mutable_shm()->set_name("laprox-does-not-exist");
  EXPECT_EQ(Call(&v1::Laprox::Stub::RegisterRegion, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  request.Clear();
  EXPECT_EQ(Call(&v1::Laprox::Stub::RegisterRegion, request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  request.mutable_cuda_ipc()->set_handle(std::string(64, 'x'));
  request.mutable_cuda_ipc()->set_device_uuid("GPU-00112233-4455-6677-8899-aabbccddeeff");
  request.mutable_cuda_ipc()->set_byte_size(8);
  EXPECT_EQ(Call(&v1::Laprox::Stub::RegisterRegion, request, &response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  v1::UnregisterRegionRequest unregister;
  unregister.set_region_id(5);
  v1::UnregisterRegionResponse unregistered;
  EXPECT_EQ(Call(&v1::Laprox::Stub::UnregisterRegion, unregister, &unregistered).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(Regions().empty());
}

// cuda_ipc on the CPU backend: malformed requests are INVALID_ARGUMENT naming the field (checked
// before the backend is asked whether it opens handles at all), a well-formed one UNIMPLEMENTED;
// nothing is left registered and the server answers the next good request. (The CUDA backend's
// answers, with real handles, are in tests/cuda/ipc_test.cc.)
TEST_F(GrpcIntegrationTest, CudaIpcRegionsOnTheCpuBackend) {
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(Call(&v1::Laprox::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_THAT(info.supported_region_kinds(), ::testing::ElementsAre(v1::REGION_KIND_SHM));
  EXPECT_TRUE(info.devices().empty());

  auto good = [] {
    v1::RegisterRegionRequest request;
    v1::CudaIpcRegion* ipc = request.mutable_cuda_ipc();
    ipc->set_handle(std::string(64, '\x01'));
    ipc->set_device_uuid("GPU-00112233-4455-6677-8899-aabbccddeeff");
    ipc->set_offset(256);
    ipc->set_byte_size(4096);
    return request;
  };
  struct BadCase {
    const char* what;
    std::function<void(v1::RegisterRegionRequest&)> mutate;
    grpc::StatusCode code;
    std::vector<std::string> message;  // substrings
  };
  const std::vector<BadCase> cases = {
      {"63-byte handle",
       [](auto& r) { r.mutable_cuda_ipc()->mutable_handle()->resize(63); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"cuda_ipc.handle", "63"}},
      {"65-byte handle",
       [](auto& r) { r.mutable_cuda_ipc()->mutable_handle()->push_back('x'); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"cuda_ipc.handle", "65"}},
      {"malformed UUID",
       [](auto& r) { r.mutable_cuda_ipc()->set_device_uuid("GPU-0011-zz"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"device_uuid", "GPU-0011-zz"}},
      {"missing UUID",
       [](auto& r) { r.mutable_cuda_ipc()->clear_device_uuid(); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"device_uuid"}},
      {"negative offset",
       [](auto& r) { r.mutable_cuda_ipc()->set_offset(-8); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"cuda_ipc.offset", "-8"}},
      {"zero byte_size",
       [](auto& r) { r.mutable_cuda_ipc()->set_byte_size(0); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"cuda_ipc.byte_size"}},
      {"well formed (the CPU backend cannot open it)",
       [](auto&) {},
       grpc::StatusCode::UNIMPLEMENTED,
       {"cuda_ipc", "CUDA backend"}},
  };
  for (const BadCase& c : cases) {
    v1::RegisterRegionRequest request = good();
    c.mutate(request);
    v1::RegisterRegionResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::RegisterRegion, request, &response);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    for (const std::string& part : c.message) {
      EXPECT_THAT(s.error_message(), ::testing::HasSubstr(part)) << c.what;
    }
    // The handle bytes never come back in a message.
    EXPECT_THAT(s.error_message(), ::testing::Not(::testing::HasSubstr("\x01\x01"))) << c.what;
    EXPECT_EQ(response.region_id(), 0u) << c.what;
  }
  EXPECT_TRUE(Regions().empty());

  // The server still answers a good request.
  Prefill prefill(9);
  ExpectServes(prefill);
  const std::vector<v1::RegionInfo> regions = Regions();
  ASSERT_EQ(regions.size(), 1u);
  EXPECT_EQ(regions[0].kind(), v1::REGION_KIND_SHM);
  EXPECT_EQ(regions[0].name(), prefill.name());
  EXPECT_EQ(regions[0].device_uuid(), "");
}

TEST_F(GrpcIntegrationTest, SequenceLengthAboveTheLimitIsOutOfRange) {
  TearDown();
  StartServer({.max_tokens = 200});
  Prefill prefill(4);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s =
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(s.error_message(),
              ::testing::HasSubstr("n = 300 exceeds this server's limit of 200 tokens"));
}

// 16 clients x 50 requests on one shared region and model: every plan equals the single one.
TEST_F(GrpcIntegrationTest, ConcurrentClientsGetIdenticalPlans) {
  Prefill prefill(5);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  const kernels::KeepPlan direct = DirectPlan(prefill);
  std::atomic<int> mismatches{0}, failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&] {
      auto stub = v1::Laprox::NewStub(
          grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
      for (int i = 0; i < 50; ++i) {
        grpc::ClientContext context;
        v1::ComputeKeepMaskResponse response;
        if (!stub->ComputeKeepMask(&context, GoodRequest(model, region, prefill), &response).ok()) {
          ++failures;
          continue;
        }
        if (v1::PositionsOf(response) != direct.positions) {
          ++mismatches;
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(Regions()[0].in_flight_requests(), 0);
}

// Outputs written into a writable region the client registered instead of the response.
TEST_F(GrpcIntegrationTest, WritesOutputsIntoAWritableRegion) {
  Prefill prefill(7);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse reference;
  ASSERT_TRUE(
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &reference)
          .ok());

  // An output area of 64 KiB, registered writable.
  const std::string name = absl::StrCat("laprox-itest-out-", getpid());
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_EQ(ftruncate(fd, 65536), 0);
  auto* out = static_cast<std::byte*>(mmap(nullptr, 65536, PROT_READ, MAP_SHARED, fd, 0));
  close(fd);
  v1::RegisterRegionRequest reg;
  reg.mutable_shm()->set_name(name);
  reg.mutable_shm()->set_byte_size(65536);
  reg.set_writable(true);
  v1::RegisterRegionResponse registered;
  ASSERT_TRUE(Call(&v1::Laprox::Stub::RegisterRegion, reg, &registered).ok());

  v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
  v1::OutputDestination* to = request.mutable_outputs()->mutable_destination();
  to->set_region_id(registered.region_id());
  to->set_positions_offset(0);
  to->set_bitmask_offset(32768);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(v1::PositionsOf(response).size(), 0);  // written to the region instead
  EXPECT_TRUE(response.bitmask().empty());
  EXPECT_THAT(response.counts(), ::testing::ElementsAreArray(reference.counts()));
  EXPECT_EQ(std::memcmp(out, reference.positions().data(), reference.positions().size()), 0);
  EXPECT_EQ(std::memcmp(out + 32768, reference.bitmask().data(), reference.bitmask().size()), 0);

  // Too small an area and a read-only region are refused.
  to->set_positions_offset(65536 - 8);
  EXPECT_EQ(Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  to->set_positions_offset(0);
  to->set_region_id(region);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("read-only"));
  munmap(out, 65536);
  shm_unlink(("/" + name).c_str());
}

// UnregisterRegion while a request reads the region: the request completes with its plan, the
// unregistration returns after it, and the region is gone.
TEST_F(GrpcIntegrationTest, UnregisterWaitsForTheRequestUsingTheRegion) {
  Prefill prefill(6, /*n=*/60000);  // long enough (tens of ms) to be caught in flight
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse plan;
  grpc::Status plan_status;
  std::thread request([&] {
    plan_status =
        Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &plan);
  });
  // Bounded poll (no sleeps) until the request holds its lease on the region.
  bool in_flight = false;
  for (int polls = 0; polls < 100000 && !in_flight; ++polls) {
    const auto regions = Regions();
    in_flight = !regions.empty() && regions[0].in_flight_requests() == 1;
  }
  ASSERT_TRUE(in_flight) << "the request was never seen holding the region";
  v1::UnregisterRegionRequest unregister;
  unregister.set_region_id(region);
  v1::UnregisterRegionResponse unregistered;
  grpc::Status s = Call(&v1::Laprox::Stub::UnregisterRegion, unregister, &unregistered);
  request.join();
  EXPECT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(plan_status.ok()) << plan_status.error_message();
  EXPECT_EQ(plan.counts_size(), kL * kHkv);
  EXPECT_TRUE(Regions().empty());
}

// Every compute worker busy and the compute backlog full (jobs that wait on a notification
// stand for long keep-plans): keep-plans are refused, the control plane still answers.
TEST_F(GrpcIntegrationTest, ControlPlaneAnswersWhileTheComputeQueueIsFull) {
  TearDown();
  StartServer({}, {}, /*workers=*/1, /*max_pending=*/1);
  Prefill prefill(7);
  absl::Notification release, busy;
  // The blocked worker is released on every way out of the test (TearDown joins it).
  absl::Cleanup unblock = [&] {
    if (!release.HasBeenNotified()) release.Notify();
  };
  ASSERT_TRUE(work_
                  ->Submit([&] {
                    busy.Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  busy.WaitForNotification();
  ASSERT_TRUE(work_->Submit([] {}).ok());  // the one backlog slot
  ASSERT_FALSE(work_->Submit([] {}).ok());

  const uint64_t region = RegisterRegion(prefill);
  ASSERT_NE(region, 0u);
  const uint64_t model = RegisterModel(prefill);
  ASSERT_NE(model, 0u);
  EXPECT_EQ(Regions().size(), 1u);
  v1::GetServerInfoResponse info;
  EXPECT_TRUE(Call(&v1::Laprox::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info).ok());
  v1::ComputeKeepMaskResponse plan;
  grpc::Status refused =
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &plan);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  // A second region, unregistered while the queue is still full (draining waits for nothing).
  const uint64_t second = RegisterRegion(prefill);
  v1::UnregisterRegionRequest unregister;
  unregister.set_region_id(second);
  v1::UnregisterRegionResponse unregistered;
  grpc::Status s = Call(&v1::Laprox::Stub::UnregisterRegion, unregister, &unregistered,
                        std::chrono::seconds(10));
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Regions().size(), 1u);

  std::move(unblock).Invoke();
  // Once the workers are free again, the same request is served.
  grpc::Status served = grpc::Status::CANCELLED;
  for (int tries = 0; tries < 1000 && !served.ok(); ++tries) {
    served = Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &plan);
  }
  EXPECT_TRUE(served.ok()) << served.error_message();
  v1::UnregisterModelRequest drop_model;
  drop_model.set_model_id(model);
  v1::UnregisterModelResponse dropped;
  EXPECT_TRUE(Call(&v1::Laprox::Stub::UnregisterModel, drop_model, &dropped).ok());
}

}  // namespace
}  // namespace laprox::service
