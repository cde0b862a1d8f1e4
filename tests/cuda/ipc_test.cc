// CUDA IPC end to end: a separate exporter process (ipc_exporter.cc) puts a seeded bf16 sample
// in device memory and exports it; an in-process laproxd service on the CUDA backend registers
// the handles as cuda_ipc regions and computes a keep-plan straight from them, which must equal
// the CPU backend's plan on the same bytes (regenerated from the seed on the host); the same
// plan written into the exporter's device memory (a writable cuda_ipc region). Also the bad
// cuda_ipc registrations (wrong handle size, garbage handle, offset past the allocation, unknown
// device) and unregistering a region while a request reads it; after each the server answers
// the next request. Skips (GTEST_SKIP, with the reason) without a CUDA device.
//
//   ctest --test-dir build -L cuda -R Ipc        # tests/gpu/run.sh runs it on a GPU machine
//
// Add a case: use IpcTest's exporter_ regions and client_, and end with ExpectServerAnswers().
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "laprox/client/client.h"
#include "laprox/kernels/registry.h"
#include "service/core/core.h"
#include "service/core/work_queue.h"
#include "service/grpc/laprox_service.h"
#include "tests/common/test_server.h"
#include "tests/cuda/ipc_sample.h"

namespace laprox::ipc_test {
namespace {

constexpr uint32_t kSeed = 20260501;
constexpr int64_t kBudget = 96;  // tokens per KV head

struct ExportedRegion {
  client::CudaIpcExport ipc;
  int64_t allocation_bytes = 0;
};

// The exporter child: started with fork+exec, its stdout read up to "ready", told to exit (and
// waited for) on destruction.
class Exporter {
 public:
  static std::unique_ptr<Exporter> Start(uint32_t seed, std::string* error) {
    // An exporter that failed has closed its stdin: telling it "exit" then must fail with EPIPE,
    // not kill the test with SIGPIPE (no one else here ignores it).
    signal(SIGPIPE, SIG_IGN);
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) {
      *error = "pipe failed";
      return nullptr;
    }
    const std::string seed_text = std::to_string(seed);
    // The build's exporter, unless LAPROX_IPC_EXPORTER names another (tests/gpu/run.sh --packed
    // runs the binaries away from the build tree).
    const char* overridden = std::getenv("LAPROX_IPC_EXPORTER");
    const std::string exporter_path = overridden != nullptr ? overridden : LAPROX_IPC_EXPORTER;
    const pid_t pid = fork();
    if (pid == 0) {  // the child: only async-signal-safe calls until exec
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      close(to_child[0]);
      close(to_child[1]);
      close(from_child[0]);
      close(from_child[1]);
      execl(exporter_path.c_str(), exporter_path.c_str(), seed_text.c_str(), nullptr);
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    auto exporter = std::unique_ptr<Exporter>(new Exporter());
    exporter->pid_ = pid;
    exporter->in_ = fdopen(to_child[1], "w");
    exporter->out_ = fdopen(from_child[0], "r");
    char line[512];
    while (std::fgets(line, sizeof(line), exporter->out_) != nullptr) {
      std::istringstream words(line);
      std::string tag, name, hex, uuid;
      words >> tag;
      if (tag == "ready") return exporter;
      if (tag != "region") {
        *error = absl::StrCat("ipc_exporter: ", line);
        return nullptr;
      }
      ExportedRegion r;
      words >> name >> hex >> r.ipc.device_uuid >> r.ipc.offset >> r.ipc.byte_size >>
          r.allocation_bytes;
      r.ipc.handle = absl::HexStringToBytes(hex);
      exporter->regions_[name] = r;
    }
    *error = "ipc_exporter exited before it was ready";
    return nullptr;
  }

  ~Exporter() {
    if (in_ != nullptr) {
      std::fputs("exit\n", in_);
      std::fclose(in_);
    }
    if (out_ != nullptr) std::fclose(out_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "ipc_exporter failed";
    }
  }

