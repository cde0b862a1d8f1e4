// Hostile requests against a real gRPC server on a temporary Unix socket (issue 20): each test
// is one way a local client tried to crash, hang or corrupt laproxd. The server must answer the
// bad call with the named code and message, and then the next valid request with the right plan.
//
//   ctest --test-dir build -R Robustness --output-on-failure
//
// To add a case: build the attack from the fixture's good request (server_fixture.h), assert the
// code and the field names in the message, then call ExpectServes() so a later good request is
// proven to still get the library's plan.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/grpc/convert.h"
#include "tests/service/server_fixture.h"

namespace laprox::service {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class RobustnessTest : public ServerTest {
 protected:
  // The model of row 3: 4095 KV heads of dimension 1, nearly free to register.
  static constexpr int64_t kWideHeads = 4095, kWideTokens = int64_t{1} << 20;
  uint64_t RegisterWideModel() {
    v1::RegisterModelRequest request;
    v1::ModelGeometry* g = request.mutable_geometry();
    g->set_num_layers(1);
    g->set_num_heads(kWideHeads);
    g->set_num_kv_heads(kWideHeads);
    g->set_head_dim(1);
    g->set_hidden_size(1);
    v1::TensorRef* w = request.add_o_proj();
    const std::vector<float> ones(kWideHeads, 1.f);
    w->set_inline_bytes(ones.data(), ones.size() * 4);
    w->set_dtype(v1::DTYPE_F32);
    w->add_shape(1);
    w->add_shape(kWideHeads);
    v1::RegisterModelResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::RegisterModel, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.model_id();
  }

  // Row 3's request with every element the same 4 bytes of `region` (zero strides): 4.3e9
  // scores from 12 bytes of tensor.
  static v1::ComputeKeepMaskRequest WideRegionRequest(uint64_t model, uint64_t region) {
    v1::ComputeKeepMaskRequest request;
    request.set_model_id(model);
    request.set_n(kWideTokens);
    request.mutable_budget()->set_tokens_per_head(1);
    request.mutable_policy()->set_window(1);
    v1::LayerInputs* in = request.add_layers();
    for (v1::TensorRef* t : {in->mutable_keys(), in->mutable_values()}) {
      SetRegionTensor(t, region, 0, {kWideHeads, kWideTokens, 1});
      for (int i = 0; i < 3; ++i) t->add_strides(0);
    }
    SetRegionTensor(in->mutable_window_queries(), region, 0, {kWideHeads, 1, 1});
    return request;
  }

  // A writable shm object of `bytes` bytes filled with `fill`, registered; unlinked at TearDown.
  uint64_t RegisterOutputRegion(int64_t bytes, uint8_t fill, std::byte** mapping) {
    const std::string name = absl::StrCat("laprox-rtest-out-", getpid(), "-", outputs_.size());
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    std::memset(p, fill, bytes);
    *mapping = static_cast<std::byte*>(p);
    outputs_.push_back({name, p, bytes});
    v1::RegisterRegionRequest reg;
    reg.mutable_shm()->set_name(name);
    reg.mutable_shm()->set_byte_size(bytes);
    reg.set_writable(true);
    v1::RegisterRegionResponse registered;
    grpc::Status s = Call(&v1::Laprox::Stub::RegisterRegion, reg, &registered);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return registered.region_id();
  }

  void TearDown() override {
    ServerTest::TearDown();
    for (const Output& o : outputs_) {
      munmap(o.mapping, o.bytes);
      shm_unlink(("/" + o.name).c_str());
    }
    outputs_.clear();
  }

