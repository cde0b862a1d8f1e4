// RegionRegistry against real POSIX shared memory: registration checks, leases, and
// unregistration that waits for in-flight requests. The cuda_ipc bookkeeping (same leases and
// draining, the imported region closed after the last lease) runs against a test backend whose
// "imported" regions are host memory that records when it is closed — a stand-in for the CUDA
// driver, since these tests run without a GPU (tests/cuda/ipc_test.cc opens real handles).
#include "service/core/region_registry.h"

#include <atomic>
#include <csignal>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/registry.h"
#include "service/core/fault_guard.h"
#include "service/core/leases.h"
#include "tests/service/shm_object.h"

namespace laprox::service {
namespace {

using core_testing::IsStatus;
using core_testing::ShmObject;
using core_testing::UniqueName;

// The backend of the shared-memory tests (it opens no cuda_ipc region; the tests that do have a
// fake device backend of their own).
kernels::Backend& CpuBackend() {
  static kernels::Backend* const backend = kernels::CreateBackend("cpu")->release();
  return *backend;
}

TEST(RegionRegistryTest, MapsAWindowOfTheObject) {
  ShmObject object(UniqueName("map"), 3 * 4096 + 100);
  RegionRegistry registry(CpuBackend());
  // An offset that is not page-aligned: the registry maps the enclosing page.
  auto id = registry.RegisterShm({.name = object.name(), .offset = 5000, .byte_size = 1000},
                                 Owner::Laproxd());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  auto lease = registry.Acquire(*id, Owner::Laproxd());
  ASSERT_TRUE(lease.ok()) << lease.status();
  const std::byte* data = lease->region().data();
  EXPECT_EQ(static_cast<int>(data[0]), 5000 % 251);
  EXPECT_EQ(static_cast<int>(data[999]), 5999 % 251);
  auto slice = lease->region().Slice(10, 990, "layers[0].keys");
  ASSERT_TRUE(slice.ok());
  EXPECT_EQ(*slice, data + 10);
  EXPECT_THAT(lease->region().Slice(10, 991, "layers[0].keys").status(),
              IsStatus(absl::StatusCode::kOutOfRange,
                       "layers[0].keys: bytes [10, +991) are outside region"));
  EXPECT_THAT(lease->region().Slice(INT64_MAX, 2, "x").status(),
              IsStatus(absl::StatusCode::kOutOfRange, "outside region"));
  // The leading "/" of the shm_open spelling is accepted.
  EXPECT_TRUE(
      registry.RegisterShm({.name = "/" + object.name(), .byte_size = 1}, Owner::Laproxd()).ok());
}

TEST(RegionRegistryTest, RejectsBadRegistrations) {
  ShmObject object(UniqueName("bad"), 4096);
  RegionRegistry registry(CpuBackend());
  EXPECT_THAT(registry.RegisterShm({.name = "kv-cache", .byte_size = 1}, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "must start with \"laprox-\""));
  EXPECT_THAT(
      registry.RegisterShm({.name = "laprox-../etc", .byte_size = 1}, Owner::Laproxd()).status(),
      IsStatus(absl::StatusCode::kInvalidArgument, "may contain only"));
  EXPECT_THAT(
      registry.RegisterShm({.name = UniqueName("missing"), .byte_size = 1}, Owner::Laproxd())
          .status(),
      IsStatus(absl::StatusCode::kNotFound, "No such file"));
  EXPECT_THAT(
      registry.RegisterShm({.name = object.name(), .byte_size = 0}, Owner::Laproxd()).status(),
      IsStatus(absl::StatusCode::kInvalidArgument, "shm.byte_size = 0 must be > 0"));
  EXPECT_THAT(
      registry.RegisterShm({.name = object.name(), .offset = -1, .byte_size = 1}, Owner::Laproxd())
          .status(),
      IsStatus(absl::StatusCode::kInvalidArgument, "shm.offset = -1"));
  EXPECT_THAT(
      registry
          .RegisterShm({.name = object.name(), .offset = 4000, .byte_size = 97}, Owner::Laproxd())
          .status(),
      IsStatus(absl::StatusCode::kOutOfRange,
               "shm.offset + shm.byte_size = 4000 + 97 exceeds the 4096 bytes"));
  EXPECT_THAT(registry
                  .RegisterShm({.name = object.name(), .offset = INT64_MAX, .byte_size = 2},
                               Owner::Laproxd())
                  .status(),
              IsStatus(absl::StatusCode::kOutOfRange, "exceeds"));
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());  // nothing half-registered
}

TEST(RegionRegistryTest, EnforcesTheRegionLimit) {
  ShmObject object(UniqueName("limit"), 4096);
  RegionRegistry registry(CpuBackend(), {.max_regions = 2});
  ASSERT_TRUE(registry.RegisterShm({.name = object.name(), .byte_size = 8}, Owner::Laproxd()).ok());
  ASSERT_TRUE(registry.RegisterShm({.name = object.name(), .byte_size = 8}, Owner::Laproxd()).ok());
  EXPECT_THAT(
      registry.RegisterShm({.name = object.name(), .byte_size = 8}, Owner::Laproxd()).status(),
      IsStatus(absl::StatusCode::kResourceExhausted, "limit 2"));
}

// Another owner's region is NOT_FOUND, exactly like an unknown id; laproxd itself sees all.
TEST(RegionRegistryTest, OwnersSeeOnlyTheirOwnRegions) {
  ShmObject object(UniqueName("owners"), 4096);
  RegionRegistry registry(CpuBackend());
  const Owner first = Owner::LocalUser(0), second = Owner::Remote("x509:engine-b");
  auto id = registry.RegisterShm({.name = object.name(), .byte_size = 4096}, first);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(registry.Acquire(*id, first).ok());
  EXPECT_THAT(registry.Acquire(*id, second).status().message(),
              testing::StrEq(absl::StrCat("region ", *id, " not found")));
  EXPECT_TRUE(registry.List(second).empty());
  EXPECT_EQ(registry.List(first).size(), 1u);
  EXPECT_EQ(registry.List(Owner::Laproxd()).size(), 1u);  // Owner::Laproxd()
  EXPECT_EQ(registry.Unregister(*id, second).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Unregister(*id, first).ok());
}

// laproxd maps an object for a local caller only if the caller's uid owns it (or is 0), and
// writable only with the object's owner-write bit; a TCP caller (no uid) maps none.
TEST(RegionRegistryTest, MapsOnlyObjectsTheCallerOwns) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give the object to another uid";
  ShmObject object(UniqueName("owned"), 4096);
  const std::string path = absl::StrCat("/dev/shm/", object.name());
  ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0) << std::strerror(errno);
  RegionRegistry registry(CpuBackend());
  const ShmRegionSpec read = {.name = object.name(), .byte_size = 4096};
  ShmRegionSpec write = read;
  write.writable = true;
  auto refused = registry.RegisterShm(read, Owner::LocalUser(1000));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), testing::HasSubstr("owned by uid 65534"));
  EXPECT_EQ(registry.RegisterShm(read, Owner::Remote("tcp")).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry.RegisterShm(write, Owner::LocalUser(65534)).ok());
  EXPECT_TRUE(registry.RegisterShm(write, Owner::LocalUser(0)).ok());
  ASSERT_EQ(chmod(path.c_str(), 0400), 0);
  EXPECT_TRUE(registry.RegisterShm(read, Owner::LocalUser(65534)).ok());
  auto read_only = registry.RegisterShm(write, Owner::LocalUser(65534));
  EXPECT_EQ(read_only.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(read_only.status().message(), testing::HasSubstr("mode 0400"));
  EXPECT_EQ(registry.List(Owner::Laproxd()).size(), 3u);  // the refusals left nothing registered
}