  const ExportedRegion& region(const std::string& name) const { return regions_.at(name); }

  // The out region's bytes [offset, offset + bytes) as the exporter reads them back now; empty
  // on failure (with the test failed).
  std::string Dump(int64_t offset, int64_t bytes) {
    std::fprintf(in_, "dump %lld %lld\n", static_cast<long long>(offset),
                 static_cast<long long>(bytes));
    std::fflush(in_);
    char* line = nullptr;
    size_t capacity = 0;
    const ssize_t length = getline(&line, &capacity, out_);
    const std::string text = length > 0 ? std::string(line, length) : "";
    std::free(line);  // NOLINT(cppcoreguidelines-no-malloc): getline allocates with malloc
    if (!absl::StartsWith(text, "data ")) {
      ADD_FAILURE() << "ipc_exporter answered dump with: " << text;
      return "";
    }
    return absl::HexStringToBytes(absl::StripTrailingAsciiWhitespace(text.substr(5)));
  }

 private:
  Exporter() = default;
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
  std::map<std::string, ExportedRegion> regions_;
};

MATCHER_P2(IsStatus, code, substring, "") {
  *result_listener << "status " << arg;
  return arg.code() == code && absl::StrContains(arg.message(), substring);
}

class IpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend("cuda");
    if (!backend.ok()) GTEST_SKIP() << "no usable CUDA device: " << backend.status();
    core_ = std::make_unique<service::Core>(*std::move(backend), service::CoreLimits{});
    work_ = std::make_unique<service::WorkQueue>(2, 64);
    service_ = std::make_unique<service::LaproxService>(*core_, *work_, "ipc-test",
                                                        laprox::testing::ActAsLaproxd());
    server_ = laprox::testing::TestServer::Start(service_.get(), "laprox-ipc");
    ASSERT_NE(server_, nullptr);
    client_ = *client::Client::Connect(server_->target());

    std::string error;
    exporter_ = Exporter::Start(kSeed, &error);
    ASSERT_NE(exporter_, nullptr) << error;
    sample_ = MakeSample(kSeed);
  }

  void TearDown() override {
    if (server_ == nullptr) return;
    client_.reset();
    server_.reset();
    work_.reset();
    core_.reset();      // closes the regions while the exporter still holds the memory
    exporter_.reset();  // then the exporter frees it and exits
  }

  uint64_t RegisterModel() {
    std::vector<client::TensorRef> o_proj;
    for (int l = 0; l < kL; ++l) {
      o_proj.push_back(client::TensorRef::Inline(sample_.o_proj[l].data(), kernels::DType::kF32,
                                                 {kHidden, kH * kD}));
    }
    auto model = client_->RegisterModel("ipc", Geometry(), o_proj);
    EXPECT_TRUE(model.ok()) << model.status();
    return model.value_or(0);
  }

  static kernels::ModelGeometry Geometry() { return {kL, kH, kHkv, kD, kHidden, 0.f}; }
  static kernels::PolicySpec Policy() {
    kernels::PolicySpec policy;
    policy.window = kWindow;
    policy.budget = kernels::Budget::TokensPerHead(kBudget);
    return policy;
  }

  std::vector<client::LayerRefs> Layers(uint64_t kv_region, uint64_t q_region) const {
    std::vector<client::LayerRefs> layers;
    for (int l = 0; l < kL; ++l) {
      client::LayerRefs& in = layers.emplace_back();
      in.keys = client::TensorRef::InRegion(kv_region, Sample::KeysElement(l) * 2,
                                            kernels::DType::kBF16, {kHkv, kN, kD});
      in.values = client::TensorRef::InRegion(kv_region, Sample::ValuesElement(l) * 2,
                                              kernels::DType::kBF16, {kHkv, kN, kD});
      in.window_queries = client::TensorRef::InRegion(q_region, Sample::QueriesElement(l) * 2,
                                                      kernels::DType::kBF16, {kH, kWindow, kD});
    }
    return layers;
  }