 private:
  struct Output {
    std::string name;
    void* mapping;
    int64_t bytes;
  };
  std::vector<Output> outputs_;
};

// Row 1: the client registers its shm region, shrinks the object to 0 bytes and sends a request
// over it. Before: SIGBUS killed laproxd.
TEST_F(RobustnessTest, RegionShrunkByTheClientFailsTheRequestInsteadOfSigbus) {
  Prefill prefill(11);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  const int fd = shm_open(("/" + prefill.name()).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s =
      Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), AllOf(HasSubstr(absl::StrCat("region ", region)),
                                       HasSubstr("shrunk"), HasSubstr("unregister")));
  // ListRegions says so (RegionInfo.shrunk; issue 34, row 6: the conversion never set it).
  ASSERT_EQ(Regions().size(), 1u);
  EXPECT_TRUE(Regions()[0].shrunk());
  // The region stays unusable until it is unregistered, and then it is gone.
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, GoodRequest(model, region, prefill), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  v1::UnregisterRegionRequest unregister;
  unregister.set_region_id(region);
  v1::UnregisterRegionResponse unregistered;
  s = Call(&v1::Laprox::Stub::UnregisterRegion, unregister, &unregistered);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(Regions().empty());
  ExpectServes(12);
}

// Row 2: RegisterModel with head_dim = 65536 and everything else 1 (a 262 KB request whose d x d
// factors would be 32 GiB). Before: std::bad_alloc, abort.
TEST_F(RobustnessTest, ModelWhoseFactorsExceedTheModelMemoryIsResourceExhausted) {
  v1::RegisterModelRequest request;
  v1::ModelGeometry* g = request.mutable_geometry();
  g->set_num_layers(1);
  g->set_num_heads(1);
  g->set_num_kv_heads(1);
  g->set_head_dim(65536);
  g->set_hidden_size(1);
  v1::TensorRef* w = request.add_o_proj();
  w->set_inline_bytes(std::string(65536 * 4, '\0'));
  w->set_dtype(v1::DTYPE_F32);
  w->add_shape(1);
  w->add_shape(65536);
  v1::RegisterModelResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::RegisterModel, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), AllOf(HasSubstr("model memory"), HasSubstr("bytes")));
  ExpectServes(13);
}

// One tensor of `shape` whose every element is the same 4 bytes (zero strides).
void SetBroadcast(v1::TensorRef* t, std::initializer_list<int64_t> shape) {
  const float one = 1.f;
  t->set_inline_bytes(&one, 4);
  t->set_dtype(v1::DTYPE_F32);
  for (int64_t s : shape) {
    t->add_shape(s);
    t->add_strides(0);
  }
}

// Row 3: a 79-byte ComputeKeepMask with zero-stride inline tensors, 4095 KV heads and
// n = 2^20 (4.3e9 scores). Before: std::bad_alloc, abort.
TEST_F(RobustnessTest, ZeroStrideInlineTensorsCannotAmplifyMemory) {
  const uint64_t model = RegisterWideModel();
  constexpr int64_t kHeads = kWideHeads, kTokens = kWideTokens;
  v1::ComputeKeepMaskRequest request;
  request.set_model_id(model);
  request.set_n(kTokens);
  request.mutable_budget()->set_tokens_per_head(1);
  request.mutable_policy()->set_window(1);
  v1::LayerInputs* in = request.add_layers();
  SetBroadcast(in->mutable_keys(), {kHeads, kTokens, 1});
  SetBroadcast(in->mutable_values(), {kHeads, kTokens, 1});
  SetBroadcast(in->mutable_window_queries(), {kHeads, 1, 1});
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), AllOf(HasSubstr("layers[0].keys"), HasSubstr("inline")));
  ExpectServes(14);
}

// The address space this process has mapped, in bytes (/proc/self/statm).
int64_t MappedBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long long pages = 0;
  if (f == nullptr || std::fscanf(f, "%lld", &pages) != 1) pages = 0;
  if (f != nullptr) std::fclose(f);
  return pages * sysconf(_SC_PAGESIZE);
}