// LeaseTable: a holder with a pid goes when its process has exited and no connection is open;
// one without a pid after `lease` disconnected; a live, disconnected process keeps its own.
TEST(LeaseTableTest, ReclaimsWhatGoneClientsRegistered) {
  LeaseTable leases(absl::Seconds(2));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  bool connected = true;
  auto is_connected = [&connected](uid_t, pid_t) { return connected; };
  const absl::Time t0 = absl::Now();
  leases.Add(Owner::LocalUser(1000, child), LeaseTable::Kind::kRegion, 7);
  leases.Add(Owner::LocalUser(1000, child), LeaseTable::Kind::kModel, 3);
  leases.Add(Owner::LocalUser(1001), LeaseTable::Kind::kRegion, 8);  // pid unknown
  leases.Add(Owner::LocalUser(1002, getpid()), LeaseTable::Kind::kRegion, 9);
  leases.Add(Owner::Remote("tcp"), LeaseTable::Kind::kRegion, 10);  // not tracked
  leases.Add(Owner::Laproxd(), LeaseTable::Kind::kRegion, 11);      // not tracked
  EXPECT_EQ(leases.size(), 4);
  leases.Remove(LeaseTable::Kind::kModel, 3);
  EXPECT_TRUE(leases.Collect(is_connected, t0).empty());
  connected = false;  // every connection closed; the child still runs
  EXPECT_TRUE(leases.Collect(is_connected, t0 + absl::Seconds(1)).empty());
  auto lapsed = leases.Collect(is_connected, t0 + absl::Seconds(2));  // 1001's lease ran out
  ASSERT_EQ(lapsed.size(), 1u);
  EXPECT_EQ(lapsed[0].id, 8u);
  ASSERT_EQ(kill(child, SIGKILL), 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  lapsed = leases.Collect(is_connected, t0 + absl::Seconds(2));
  ASSERT_EQ(lapsed.size(), 1u);  // region 7; model 3 was unregistered before
  EXPECT_EQ(lapsed[0].id, 7u);
  EXPECT_EQ(lapsed[0].kind, LeaseTable::Kind::kRegion);
  // This process is alive: its registration stays, however long it is disconnected.
  EXPECT_TRUE(leases.Collect(is_connected, t0 + absl::Hours(1)).empty());
  EXPECT_EQ(leases.size(), 1);
}

TEST(RegionRegistryTest, UnknownIdsAreNotFoundAndIdZeroIsInvalid) {
  RegionRegistry registry(CpuBackend());
  EXPECT_THAT(registry.Acquire(42, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kNotFound, "region 42 not found"));
  EXPECT_THAT(registry.Unregister(42, Owner::Laproxd()),
              IsStatus(absl::StatusCode::kNotFound, "region 42"));
  EXPECT_THAT(registry.Acquire(0, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "region_id is 0"));
  EXPECT_THAT(registry.Unregister(0, Owner::Laproxd()),
              IsStatus(absl::StatusCode::kInvalidArgument, "region_id is 0"));
}

// The client shrinks its object while a request holds a lease and reads it: the read sees
// zeros instead of raising SIGBUS, the region is marked shrunk, new leases are refused, and
// unregistering it works as usual.
TEST(RegionRegistryTest, ShrunkRegionReadsZerosAndIsRefusedUntilUnregistered) {
  ShmObject object(UniqueName("shrink"), 4 * 4096);
  RegionRegistry registry(CpuBackend());
  const uint64_t id =
      *registry.RegisterShm({.name = object.name(), .byte_size = 4 * 4096}, Owner::Laproxd());
  const int64_t faults = GuardedFaultCount();
  {
    auto lease = registry.Acquire(id, Owner::Laproxd());
    ASSERT_TRUE(lease.ok());
    const volatile std::byte* data = lease->region().data();
    EXPECT_EQ(static_cast<int>(data[3 * 4096 + 7]), (3 * 4096 + 7) % 251);
    object.Truncate(4096);
    EXPECT_EQ(static_cast<int>(data[3 * 4096 + 7]), 0);  // past the new end: a fault, absorbed
    EXPECT_EQ(static_cast<int>(data[7]), 0);             // the whole mapping is zeros now
    EXPECT_TRUE(lease->region().shrunk());
    EXPECT_EQ(GuardedFaultCount(), faults + 1);
  }
  ASSERT_EQ(registry.List(Owner::Laproxd()).size(), 1u);
  EXPECT_TRUE(registry.List(Owner::Laproxd())[0].shrunk);
  object.Truncate(4 * 4096);  // growing it back does not make the region usable again
  EXPECT_THAT(registry.Acquire(id, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kFailedPrecondition, "was shrunk by its client"));
  EXPECT_TRUE(registry.Unregister(id, Owner::Laproxd()).ok());
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
}

// A shrink is seen at the next lease (fstat) even when nothing touched the missing pages.
TEST(RegionRegistryTest, ShrinkIsSeenAtTheNextLeaseWithoutAFault) {
  ShmObject object(UniqueName("fstat"), 8192);
  RegionRegistry registry(CpuBackend());
  const uint64_t id = *registry.RegisterShm(
      {.name = object.name(), .offset = 4096, .byte_size = 4096}, Owner::Laproxd());
  const int64_t faults = GuardedFaultCount();
  object.Truncate(4096 + 100);
  EXPECT_THAT(registry.Acquire(id, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("region ", id, " (shm \"", object.name(), "\") was shrunk")));
  EXPECT_EQ(GuardedFaultCount(), faults);
  EXPECT_TRUE(registry.List(Owner::Laproxd())[0].shrunk);
}

// Outputs written into a writable region that the client shrank go nowhere; the server lives.
TEST(RegionRegistryTest, WritesIntoAShrunkWritableRegionDoNotKillTheServer) {
  ShmObject object(UniqueName("wshrink"), 2 * 4096);
  RegionRegistry registry(CpuBackend());
  const uint64_t id = *registry.RegisterShm(
      {.name = object.name(), .byte_size = 2 * 4096, .writable = true}, Owner::Laproxd());
  auto lease = registry.Acquire(id, Owner::Laproxd());
  ASSERT_TRUE(lease.ok());
  object.Truncate(0);
  std::memset(lease->region().data(), 0x5a, 2 * 4096);
  EXPECT_TRUE(lease->region().shrunk());
}

// A SIGBUS outside every registered region is a real bug and still kills the process.
TEST(RegionRegistryDeathTest, FaultOutsideTheRegisteredRegionsStillKills) {
  ShmObject registered(UniqueName("guarded"), 4096);
  ShmObject other(UniqueName("unguarded"), 4096);
  RegionRegistry registry(CpuBackend());
  ASSERT_TRUE(
      registry.RegisterShm({.name = registered.name(), .byte_size = 4096}, Owner::Laproxd()).ok());
  const int fd = shm_open(("/" + other.name()).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  const volatile auto* p =
      static_cast<const volatile char*>(mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0));
  close(fd);
  other.Truncate(0);
  EXPECT_DEATH({ [[maybe_unused]] char c = p[10]; }, "");
}

// A request holds a lease; unregistration refuses new leases at once and returns only after
// the request released its lease.
TEST(RegionRegistryTest, UnregisterWaitsForInFlightRequests) {
  ShmObject object(UniqueName("drain"), 4096);
  RegionRegistry registry(CpuBackend());
  const uint64_t id =
      *registry.RegisterShm({.name = object.name(), .byte_size = 4096}, Owner::Laproxd());
  auto acquired = registry.Acquire(id, Owner::Laproxd());
  ASSERT_TRUE(acquired.ok());
  std::optional<RegionLease> lease(std::move(acquired).value());

  std::atomic<bool> unregistered{false};
  std::thread unregister([&] {
    EXPECT_TRUE(registry.Unregister(id, Owner::Laproxd()).ok());
    unregistered = true;
  });
  // Wait (bounded, no sleeps) until the registry reports the region draining.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  std::vector<RegionInfo> list = registry.List(Owner::Laproxd());
  while (!(list.size() == 1 && list[0].draining) && !unregistered && absl::Now() < give_up) {
    std::this_thread::yield();
    list = registry.List(Owner::Laproxd());
  }
  ASSERT_EQ(list.size(), 1u) << "the region went away while a request held it";
  ASSERT_TRUE(list[0].draining);
  EXPECT_EQ(list[0].in_use, 1);
  EXPECT_THAT(registry.Acquire(id, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kFailedPrecondition, "being unregistered"));
  EXPECT_FALSE(unregistered);
  // The in-flight request still reads its memory.
  EXPECT_EQ(static_cast<int>(lease->region().data()[100]), 100);

  RegionLease moved = std::move(*lease);  // moving keeps the hold
  lease.reset();
  EXPECT_FALSE(unregistered);
  { RegionLease done = std::move(moved); }  // the request finishes
  unregister.join();
  EXPECT_TRUE(unregistered);
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
}

TEST(RegionRegistryTest, UnregisterDeadlineLeavesTheRegionDraining) {
  ShmObject object(UniqueName("deadline"), 4096);
  RegionRegistry registry(CpuBackend());
  const uint64_t id =
      *registry.RegisterShm({.name = object.name(), .byte_size = 64}, Owner::Laproxd());
  {
    auto lease = registry.Acquire(id, Owner::Laproxd());
    ASSERT_TRUE(lease.ok());
    EXPECT_THAT(registry.Unregister(id, Owner::Laproxd(), absl::Now()),
                IsStatus(absl::StatusCode::kDeadlineExceeded, "still used by 1 requests"));
    // A second call waits like the first (and gives up at its own deadline).
    EXPECT_THAT(registry.Unregister(id, Owner::Laproxd(), absl::Now() + absl::Milliseconds(1)),
                IsStatus(absl::StatusCode::kDeadlineExceeded, "still used by 1 requests"));
    ASSERT_EQ(registry.List(Owner::Laproxd()).size(), 1u);
  }
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());  // gone with its last lease
}