  // The CPU backend's plan on host copies of the same bytes.
  kernels::KeepPlan CpuPlan() const {
    auto backend = *kernels::CreateBackend("cpu");
    std::vector<kernels::TensorView> o_proj;
    for (int l = 0; l < kL; ++l) {
      o_proj.emplace_back(sample_.o_proj[l].data(), kernels::DType::kF32,
                          kernels::Dims{kHidden, kH * kD});
    }
    auto model = *backend->PrepareModel(Geometry(), o_proj);
    kernels::KeepPlanRequest request;
    request.n = kN;
    request.policy = Policy();
    request.outputs.scores = true;
    for (int l = 0; l < kL; ++l) {
      kernels::LayerInputs& in = request.layers.emplace_back();
      in.keys = {sample_.kv.data() + Sample::KeysElement(l), kernels::DType::kBF16, {kHkv, kN, kD}};
      in.values = {
          sample_.kv.data() + Sample::ValuesElement(l), kernels::DType::kBF16, {kHkv, kN, kD}};
      in.window_queries = {sample_.queries.data() + Sample::QueriesElement(l),
                           kernels::DType::kBF16,
                           {kH, kWindow, kD}};
    }
    return *backend->ComputeKeepPlan(*model, request);
  }

  // Registers both exported regions; 0s on failure (with the test failed).
  std::pair<uint64_t, uint64_t> RegisterRegions() {
    auto kv = client_->RegisterCudaIpcRegion(exporter_->region("kv").ipc);
    EXPECT_TRUE(kv.ok()) << kv.status();
    auto q = client_->RegisterCudaIpcRegion(exporter_->region("queries").ipc);
    EXPECT_TRUE(q.ok()) << q.status();
    return {kv.value_or(0), q.value_or(0)};
  }

  // Same total, and the kept sets differ at most by near-tie swaps: at most 1% of the kept
  // positions (bf16 inputs, fp32 math in another summation order).
  static void ExpectSamePlan(const kernels::KeepPlan& gpu, const kernels::KeepPlan& cpu) {
    ASSERT_EQ(gpu.num_layers, cpu.num_layers);
    ASSERT_EQ(gpu.num_kv_heads, cpu.num_kv_heads);
    EXPECT_EQ(gpu.selected_total, cpu.selected_total);
    std::set<int64_t> a, b;
    for (int l = 0; l < cpu.num_layers; ++l) {
      for (int h = 0; h < cpu.num_kv_heads; ++h) {
        const int64_t base = (int64_t{l} * cpu.num_kv_heads + h) * cpu.n;
        for (int32_t p : gpu.kept(l, h)) a.insert(base + p);
        for (int32_t p : cpu.kept(l, h)) b.insert(base + p);
      }
    }
    int64_t differ = 0;
    for (int64_t x : a) differ += b.count(x) == 0;
    EXPECT_LE(differ, std::max<int64_t>(2, static_cast<int64_t>(b.size()) / 100))
        << differ << " of " << b.size() << " kept positions differ from the CPU backend";
  }

  // A complete good round trip: the server is still healthy and answers.
  void ExpectServerAnswers() {
    auto [kv, q] = RegisterRegions();
    const uint64_t model = RegisterModel();
    auto plan = client_->ComputeKeepPlan(model, kN, Layers(kv, q), Policy());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(core_->backend().Health().ok()) << core_->backend().Health();
    EXPECT_TRUE(client_->UnregisterRegion(kv).ok());
    EXPECT_TRUE(client_->UnregisterRegion(q).ok());
    EXPECT_TRUE(client_->UnregisterModel(model).ok());
  }

  std::unique_ptr<service::Core> core_;
  std::unique_ptr<service::WorkQueue> work_;
  std::unique_ptr<service::LaproxService> service_;
  std::unique_ptr<laprox::testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<Exporter> exporter_;
  Sample sample_;
};

