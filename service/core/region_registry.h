// RegionRegistry: client memory registered once and used by many requests.
//
// A region is a window of client memory the server can read (and, when registered writable,
// write): POSIX shared memory (mapped here, host memory) or a CUDA IPC allocation (opened by the
// backend through kernels::Backend::ImportCudaIpc, device memory; this file includes no CUDA
// header). The registry maps or opens each region once at registration, hands requests
// reference-counted leases, and on unregistration refuses new leases at once but unmaps / closes
// only after the last lease is released, so a request that started never sees its memory
// disappear.
//
// Opening never blocks and only maps regular files: a FIFO, directory, device or symbolic link
// named like a shm object is INVALID_ARGUMENT naming what it is. A client may shrink its object
// at any time; a shm mapping is guarded (fault_guard.h), so an access past the new end makes the
// region `shrunk` instead of raising SIGBUS, and a shrunk region cannot be leased again
// (FAILED_PRECONDITION) until it is unregistered.
//
// Every region belongs to the Owner that registered it (owner.h): another owner cannot lease,
// list or unregister it (NOT_FOUND, like an unknown id). A shm object is mapped for a local
// caller only if the caller's uid owns it (or the caller is root), judged by fstat on the
// opened descriptor, and writable only if the object's owner-write bit is set: laproxd opens it
// with its own rights, so it must not open what the caller could not.
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
#include "laprox/kernels/backend.h"
#include "laprox/kernels/tensor_view.h"
#include "service/core/fault_guard.h"
#include "service/core/owner.h"

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
  std::string name;         // the shm object name (shm only)
  std::string device_uuid;  // the owning device, "GPU-" + 36 lower-case characters (cuda_ipc only)
  int64_t offset = 0;       // into the shm object or the exported allocation, as registered
  int64_t byte_size = 0;
  bool writable = false;
  int64_t in_use = 0;     // leases held by requests right now
  bool draining = false;  // being unregistered: no new leases
  bool shrunk = false;    // the client shrank the object under the region: no new leases
};

// Bytes of the memory behind a region, comparable across regions: two registrations of one shm
// object give ranges in the same object (identified by device and inode; offsets into the
// object), and cuda_ipc ranges are device addresses of this process.
struct MemoryRange {
  RegionKind kind = RegionKind::kShm;
  uint64_t object_device = 0;
  uint64_t object_inode = 0;
  uint64_t begin = 0;  // [begin, end)
  uint64_t end = 0;

  // Whether the two ranges share a byte (empty ranges share none).
  bool Overlaps(const MemoryRange& other) const {
    return begin < end && other.begin < other.end && kind == other.kind &&
           object_device == other.object_device && object_inode == other.object_inode &&
           begin < other.end && other.begin < end;
  }
};

// One mapped (shm) or imported (cuda_ipc) region. Immutable; unmapped or closed when destroyed.
class MappedRegion {
 public:
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  const RegionInfo& info() const { return info_; }
  const Owner& owner() const { return owner_; }
  // First byte of the region, in space(): host memory for shm, device memory for cuda_ipc
  // (never dereference it on the host then).
  std::byte* data() const { return data_; }
  kernels::MemorySpace space() const { return space_; }

  // The bytes [byte_offset, byte_offset + byte_count) of the region, or OUT_OF_RANGE naming
  // `field` and the numbers when they do not lie inside it (overflow included).
  absl::StatusOr<std::byte*> Slice(int64_t byte_offset, int64_t byte_count,
                                   absl::string_view field) const;
  // The memory behind [byte_offset, byte_offset + byte_count) of the region (a Slice that
  // succeeded), for overlap checks across regions.
  MemoryRange Range(int64_t byte_offset, int64_t byte_count) const;

  // Whether the client shrank the shm object under the region (an access faulted, or fstat saw
  // it); the region's bytes are then zeros, whatever was read from it since is garbage.
  bool shrunk() const { return guard_ != nullptr && guard_->faulted(); }
  // OK, or FAILED_PRECONDITION when shrunk() or when the object is now smaller than the region
  // (fstat; the region is then marked shrunk for good).
  absl::Status CheckIntact() const;
  // FAILED_PRECONDITION naming the region, for a request that found it shrunk.
  absl::Status ShrunkError() const;

 private:
  friend class RegionRegistry;
  explicit MappedRegion(Owner owner) : owner_(std::move(owner)) {}