// Test double for the CUDA driver (no GPU here): ImportCudaIpcImpl hands out host memory and
// counts how many of its regions are open.
class FakeDeviceBackend final : public kernels::Backend {
 public:
  class Region final : public kernels::ImportedRegion {
   public:
    Region(std::vector<std::byte> memory, int64_t offset, int64_t size, std::atomic<int>* open)
        : ImportedRegion(memory.data() + offset, size), memory_(std::move(memory)), open_(open) {
      ++*open_;
    }
    ~Region() override { --*open_; }

   private:
    std::vector<std::byte> memory_;  // moved in before data() was taken: the buffer stays put
    std::atomic<int>* open_;
  };

  static constexpr int64_t kAllocationBytes = 4096;
  static constexpr char kUuid[] = "GPU-00112233-4455-6677-8899-aabbccddeeff";

  kernels::BackendKind kind() const override { return kernels::BackendKind::kCuda; }
  std::string Describe() const override { return "fake device backend"; }
  int64_t DefaultMaxRequestWork() const override { return int64_t{1} << 40; }
  bool Supports(kernels::PolicyKind) const override { return false; }
  int open() const { return open_; }
  int imports() const { return imports_; }

 protected:
  bool CanRead(kernels::MemorySpace) const override { return true; }
  absl::StatusOr<std::shared_ptr<const kernels::PreparedModel>> PrepareModelImpl(
      const kernels::ModelGeometry&, absl::Span<const kernels::TensorView>,
      const kernels::PrepareOptions&, const kernels::StopSignal*) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<kernels::KeepPlan> ComputeKeepPlanImpl(const kernels::PreparedModel&,
                                                        const kernels::KeepPlanRequest&,
                                                        const kernels::RequestShape&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::unique_ptr<kernels::ImportedRegion>> ImportCudaIpcImpl(
      const kernels::CudaIpcRegionSpec& spec) override {
    ++imports_;
    if (*kernels::CanonicalDeviceUuid(spec.device_uuid) != kUuid) {
      return absl::NotFoundError("cuda_ipc.device_uuid is not a device this server sees");
    }
    if (spec.offset + spec.byte_size > kAllocationBytes) {
      return absl::OutOfRangeError("cuda_ipc.offset + cuda_ipc.byte_size past the allocation");
    }
    std::vector<std::byte> memory(kAllocationBytes);
    for (size_t i = 0; i < memory.size(); ++i) memory[i] = static_cast<std::byte>(i % 251);
    return std::make_unique<Region>(std::move(memory), spec.offset, spec.byte_size, &open_);
  }

 private:
  std::atomic<int> open_{0};
  std::atomic<int> imports_{0};
};

kernels::CudaIpcRegionSpec IpcSpec(int64_t offset, int64_t byte_size) {
  return {.handle = std::string(64, '\x5a'),
          .device_uuid = "GPU-00112233-4455-6677-8899-AABBCCDDEEFF",  // upper case accepted
          .offset = offset,
          .byte_size = byte_size};
}

TEST(RegionRegistryCudaIpcTest, RegistersADeviceRegion) {
  FakeDeviceBackend backend;
  RegionRegistry registry(backend);
  auto id = registry.RegisterCudaIpc(IpcSpec(256, 1024), /*writable=*/true, Owner::Laproxd());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(backend.open(), 1);
  const std::vector<RegionInfo> list = registry.List(Owner::Laproxd());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].kind, RegionKind::kCudaIpc);
  EXPECT_EQ(list[0].device_uuid, FakeDeviceBackend::kUuid);  // canonical, lower case
  EXPECT_EQ(list[0].name, "");
  EXPECT_EQ(list[0].offset, 256);
  EXPECT_EQ(list[0].byte_size, 1024);
  EXPECT_TRUE(list[0].writable);
  auto lease = registry.Acquire(*id, Owner::Laproxd());
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->region().space(), kernels::MemorySpace::kDevice);
  EXPECT_EQ(static_cast<int>(lease->region().data()[0]), 256 % 251);
  EXPECT_THAT(lease->region().Slice(1000, 25, "layers[0].keys").status(),
              IsStatus(absl::StatusCode::kOutOfRange, "layers[0].keys"));
}