// An allocation that fails although the budget allowed it (here: a budget far above what the
// process may map) is RESOURCE_EXHAUSTED, never std::terminate. RLIMIT_AS stands for a host that
// is short of memory; sanitizers reserve terabytes of shadow memory, so they skip this.
TEST_F(RobustnessTest, AllocationFailureDespiteTheBudgetIsResourceExhausted) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "RLIMIT_AS cannot be combined with a sanitizer's shadow memory";
#endif
  TearDown();
  StartServer({.max_request_memory = int64_t{1} << 42});
  const uint64_t model = RegisterWideModel();
  Prefill prefill(28);
  const uint64_t region = RegisterRegion(prefill);
  const v1::ComputeKeepMaskRequest request = WideRegionRequest(model, region);
  // The limit is the whole process's: restored on every way out of this test, a failed ASSERT
  // included, so that the tests after it are not run short of address space.
  class ScopedAddressSpaceLimit {
   public:
    explicit ScopedAddressSpaceLimit(int64_t bytes) {
      ok_ = getrlimit(RLIMIT_AS, &saved_) == 0;
      struct rlimit tight = saved_;
      tight.rlim_cur = static_cast<rlim_t>(bytes);
      ok_ = ok_ && setrlimit(RLIMIT_AS, &tight) == 0;
    }
    ~ScopedAddressSpaceLimit() {
      if (ok_) setrlimit(RLIMIT_AS, &saved_);
    }
    bool ok() const { return ok_; }

   private:
    struct rlimit saved_ {};
    bool ok_ = false;
  };
  grpc::Status s;
  {
    const ScopedAddressSpaceLimit limit(MappedBytes() + (int64_t{4} << 30));  // 17 GB needed
    ASSERT_TRUE(limit.ok()) << "getrlimit / setrlimit(RLIMIT_AS) failed";
    v1::ComputeKeepMaskResponse response;
    s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("out of memory")) << s.error_message();
  ExpectServes(29);
}

// The same amplification through a 4-byte region: no copy is implied, but the scores of 4.3e9
// tokens would be; the request memory budget refuses it before anything is allocated.
TEST_F(RobustnessTest, RequestAboveTheMemoryBudgetIsResourceExhausted) {
  const uint64_t model = RegisterWideModel();
  Prefill prefill(15);
  const uint64_t region = RegisterRegion(prefill);
  const v1::ComputeKeepMaskRequest request = WideRegionRequest(model, region);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), AllOf(HasSubstr("request memory"), HasSubstr("limit")));
  ExpectServes(16);
}

// Row 4: RegisterRegion of a FIFO named like a shm object, twice. Before: the first open blocked
// a callback thread forever; every RPC, on new channels too, hung until restart.
TEST_F(RobustnessTest, FifoIsRefusedWithoutBlocking) {
  const std::string name = absl::StrCat("laprox-rtest-fifo-", getpid());
  const std::string path = "/dev/shm/" + name;
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  for (bool writable : {false, false, true}) {
    v1::RegisterRegionRequest request;
    request.mutable_shm()->set_name(name);
    request.mutable_shm()->set_byte_size(4096);
    request.set_writable(writable);
    v1::RegisterRegionResponse response;
    grpc::Status s =
        Call(&v1::Laprox::Stub::RegisterRegion, request, &response, std::chrono::seconds(10));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), AllOf(HasSubstr(name), HasSubstr("FIFO")));
  }
  unlink(path.c_str());
  EXPECT_TRUE(Regions().empty());
  ExpectServes(17);
}