TEST_F(IpcTest, PlanFromExportedDeviceMemoryEqualsTheCpuBackend) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->cuda_ipc);
  EXPECT_EQ(info->active_device_uuid, exporter_->region("kv").ipc.device_uuid);

  auto [kv, q] = RegisterRegions();
  ASSERT_NE(kv, 0u);
  ASSERT_NE(q, 0u);
  const std::vector<service::RegionInfo> regions = core_->regions().List(service::Owner::Laproxd());
  ASSERT_EQ(regions.size(), 2u);
  EXPECT_EQ(regions[0].kind, service::RegionKind::kCudaIpc);
  EXPECT_EQ(regions[0].device_uuid, exporter_->region("kv").ipc.device_uuid);
  EXPECT_EQ(regions[0].offset, kKvPad);

  const uint64_t model = RegisterModel();
  auto plan = client_->ComputeKeepPlan(model, kN, Layers(kv, q), Policy());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectSamePlan(*plan, CpuPlan());
  EXPECT_TRUE(client_->UnregisterRegion(kv).ok());
  EXPECT_TRUE(client_->UnregisterRegion(q).ok());
  EXPECT_TRUE(core_->regions().List(service::Owner::Laproxd()).empty());
}

TEST_F(IpcTest, PlanWrittenIntoAnExportedDeviceRegion) {
  auto [kv, q] = RegisterRegions();
  ASSERT_NE(kv, 0u);
  ASSERT_NE(q, 0u);
  auto out = client_->RegisterCudaIpcRegion(exporter_->region("out").ipc, /*writable=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  const uint64_t model = RegisterModel();
  const std::vector<client::LayerRefs> layers = Layers(kv, q);
  auto in_response = client_->ComputeKeepPlan(model, kN, layers, Policy(), {.bitmask = true});
  ASSERT_TRUE(in_response.ok()) << in_response.status();

  // Positions first, then the bitmask: the exporter's memory, written on the device.
  const auto positions_bytes = static_cast<int64_t>(in_response->positions.size() * 4);
  const auto mask_bytes = static_cast<int64_t>(in_response->bitmask.size());
  ASSERT_LE(positions_bytes + mask_bytes, static_cast<int64_t>(kOutBytes));
  auto written = client_->ComputeKeepPlanInto(
      model, kN, layers, Policy(),
      {.region_id = *out, .positions_offset = 0, .bitmask_offset = positions_bytes});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->counts, in_response->counts);
  EXPECT_TRUE(written->positions.empty());
  EXPECT_TRUE(written->bitmask.empty());
  const std::string bytes = exporter_->Dump(0, positions_bytes + mask_bytes);
  ASSERT_EQ(static_cast<int64_t>(bytes.size()), positions_bytes + mask_bytes);
  std::vector<int32_t> positions(in_response->positions.size());
  std::memcpy(positions.data(), bytes.data(), positions_bytes);
  EXPECT_EQ(positions, in_response->positions);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin() + positions_bytes, bytes.end()),
            in_response->bitmask);

  // A region registered read-only is not written.
  EXPECT_THAT(client_
                  ->ComputeKeepPlanInto(model, kN, layers, Policy(),
                                        {.region_id = kv, .positions_offset = 0})
                  .status(),
              IsStatus(absl::StatusCode::kFailedPrecondition, "read-only"));
  EXPECT_TRUE(client_->UnregisterRegion(*out).ok());
  EXPECT_TRUE(client_->UnregisterRegion(kv).ok());
  EXPECT_TRUE(client_->UnregisterRegion(q).ok());
  EXPECT_TRUE(client_->UnregisterModel(model).ok());
  ExpectServerAnswers();
}

TEST_F(IpcTest, BadRegistrationsAreRejectedAndTheServerGoesOn) {
  const client::CudaIpcExport good = exporter_->region("kv").ipc;
  const int64_t allocation = exporter_->region("kv").allocation_bytes;

  client::CudaIpcExport short_handle = good;
  short_handle.handle.resize(63);
  EXPECT_THAT(client_->RegisterCudaIpcRegion(short_handle).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "cuda_ipc.handle has 63 bytes"));
  ExpectServerAnswers();

  client::CudaIpcExport garbage = good;
  std::mt19937 rng(7);
  for (char& c : garbage.handle) c = static_cast<char>(rng());
  EXPECT_THAT(client_->RegisterCudaIpcRegion(garbage).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "cuda_ipc.handle"));
  ExpectServerAnswers();

  // Up to the allocation's last byte is fine (ipc_exporter makes it a 2 MiB multiple, which the
  // driver does not sub-allocate).
  client::CudaIpcExport to_end = good;
  to_end.byte_size = allocation - good.offset;
  auto whole = client_->RegisterCudaIpcRegion(to_end);
  EXPECT_TRUE(whole.ok()) << whole.status();
  if (whole.ok()) {
    EXPECT_TRUE(client_->UnregisterRegion(*whole).ok());
  }

  // Well past any rounding of the allocation's size.
  client::CudaIpcExport past_end = good;
  past_end.offset = (allocation + (int64_t{2} << 20)) / (int64_t{2} << 20) * (int64_t{2} << 20);
  past_end.byte_size = 64;
  EXPECT_THAT(client_->RegisterCudaIpcRegion(past_end).status(),
              IsStatus(absl::StatusCode::kOutOfRange, "exceeds the"));
  client::CudaIpcExport too_long = good;
  too_long.byte_size = allocation + (int64_t{2} << 20);
  EXPECT_THAT(client_->RegisterCudaIpcRegion(too_long).status(),
              IsStatus(absl::StatusCode::kOutOfRange, "cuda_ipc.offset + cuda_ipc.byte_size"));
  ExpectServerAnswers();

  client::CudaIpcExport unknown_device = good;
  unknown_device.device_uuid = "GPU-00000000-1111-2222-3333-444444444444";
  EXPECT_THAT(client_->RegisterCudaIpcRegion(unknown_device).status(),
              IsStatus(absl::StatusCode::kNotFound, "GPU-00000000-1111-2222-3333-444444444444"));
  ExpectServerAnswers();

  EXPECT_TRUE(core_->regions().List(service::Owner::Laproxd()).empty())
      << "a rejected registration left a region";
}

TEST_F(IpcTest, UnregisterWhileARequestReadsTheRegion) {
  auto [kv, q] = RegisterRegions();
  const uint64_t model = RegisterModel();
  const std::vector<client::LayerRefs> layers = Layers(kv, q);
  // Several requests in flight while the region is unregistered: each either finishes with its
  // plan (it held a lease) or is refused cleanly (it arrived after the unregistration began).
  std::vector<std::future<absl::StatusOr<kernels::KeepPlan>>> running;
  for (int i = 0; i < 4; ++i) {
    running.push_back(std::async(
        std::launch::async, [&] { return client_->ComputeKeepPlan(model, kN, layers, Policy()); }));
  }
  EXPECT_TRUE(client_->UnregisterRegion(kv).ok());
  const kernels::KeepPlan cpu = CpuPlan();
  for (auto& f : running) {
    absl::StatusOr<kernels::KeepPlan> plan = f.get();
    if (plan.ok()) {
      ExpectSamePlan(*plan, cpu);
    } else {
      EXPECT_TRUE(plan.status().code() == absl::StatusCode::kFailedPrecondition ||
                  plan.status().code() == absl::StatusCode::kNotFound)
          << plan.status();
    }
  }
  EXPECT_THAT(client_->ComputeKeepPlan(model, kN, layers, Policy()).status(),
              IsStatus(absl::StatusCode::kNotFound, "layers[0].keys"));
  EXPECT_TRUE(client_->UnregisterRegion(q).ok());
  EXPECT_TRUE(core_->regions().List(service::Owner::Laproxd()).empty());
  ExpectServerAnswers();  // the same handle opens again after it was closed
}

}  // namespace
}  // namespace laprox::ipc_test