  RegionInfo info_;
  Owner owner_;
  std::byte* data_ = nullptr;
  kernels::MemorySpace space_ = kernels::MemorySpace::kHost;
  void* mapping_ = nullptr;  // shm: page-aligned start of the mapping
  size_t mapping_size_ = 0;
  int64_t mapping_offset_ = 0;  // shm: object offset of mapping_
  int fd_ = -1;                 // shm: kept open to fstat the object at every lease
  uint64_t object_device_ = 0;  // shm: st_dev and st_ino of the object
  uint64_t object_inode_ = 0;
  std::unique_ptr<GuardedMapping> guard_;              // shm: destroyed before the munmap
  std::unique_ptr<kernels::ImportedRegion> imported_;  // cuda_ipc: closed when destroyed
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

  // `backend` opens cuda_ipc regions and must outlive the registry. Ids are first_id,
  // first_id + 1, ... (laproxd starts at a random one, so that an id a client kept from before a
  // restart names nothing now).
  RegionRegistry(kernels::Backend& backend, Limits limits, uint64_t first_id = 1)
      : backend_(backend), limits_(limits), next_id_(first_id) {}
  explicit RegionRegistry(kernels::Backend& backend) : RegionRegistry(backend, Limits()) {}
  RegionRegistry(const RegionRegistry&) = delete;
  RegionRegistry& operator=(const RegionRegistry&) = delete;

  // Opens (non-blocking, never following a symbolic link) and maps the shared-memory window;
  // returns its id (never 0, never reused). INVALID_ARGUMENT: bad name, negative offset,
  // byte_size <= 0, or the name is not a regular file (FIFO, directory, symbolic link, device,
  // socket: the message says which); NOT_FOUND: no such object; PERMISSION_DENIED: the server
  // may not open it, `owner` does not own it (nor is root), wants it writable without its
  // owner-write bit, or has no local uid (a TCP client); OUT_OF_RANGE: past the object's end;
  // RESOURCE_EXHAUSTED: max_regions reached, or out of file descriptors; INTERNAL: mmap failed.
  absl::StatusOr<uint64_t> RegisterShm(const ShmRegionSpec& spec, const Owner& owner);

  // Opens the CUDA IPC allocation through the backend (Backend::ImportCudaIpc: once, it is
  // slow) and registers it; returns its id. Errors are the
  // backend's (see Backend::ImportCudaIpc: INVALID_ARGUMENT for a bad handle size or UUID,
  // UNIMPLEMENTED without a CUDA backend, NOT_FOUND for an unknown device, OUT_OF_RANGE past the
  // allocation), and RESOURCE_EXHAUSTED when max_regions is reached. `writable`: outputs may be
  // written there (through Backend::CopyToRegion).
  absl::StatusOr<uint64_t> RegisterCudaIpc(const kernels::CudaIpcRegionSpec& spec, bool writable,
                                           const Owner& owner);

  // A lease on region `id` for one request of `owner`. INVALID_ARGUMENT: id 0; NOT_FOUND:
  // unknown id, or another owner's; FAILED_PRECONDITION: the region is being unregistered, or
  // the client shrank it (see MappedRegion::CheckIntact).
  absl::StatusOr<RegionLease> Acquire(uint64_t id, const Owner& owner);

  // Stops new leases at once, waits until in-flight requests release theirs (or `deadline`),
  // then unmaps. Calling it again on a draining region waits the same way (OK once it is
  // gone). INVALID_ARGUMENT: id 0; NOT_FOUND: unknown id, or another owner's;
  // DEADLINE_EXCEEDED: leases still held at the deadline (the region stays draining and is
  // unmapped when the last lease goes).
  absl::Status Unregister(uint64_t id, const Owner& owner,
                          absl::Time deadline = absl::InfiniteFuture());

  // Every region `owner` registered (draining ones included), by id.
  std::vector<RegionInfo> List(const Owner& owner) const;

 private:
  friend class RegionLease;
  struct Entry {
    std::shared_ptr<MappedRegion> region;
    int64_t in_use = 0;
    bool draining = false;
  };

  void ReleaseLease(uint64_t id);
  absl::Status CheckRoom() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `region` an id and `owner`, and stores it; RESOURCE_EXHAUSTED (destroying it) when
  // full.
  absl::StatusOr<uint64_t> Insert(std::shared_ptr<MappedRegion> region);

  kernels::Backend& backend_;
  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_REGION_REGISTRY_H_
