// The shared fixture of the service tests: the real server, started as laproxd starts it
// (service/server.h: Core on the CPU backend, the work queues, LaproxService, callers identified
// by SO_PEERCRED) on a temporary Unix socket, one prefill's fp32 inputs in a real
// POSIX shared-memory object, and the helpers that register them and build a good request.
// Each test may break one thing in that request and check the server's answer.
#ifndef LAPROX_TESTS_SERVICE_SERVER_FIXTURE_H_
#define LAPROX_TESTS_SERVICE_SERVER_FIXTURE_H_

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "laprox/kernels/registry.h"
#include "laprox/v1/laprox.grpc.pb.h"
#include "laprox/v1/plan_wire.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/server.h"
#include "tests/common/test_server.h"

namespace laprox::service {
// SmolLM2-like but small: L=3, H=6, Hkv=2, d=16, D=48, n=300, w=32.
constexpr int kL = 3, kH = 6, kHkv = 2, kD = 16, kHidden = 48, kWindow = 32;
constexpr int64_t kN = 300;

// The inputs of one prefill, all fp32, laid out in one shared-memory object:
// per layer keys [Hkv,n,d], values [Hkv,n,d], queries [H,w,d].
class Prefill {
 public:
  explicit Prefill(uint32_t seed, int64_t n = kN)
      : name_(absl::StrCat("laprox-itest-", getpid(), "-", seed)), n_(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    floats_.resize(kL * LayerFloats());
    for (float& x : floats_) x = normal(rng);
    for (int l = 0; l < kL; ++l) {
      o_proj_.emplace_back(kHidden * kH * kD);
      for (float& x : o_proj_.back()) x = normal(rng) * 0.1f;
    }
    const int fd = shm_open(("/" + name_).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(Bytes())), 0);
    void* p = mmap(nullptr, Bytes(), PROT_WRITE, MAP_SHARED, fd, 0);
    std::memcpy(p, floats_.data(), Bytes());
    munmap(p, Bytes());
    close(fd);
  }
  ~Prefill() { shm_unlink(("/" + name_).c_str()); }

  int64_t n() const { return n_; }
  int64_t KvFloats() const { return int64_t{kHkv} * n_ * kD; }
  static int64_t QFloats() { return int64_t{kH} * kWindow * kD; }
  int64_t LayerFloats() const { return 2 * KvFloats() + QFloats(); }
  int64_t Bytes() const { return static_cast<int64_t>(floats_.size()) * 4; }
  const std::string& name() const { return name_; }
  const float* layer(int l) const { return floats_.data() + l * LayerFloats(); }
  const std::vector<float>& o_proj(int l) const { return o_proj_[l]; }

 private:
  std::string name_;
  int64_t n_;
  std::vector<float> floats_;
  std::vector<std::vector<float>> o_proj_;
};