// A directory and a symbolic link named like shm objects are INVALID_ARGUMENT naming the kind
// (a symlink is never followed).
TEST_F(RobustnessTest, DirectoryAndSymlinkAreRefusedNamingTheKind) {
  Prefill target(18);
  const std::string dir = absl::StrCat("laprox-rtest-dir-", getpid());
  const std::string link = absl::StrCat("laprox-rtest-link-", getpid());
  ASSERT_EQ(mkdir(("/dev/shm/" + dir).c_str(), 0700), 0);
  ASSERT_EQ(symlink(("/dev/shm/" + target.name()).c_str(), ("/dev/shm/" + link).c_str()), 0);
  for (const auto& [name, kind] : {std::pair{dir, "directory"}, std::pair{link, "symbolic link"}}) {
    for (bool writable : {false, true}) {
      v1::RegisterRegionRequest request;
      request.mutable_shm()->set_name(name);
      request.mutable_shm()->set_byte_size(64);
      request.set_writable(writable);
      v1::RegisterRegionResponse response;
      grpc::Status s =
          Call(&v1::Laprox::Stub::RegisterRegion, request, &response, std::chrono::seconds(10));
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << name << ": " << s.error_message();
      EXPECT_THAT(s.error_message(), AllOf(HasSubstr(name), HasSubstr(kind)));
    }
  }
  rmdir(("/dev/shm/" + dir).c_str());
  unlink(("/dev/shm/" + link).c_str());
  EXPECT_TRUE(Regions().empty());
  ExpectServes(19);
}

// Row 5: an OutputDestination whose positions lie over the keys the request reads. Before: OK,
// and the engine's keys were overwritten.
TEST_F(RobustnessTest, OutputOverlappingAnInputIsRefusedAndNothingIsWritten) {
  Prefill prefill(20);
  const uint64_t region = RegisterRegion(prefill, /*writable=*/true);
  const uint64_t model = RegisterModel(prefill);
  // The same object registered a second time: overlap is judged on the object, not the id.
  const uint64_t alias = RegisterRegion(prefill, /*writable=*/true);
  for (const uint64_t destination : {region, alias}) {
    v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
    v1::OutputDestination* to = request.mutable_outputs()->mutable_destination();
    to->set_region_id(destination);
    to->set_positions_offset(4 * (prefill.LayerFloats() + 8));  // inside layers[1].keys
    v1::ComputeKeepMaskResponse response;
    grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(),
                AllOf(HasSubstr("outputs.destination.positions"), HasSubstr("layers[1].keys")));
  }
  // The keys the server read are the keys the client wrote.
  const int fd = shm_open(("/" + prefill.name()).c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  void* p = mmap(nullptr, prefill.Bytes(), PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  EXPECT_EQ(std::memcmp(p, prefill.layer(0), prefill.Bytes()), 0);
  munmap(p, prefill.Bytes());
  ExpectServes(21);
}

// Row 6: counts and offsets destinations overlapping each other. Before: OK.
TEST_F(RobustnessTest, OverlappingOutputsAreRefusedAndNothingIsWritten) {
  Prefill prefill(22);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  std::byte* out = nullptr;
  const uint64_t destination = RegisterOutputRegion(65536, 0xab, &out);
  v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
  v1::OutputDestination* to = request.mutable_outputs()->mutable_destination();
  to->set_region_id(destination);
  to->set_counts_offset(0);    // [0, 24)
  to->set_offsets_offset(16);  // [16, 72)
  to->set_positions_offset(1024);
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), AllOf(HasSubstr("outputs.destination.counts"),
                                       HasSubstr("outputs.destination.offsets")));
  // Nothing at all was written, positions included.
  const std::vector<std::byte> untouched(65536, std::byte{0xab});
  EXPECT_EQ(std::memcmp(out, untouched.data(), untouched.size()), 0);
  ExpectServes(23);
}