TEST(RegionRegistryCudaIpcTest, BadRegistrationsLeaveNothingOpen) {
  FakeDeviceBackend backend;
  RegionRegistry registry(backend);
  kernels::CudaIpcRegionSpec short_handle = IpcSpec(0, 64);
  short_handle.handle.resize(63);
  EXPECT_THAT(registry.RegisterCudaIpc(short_handle, false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "cuda_ipc.handle has 63 bytes"));
  kernels::CudaIpcRegionSpec bad_uuid = IpcSpec(0, 64);
  bad_uuid.device_uuid = "GPU-not-a-uuid";
  EXPECT_THAT(registry.RegisterCudaIpc(bad_uuid, false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "device_uuid"));
  EXPECT_THAT(registry.RegisterCudaIpc(IpcSpec(-1, 64), false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "cuda_ipc.offset = -1"));
  EXPECT_THAT(registry.RegisterCudaIpc(IpcSpec(0, 0), false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "cuda_ipc.byte_size = 0"));
  EXPECT_EQ(backend.imports(), 0) << "malformed specs must not reach the backend";
  EXPECT_THAT(registry.RegisterCudaIpc(IpcSpec(4000, 200), false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kOutOfRange, "past the allocation"));
  kernels::CudaIpcRegionSpec other_device = IpcSpec(0, 64);
  other_device.device_uuid = "ffffffff-4455-6677-8899-aabbccddeeff";  // bare form accepted
  EXPECT_THAT(registry.RegisterCudaIpc(other_device, false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kNotFound, "device_uuid"));
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
  EXPECT_EQ(backend.open(), 0);
}

