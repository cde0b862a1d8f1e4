// RegionRegistry: client memory registered once and used by many requests.
//
// A region is a window of client memory the server can read (and, when registered writable,
// write): POSIX shared memory now, CUDA IPC allocations once the CUDA backend imports them. The
// registry maps each region once at registration, hands requests reference-counted leases, and
// on unregistration refuses new leases at once but unmaps only after the last lease is released,
// so a request that started never sees its memory disappear.
//
// Thread safety: every method may be called concurrently. Leases must not outlive the registry.
#ifndef LAPROX_SERVICE_CORE_REGION_REGISTRY_H_
#define LAPROX_SERVICE_CORE_REGION_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace laprox::service {

enum class RegionKind { kShm, kCudaIpc };

// A POSIX shared-memory object window. `name` as /dev/shm lists it ("laprox-kv0"; one leading
// "/" is accepted): it must start with "laprox-" and contain only [A-Za-z0-9._-].
struct ShmRegionSpec {
  std::string name;
  int64_t offset = 0;     // bytes into the object, >= 0
  int64_t byte_size = 0;  // > 0; offset + byte_size <= the object's size
  bool writable = false;  // map read-write (outputs may be written there)
};

struct RegionInfo {
  uint64_t id = 0;
  RegionKind kind = RegionKind::kShm;
  std::string name;  // the shm object name
  int64_t byte_size = 0;
  bool writable = false;
  int64_t in_use = 0;     // leases held by requests right now
  bool draining = false;  // being unregistered: no new leases
};

// One mapped region. Immutable; unmapped when destroyed.
class MappedRegion {
 public:
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  const RegionInfo& info() const { return info_; }
  // First byte of the region (host memory for shm).
  std::byte* data() const { return data_; }

  // The bytes [byte_offset, byte_offset + byte_count) of the region, or OUT_OF_RANGE naming
  // `field` and the numbers when they do not lie inside it (overflow included).
  absl::StatusOr<std::byte*> Slice(int64_t byte_offset, int64_t byte_count,
                                   absl::string_view field) const;

 private:
  friend class RegionRegistry;
  MappedRegion() = default;

  RegionInfo info_;
  std::byte* data_ = nullptr;
  void* mapping_ = nullptr;  // page-aligned start of the mapping
  size_t mapping_size_ = 0;
};

class RegionRegistry;

// A request's hold on a region; move-only. Unregistering waits for every lease to be released.
class RegionLease {
 public:
  RegionLease(RegionLease&& other) noexcept;
  RegionLease& operator=(RegionLease&& other) noexcept;
  RegionLease(const RegionLease&) = delete;
  RegionLease& operator=(const RegionLease&) = delete;
  ~RegionLease();

  const MappedRegion& region() const { return *region_; }

 private:
  friend class RegionRegistry;
  RegionLease(RegionRegistry* registry, std::shared_ptr<const MappedRegion> region)
      : registry_(registry), region_(std::move(region)) {}
  void Release();

  RegionRegistry* registry_ = nullptr;
  std::shared_ptr<const MappedRegion> region_;
};

class RegionRegistry {
 public:
  struct Limits {
    int64_t max_regions = 1024;
  };

  explicit RegionRegistry(Limits limits) : limits_(limits) {}
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  // Opens and maps the shared-memory window; returns its id (never 0, never reused).
  // INVALID_ARGUMENT: bad name, negative offset, byte_size <= 0; NOT_FOUND: no such object;
  // PERMISSION_DENIED: the server may not open it; OUT_OF_RANGE: past the object's end;
  // RESOURCE_EXHAUSTED: max_regions reached; INTERNAL: mmap failed.
  absl::StatusOr<uint64_t> RegisterShm(const ShmRegionSpec& spec);

  // A lease on region `id` for one request. NOT_FOUND: unknown id; FAILED_PRECONDITION: the
  // region is being unregistered.
  absl::StatusOr<RegionLease> Acquire(uint64_t id);

  // Stops new leases at once, waits until in-flight requests release theirs (or `deadline`),
  // then unmaps. NOT_FOUND: unknown id; FAILED_PRECONDITION: already being unregistered;
  // DEADLINE_EXCEEDED: leases still held at the deadline (the region stays draining and is
  // unmapped when the last lease goes).
  absl::Status Unregister(uint64_t id, absl::Time deadline = absl::InfiniteFuture());

  // Every registered region (draining ones included), by id.
  std::vector<RegionInfo> List() const;

 private:
  friend class RegionLease;
  struct Entry {
    std::shared_ptr<MappedRegion> region;
    int64_t in_use = 0;
    bool draining = false;
  };

  void ReleaseLease(uint64_t id);

  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_REGION_REGISTRY_H_