// Row 8: a call that hit its deadline or was cancelled while it computed. Before: the server
// still wrote the plan into the output region afterwards. The Core is called directly so that
// the moment of cancellation is exact: the call is cancelled at its k-th look, for k = 1, 2, ...
// (before the compute, during it: kernels::StopSignal, and just before the write), until a k
// beyond its last look lets it write.
TEST_F(RobustnessTest, NothingIsWrittenAfterTheCallStopped) {
  Prefill prefill(24);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  std::byte* out = nullptr;
  const uint64_t destination = RegisterOutputRegion(65536, 0xcd, &out);
  v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
  v1::OutputDestination* to = request.mutable_outputs()->mutable_destination();
  to->set_region_id(destination);
  to->set_counts_offset(0);
  to->set_positions_offset(1024);
  auto call = KeepPlanCallFromProto(request);
  ASSERT_TRUE(call.ok()) << call.status();
  const std::vector<std::byte> untouched(65536, std::byte{0xcd});

  for (int k = 1;; ++k) {
    std::atomic<int> looks{0};
    CallContext cancelled_at_k{.owner = Owner::Laproxd()};
    cancelled_at_k.cancelled = [&looks, k] { return ++looks >= k; };
    auto plan = core_->ComputeKeepPlan(*call, cancelled_at_k);
    if (plan.ok()) {
      // Before the compute, when it starts, and just before the write at least.
      EXPECT_GE(looks.load(), 3);
      break;
    }
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kCancelled) << "k = " << k << plan.status();
    ASSERT_EQ(std::memcmp(out, untouched.data(), untouched.size()), 0) << "k = " << k;
    ASSERT_LT(k, 10000);
  }
  std::memset(out, 0xcd, 65536);

  CallContext expired{.owner = Owner::Laproxd()};
  expired.deadline = absl::Now() - absl::Seconds(1);
  auto plan = core_->ComputeKeepPlan(*call, expired);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kDeadlineExceeded) << plan.status();
  EXPECT_EQ(std::memcmp(out, untouched.data(), untouched.size()), 0);

  // A live call writes both areas.
  plan = core_->ComputeKeepPlan(*call, {.owner = Owner::Laproxd()});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const kernels::KeepPlan direct = DirectPlan(prefill);
  EXPECT_EQ(std::memcmp(out, direct.counts.data(), direct.counts.size() * 4), 0);
  EXPECT_EQ(std::memcmp(out + 1024, direct.positions.data(), direct.positions.size() * 4), 0);
}

// Ids 0 are INVALID_ARGUMENT everywhere; a negative output offset is INVALID_ARGUMENT naming
// it; n above the server's limit is OUT_OF_RANGE with that limit; a model name outside the
// documented characters is INVALID_ARGUMENT.
TEST_F(RobustnessTest, PreciseCodesForIdsOffsetsLimitsAndNames) {
  Prefill prefill(25);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskResponse response;
  v1::ComputeKeepMaskRequest request = GoodRequest(0, region, prefill);
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model_id is 0"));

  request = GoodRequest(model, region, prefill);
  request.mutable_layers(2)->mutable_values()->mutable_region()->set_region_id(0);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("layers[2].values: region_id is 0"));

  v1::UnregisterModelRequest forget;
  v1::UnregisterModelResponse forgotten;
  s = Call(&v1::Laprox::Stub::UnregisterModel, forget, &forgotten);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  v1::UnregisterRegionRequest close;
  v1::UnregisterRegionResponse closed;
  s = Call(&v1::Laprox::Stub::UnregisterRegion, close, &closed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();

  request = GoodRequest(model, region, prefill);
  std::byte* out = nullptr;
  const uint64_t destination = RegisterOutputRegion(4096, 0, &out);
  request.mutable_outputs()->mutable_destination()->set_region_id(destination);
  request.mutable_outputs()->mutable_destination()->set_bitmask_offset(-64);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("outputs.destination.bitmask_offset = -64"));

  request = GoodRequest(model, region, prefill);
  request.set_n(core_->limits().max_tokens + 1);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << s.error_message();
  EXPECT_THAT(s.error_message(),
              HasSubstr(absl::StrCat("limit of ", core_->limits().max_tokens, " tokens")));

  for (const char* name : {"bad name", "x\n", "caf\xc3\xa9"}) {
    v1::RegisterModelRequest bad;
    bad.set_name(name);
    v1::RegisterModelResponse registered;
    s = Call(&v1::Laprox::Stub::RegisterModel, bad, &registered);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("[A-Za-z0-9._/:-]"));
  }
  ExpectServes(26);
}