TEST(RegionRegistryCudaIpcTest, TheCpuBackendCannotOpenHandles) {
  // The base class's ImportCudaIpcImpl: what a backend without device memory answers.
  auto backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  RegionRegistry registry(**backend);
  EXPECT_THAT(registry.RegisterCudaIpc(IpcSpec(0, 64), false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kUnimplemented, "cuda_ipc regions need the CUDA backend"));
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
}

TEST(RegionRegistryCudaIpcTest, ClosesAfterTheLastLeaseOfADrainingRegion) {
  FakeDeviceBackend backend;
  RegionRegistry registry(backend);
  const uint64_t id = *registry.RegisterCudaIpc(IpcSpec(0, 4096), false, Owner::Laproxd());
  auto acquired = registry.Acquire(id, Owner::Laproxd());
  ASSERT_TRUE(acquired.ok());
  std::optional<RegionLease> first(std::move(acquired).value());
  std::optional<RegionLease> second(*registry.Acquire(id, Owner::Laproxd()));

  std::atomic<bool> unregistered{false};
  std::thread unregister([&] {
    EXPECT_TRUE(registry.Unregister(id, Owner::Laproxd()).ok());
    unregistered = true;
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  std::vector<RegionInfo> list = registry.List(Owner::Laproxd());
  while (!(list.size() == 1 && list[0].draining) && absl::Now() < give_up) {
    std::this_thread::yield();
    list = registry.List(Owner::Laproxd());
  }
  ASSERT_EQ(list.size(), 1u);
  ASSERT_TRUE(list[0].draining);
  EXPECT_EQ(list[0].in_use, 2);
  EXPECT_THAT(registry.Acquire(id, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kFailedPrecondition, "being unregistered"));
  first.reset();
  EXPECT_FALSE(unregistered);
  EXPECT_EQ(backend.open(), 1) << "closed while a request still held a lease";
  EXPECT_EQ(static_cast<int>(second->region().data()[7]), 7);  // still readable
  second.reset();
  unregister.join();
  EXPECT_TRUE(unregistered);
  EXPECT_EQ(backend.open(), 0);
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
}

TEST(RegionRegistryCudaIpcTest, DeadlineLeavesItOpenUntilTheLastLease) {
  FakeDeviceBackend backend;
  RegionRegistry registry(backend);
  const uint64_t id = *registry.RegisterCudaIpc(IpcSpec(0, 64), false, Owner::Laproxd());
  {
    auto lease = registry.Acquire(id, Owner::Laproxd());
    ASSERT_TRUE(lease.ok());
    EXPECT_THAT(registry.Unregister(id, Owner::Laproxd(), absl::Now()),
                IsStatus(absl::StatusCode::kDeadlineExceeded, "still used by 1 requests"));
    EXPECT_EQ(backend.open(), 1);
  }
  EXPECT_EQ(backend.open(), 0);
  EXPECT_TRUE(registry.List(Owner::Laproxd()).empty());
}

TEST(RegionRegistryCudaIpcTest, RegionLimitCountsDeviceRegionsAndClosesTheExtraOne) {
  FakeDeviceBackend backend;
  RegionRegistry registry(backend, {.max_regions = 1});
  ASSERT_TRUE(registry.RegisterCudaIpc(IpcSpec(0, 64), false, Owner::Laproxd()).ok());
  EXPECT_THAT(registry.RegisterCudaIpc(IpcSpec(0, 64), false, Owner::Laproxd()).status(),
              IsStatus(absl::StatusCode::kResourceExhausted, "limit 1"));
  EXPECT_EQ(backend.open(), 1);
}

}  // namespace
}  // namespace laprox::service
