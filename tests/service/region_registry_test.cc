// RegionRegistry against real POSIX shared memory: registration checks, leases, and
// unregistration that waits for in-flight requests.
#include "service/core/region_registry.h"

#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace laprox::service {
namespace {

// A shared-memory object created for one test and unlinked after it.
class ShmObject {
 public:
  ShmObject(const std::string& name, size_t size) : name_(name) {
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    auto* bytes = static_cast<unsigned char*>(p);
    for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i % 251);
    munmap(p, size);
    close(fd);
  }
  ~ShmObject() { shm_unlink(("/" + name_).c_str()); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

std::string UniqueName(absl::string_view tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("laprox-test-", getpid(), "-", tag, "-", counter++);
}

MATCHER_P2(IsStatus, code, substring, "") {
  *result_listener << "status " << arg;
  return arg.code() == code && absl::StrContains(arg.message(), substring);
}

TEST(RegionRegistryTest, MapsAWindowOfTheObject) {
  ShmObject object(UniqueName("map"), 3 * 4096 + 100);
  RegionRegistry registry({});
  // An offset that is not page-aligned: the registry maps the enclosing page.
  auto id = registry.RegisterShm({.name = object.name(), .offset = 5000, .byte_size = 1000});
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  auto lease = registry.Acquire(*id);
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
  EXPECT_TRUE(registry.RegisterShm({.name = "/" + object.name(), .byte_size = 1}).ok());
}

TEST(RegionRegistryTest, RejectsBadRegistrations) {
  ShmObject object(UniqueName("bad"), 4096);
  RegionRegistry registry({});
  EXPECT_THAT(registry.RegisterShm({.name = "kv-cache", .byte_size = 1}).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "must start with \"laprox-\""));
  EXPECT_THAT(registry.RegisterShm({.name = "laprox-../etc", .byte_size = 1}).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "may contain only"));
  EXPECT_THAT(registry.RegisterShm({.name = UniqueName("missing"), .byte_size = 1}).status(),
              IsStatus(absl::StatusCode::kNotFound, "No such file"));
  EXPECT_THAT(registry.RegisterShm({.name = object.name(), .byte_size = 0}).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "shm.byte_size = 0 must be > 0"));
  EXPECT_THAT(registry.RegisterShm({.name = object.name(), .offset = -1, .byte_size = 1}).status(),
              IsStatus(absl::StatusCode::kInvalidArgument, "shm.offset = -1"));
  EXPECT_THAT(
      registry.RegisterShm({.name = object.name(), .offset = 4000, .byte_size = 97}).status(),
      IsStatus(absl::StatusCode::kOutOfRange,
               "shm.offset + shm.byte_size = 4000 + 97 exceeds the 4096 bytes"));
  EXPECT_THAT(
      registry.RegisterShm({.name = object.name(), .offset = INT64_MAX, .byte_size = 2}).status(),
      IsStatus(absl::StatusCode::kOutOfRange, "exceeds"));
  EXPECT_TRUE(registry.List().empty());  // nothing half-registered
}

TEST(RegionRegistryTest, EnforcesTheRegionLimit) {
  ShmObject object(UniqueName("limit"), 4096);
  RegionRegistry registry({.max_regions = 2});
  ASSERT_TRUE(registry.RegisterShm({.name = object.name(), .byte_size = 8}).ok());
  ASSERT_TRUE(registry.RegisterShm({.name = object.name(), .byte_size = 8}).ok());
  EXPECT_THAT(registry.RegisterShm({.name = object.name(), .byte_size = 8}).status(),
              IsStatus(absl::StatusCode::kResourceExhausted, "limit 2"));
}

TEST(RegionRegistryTest, UnknownIdsAreNotFound) {
  RegionRegistry registry({});
  EXPECT_THAT(registry.Acquire(42).status(),
              IsStatus(absl::StatusCode::kNotFound, "region 42 not found"));
  EXPECT_THAT(registry.Unregister(42), IsStatus(absl::StatusCode::kNotFound, "region 42"));
}

// A request holds a lease; unregistration refuses new leases at once and returns only after
// the request released its lease.
TEST(RegionRegistryTest, UnregisterWaitsForInFlightRequests) {
  ShmObject object(UniqueName("drain"), 4096);
  RegionRegistry registry({});
  const uint64_t id = *registry.RegisterShm({.name = object.name(), .byte_size = 4096});
  auto acquired = registry.Acquire(id);
  ASSERT_TRUE(acquired.ok());
  std::optional<RegionLease> lease(std::move(acquired).value());

  std::atomic<bool> unregistered{false};
  std::thread unregister([&] {
    EXPECT_TRUE(registry.Unregister(id).ok());
    unregistered = true;
  });
  // Wait (bounded, no sleeps) until the registry reports the region draining.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  std::vector<RegionInfo> list = registry.List();
  while (!(list.size() == 1 && list[0].draining) && !unregistered && absl::Now() < give_up) {
    std::this_thread::yield();
    list = registry.List();
  }
  ASSERT_EQ(list.size(), 1u) << "the region went away while a request held it";
  ASSERT_TRUE(list[0].draining);
  EXPECT_EQ(list[0].in_use, 1);
  EXPECT_THAT(registry.Acquire(id).status(),
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
  EXPECT_TRUE(registry.List().empty());
}

TEST(RegionRegistryTest, UnregisterDeadlineLeavesTheRegionDraining) {
  ShmObject object(UniqueName("deadline"), 4096);
  RegionRegistry registry({});
  const uint64_t id = *registry.RegisterShm({.name = object.name(), .byte_size = 64});
  {
    auto lease = registry.Acquire(id);
    ASSERT_TRUE(lease.ok());
    EXPECT_THAT(registry.Unregister(id, absl::Now()),
                IsStatus(absl::StatusCode::kDeadlineExceeded, "still used by 1 requests"));
    EXPECT_THAT(registry.Unregister(id),
                IsStatus(absl::StatusCode::kFailedPrecondition, "already being unregistered"));
    ASSERT_EQ(registry.List().size(), 1u);
  }
  EXPECT_TRUE(registry.List().empty());  // gone with its last lease
}

}  // namespace
}  // namespace laprox::service