inline void SetRegionTensor(v1::TensorRef* t, uint64_t region, int64_t float_offset,
                            std::initializer_list<int64_t> shape) {
  t->mutable_region()->set_region_id(region);
  t->mutable_region()->set_byte_offset(float_offset * 4);
  t->set_dtype(v1::DTYPE_F32);
  for (int64_t s : shape) t->add_shape(s);
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer({}); }

  // `workers` and `max_pending`: the compute queue's. `options` may set anything else; the
  // backend (cpu), the socket (a fresh temporary path) and the metrics port (none) are the
  // fixture's.
  void StartServer(CoreLimits limits, ServerOptions options = {}, int workers = 2,
                   int64_t max_pending = 64) {
    server_.reset();  // a test may start its own server after SetUp's: stop that one first
    options.backend = "cpu";
    options.limits = limits;
    options.workers = workers;
    options.max_pending = max_pending;
    options.socket = testing::TestServer::TempSocketPath("laprox");
    options.metrics_listen.clear();
    absl::StatusOr<std::unique_ptr<Server>> started = Server::Start(std::move(options));
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    core_ = &server_->core();
    work_ = &server_->work();
    socket_ = server_->socket();
    stub_ = v1::Laprox::NewStub(
        grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override { server_.reset(); }

  grpc::Status Call(auto method, const auto& request, auto* response,
                    std::chrono::seconds timeout = std::chrono::seconds(60)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    return (stub_.get()->*method)(&context, request, response);
  }

  uint64_t RegisterRegion(const Prefill& prefill, bool writable = false) {
    v1::RegisterRegionRequest request;
    request.mutable_shm()->set_name(prefill.name());
    request.mutable_shm()->set_byte_size(prefill.Bytes());
    request.set_writable(writable);
    v1::RegisterRegionResponse response;
    EXPECT_TRUE(Call(&v1::Laprox::Stub::RegisterRegion, request, &response).ok());
    return response.region_id();
  }

  uint64_t RegisterModel(const Prefill& prefill) {
    v1::RegisterModelRequest request;
    request.set_name("itest");
    v1::ModelGeometry* g = request.mutable_geometry();
    g->set_num_layers(kL);
    g->set_num_heads(kH);
    g->set_num_kv_heads(kHkv);
    g->set_head_dim(kD);
    g->set_hidden_size(kHidden);
    for (int l = 0; l < kL; ++l) {
      v1::TensorRef* t = request.add_o_proj();
      t->set_inline_bytes(prefill.o_proj(l).data(), prefill.o_proj(l).size() * 4);
      t->set_dtype(v1::DTYPE_F32);
      t->add_shape(kHidden);
      t->add_shape(kH * kD);
    }
    v1::RegisterModelResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::RegisterModel, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.model_id();
  }

  static v1::ComputeKeepMaskRequest GoodRequest(uint64_t model, uint64_t region,
                                                const Prefill& prefill) {
    const int64_t n = prefill.n();
    v1::ComputeKeepMaskRequest request;
    request.set_model_id(model);
    request.set_n(n);
    request.mutable_budget()->set_tokens_per_head(64);
    request.mutable_outputs()->set_bitmask(true);
    for (int l = 0; l < kL; ++l) {
      v1::LayerInputs* in = request.add_layers();
      const int64_t base = l * prefill.LayerFloats();
      SetRegionTensor(in->mutable_keys(), region, base, {kHkv, n, kD});
      SetRegionTensor(in->mutable_values(), region, base + prefill.KvFloats(), {kHkv, n, kD});
      SetRegionTensor(in->mutable_window_queries(), region, base + 2 * prefill.KvFloats(),
                      {kH, kWindow, kD});
    }
    return request;
  }

  // The same plan from the library, called directly on the same memory.
  static kernels::KeepPlan DirectPlan(const Prefill& prefill, kernels::PolicySpec policy = {}) {
    auto backend = *kernels::CreateBackend("cpu");
    kernels::ModelGeometry geometry{kL, kH, kHkv, kD, kHidden, 0.f};
    std::vector<kernels::TensorView> o_proj;
    for (int l = 0; l < kL; ++l) {
      o_proj.emplace_back(prefill.o_proj(l).data(), kernels::DType::kF32,
                          kernels::Dims{kHidden, kH * kD});
    }
    auto model = *backend->PrepareModel(geometry, o_proj);
    kernels::KeepPlanRequest request;
    request.n = kN;
    request.policy = policy;
    request.policy.budget = kernels::Budget::TokensPerHead(64);
    for (int l = 0; l < kL; ++l) {
      const float* base = prefill.layer(l);
      kernels::LayerInputs& in = request.layers.emplace_back();
      in.keys = {base, kernels::DType::kF32, {kHkv, kN, kD}};
      in.values = {base + prefill.KvFloats(), kernels::DType::kF32, {kHkv, kN, kD}};
      in.window_queries = {base + 2 * prefill.KvFloats(), kernels::DType::kF32, {kH, kWindow, kD}};
    }
    return *backend->ComputeKeepPlan(*model, request);
  }

  // The server answers a good request on this prefill (a region and a model registered for it)
  // with the library's plan.
  void ExpectServes(const Prefill& prefill) {
    const uint64_t region = RegisterRegion(prefill);
    const uint64_t model = RegisterModel(prefill);
    v1::ComputeKeepMaskResponse response;
    grpc::Status s =
        Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_THAT(v1::PositionsOf(response),
                ::testing::ElementsAreArray(DirectPlan(prefill).positions));
  }
  void ExpectServes(uint32_t seed) { ExpectServes(Prefill(seed)); }

  std::vector<v1::RegionInfo> Regions() {
    v1::ListRegionsResponse response;
    EXPECT_TRUE(Call(&v1::Laprox::Stub::ListRegions, v1::ListRegionsRequest(), &response).ok());
    return {response.regions().begin(), response.regions().end()};
  }

  std::unique_ptr<Server> server_;
  Core* core_ = nullptr;       // server_'s
  WorkQueue* work_ = nullptr;  // server_'s compute queue
  std::unique_ptr<v1::Laprox::Stub> stub_;
  std::string socket_;
};
}  // namespace laprox::service

#endif  // LAPROX_TESTS_SERVICE_SERVER_FIXTURE_H_