// A response above max_response_bytes is RESOURCE_EXHAUSTED, not a failed serialisation.
TEST_F(RobustnessTest, ResponseAboveTheLimitIsResourceExhausted) {
  TearDown();
  StartServer({}, {.max_response_bytes = 4096});
  Prefill prefill(27);
  const uint64_t region = RegisterRegion(prefill);
  const uint64_t model = RegisterModel(prefill);
  v1::ComputeKeepMaskRequest request = GoodRequest(model, region, prefill);
  request.mutable_outputs()->set_scores(true);  // 3 x 2 x 300 floats
  v1::ComputeKeepMaskResponse response;
  grpc::Status s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("max_response_bytes = 4096"));
  request.mutable_outputs()->set_scores(false);
  request.mutable_outputs()->set_bitmask(false);
  s = Call(&v1::Laprox::Stub::ComputeKeepMask, request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// Every out-of-range option is refused by Server::Start (the one place laproxd's flags are
// checked) with INVALID_ARGUMENT naming the flag, before anything starts.
TEST(ServerOptionsTest, OutOfRangeOptionsAreRefusedNamingTheFlag) {
  const auto refused = [](const std::function<void(ServerOptions&)>& edit,
                          const std::string& flag) {
    ServerOptions options;
    options.socket = testing::TestServer::TempSocketPath("laprox-opts");
    edit(options);
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(std::move(options));
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_THAT(server.status().message(), HasSubstr(flag));
  };
  refused([](ServerOptions& o) { o.lease_seconds = -1; }, "--lease_seconds=-1");
  refused([](ServerOptions& o) { o.lease_seconds = std::nan(""); }, "--lease_seconds=nan");
  refused([](ServerOptions& o) { o.lease_seconds = 2e9; }, "--lease_seconds=2e+09");
  refused([](ServerOptions& o) { o.heavy_workers = 1025; }, "--heavy_workers=1025");
  refused([](ServerOptions& o) { o.workers = 0; }, "--workers=0");
  refused([](ServerOptions& o) { o.max_pending = -1; }, "--max_pending=-1");
  refused([](ServerOptions& o) { o.max_request_bytes = 0; }, "--max_request_bytes=0");
  refused([](ServerOptions& o) { o.socket_mode = 07777; }, "--socket_mode=07777 is not in");
}

// No identity by default: a service built without a caller identifier serves no call, rather
// than acting for laproxd (which sees everything) and leaving isolation to every builder's memory.
TEST(ServiceWithoutIdentifierTest, AnswersEveryCallInternalAndRegistersNothing) {
  Core core(*kernels::CreateBackend("cpu"), {});
  WorkQueue work(1, 4);
  LaproxService service(core, work, "test", /*identify=*/nullptr);
  auto server = testing::TestServer::Start(&service, "laprox-noid");
  ASSERT_NE(server, nullptr);
  auto stub = v1::Laprox::NewStub(
      grpc::CreateChannel(server->target(), grpc::InsecureChannelCredentials()));
  const auto expect_refused = [](const grpc::Status& s) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("without a caller identifier"));
  };
  Prefill prefill(31);
  {
    grpc::ClientContext context;
    v1::RegisterRegionRequest request;
    request.mutable_shm()->set_name(prefill.name());
    request.mutable_shm()->set_byte_size(prefill.Bytes());
    v1::RegisterRegionResponse response;
    expect_refused(stub->RegisterRegion(&context, request, &response));
  }
  {
    grpc::ClientContext context;
    v1::ListRegionsResponse response;
    expect_refused(stub->ListRegions(&context, v1::ListRegionsRequest(), &response));
  }
  {
    grpc::ClientContext context;
    v1::GetServerInfoResponse response;
    expect_refused(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &response));
  }
  EXPECT_TRUE(core.regions().List(Owner::Laproxd()).empty());
}

}  // namespace
}  // namespace laprox::service
