#include "service/core/region_registry.h"

#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace laprox::service {
namespace {

constexpr absl::string_view kShmPrefix = "laprox-";
constexpr size_t kMaxShmName = 255;

absl::Status CheckShmName(absl::string_view name) {
  absl::ConsumePrefix(&name, "/");
  if (!absl::StartsWith(name, kShmPrefix) || name.size() > kMaxShmName) {
    return absl::InvalidArgumentError(absl::StrCat("shm.name \"", name, "\" must start with \"",
                                                   kShmPrefix, "\" and have at most ", kMaxShmName,
                                                   " characters"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("shm.name \"", name, "\" may contain only [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ErrnoStatus(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case ELOOP:  // O_NOFOLLOW met a symbolic link
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": it is a symbolic link, which laproxd never follows"));
    case EISDIR:
      return absl::InvalidArgumentError(absl::StrCat(what, ": it is a directory"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

// What a non-regular file is, for the message that refuses it.
absl::string_view FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// Whether `owner` may have laproxd map the object `st` describes: the caller's uid owns it (or
// is root), and the object's own owner bits grant the access asked for. laproxd opened it with
// its own rights; without this check any caller could read (or write) what only laproxd may.
absl::Status CheckObjectOwner(const struct stat& st, bool writable, const Owner& owner,
                              absl::string_view name) {
  if (owner.sees_everything()) return absl::OkStatus();
  if (!owner.uid().has_value()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shm.name \"", name, "\": shared memory is registered over the Unix socket, where laproxd ",
        "knows the caller's uid; this caller (", owner.id(), ") has none"));
  }
  const uid_t uid = *owner.uid();
  if (uid == 0) return absl::OkStatus();
  if (st.st_uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("shm.name \"", name, "\" is owned by uid ",
                                                    st.st_uid, ", not by the caller's uid ", uid));
  }
  const mode_t needed = S_IRUSR | (writable ? S_IWUSR : 0);
  if ((st.st_mode & needed) != needed) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shm.name \"", name, "\" has mode ", absl::StrFormat("%04o", st.st_mode & 07777),
        writable ? "; registering it writable needs its owner-read and owner-write bits"
                 : "; registering it needs its owner-read bit"));
  }
  return absl::OkStatus();
}

}  // namespace

MappedRegion::~MappedRegion() {
  guard_.reset();  // before the range can be reused by another mapping
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
  if (fd_ >= 0) close(fd_);
}

MemoryRange MappedRegion::Range(int64_t byte_offset, int64_t byte_count) const {
  MemoryRange range;
  range.kind = info_.kind;
  if (info_.kind == RegionKind::kShm) {
    range.object_device = object_device_;
    range.object_inode = object_inode_;
    range.begin = static_cast<uint64_t>(info_.offset + byte_offset);
  } else {
    range.begin = reinterpret_cast<uintptr_t>(data_) + static_cast<uint64_t>(byte_offset);
  }
  range.end = range.begin + static_cast<uint64_t>(byte_count);
  return range;
}

absl::Status MappedRegion::ShrunkError() const {
  return absl::FailedPreconditionError(
      absl::StrCat("region ", info_.id, " (shm \"", info_.name,
                   "\") was shrunk by its client while registered: the server no longer reads it; "
                   "unregister it and register the object again"));
}

absl::Status MappedRegion::CheckIntact() const {
  if (guard_ == nullptr) return absl::OkStatus();  // cuda_ipc: the driver keeps it alive
  if (guard_->faulted()) return ShrunkError();
  struct stat st {};
  if (fstat(fd_, &st) == 0 && st.st_size < info_.offset + info_.byte_size) {
    guard_->MarkShrunk();
    return ShrunkError();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::byte*> MappedRegion::Slice(int64_t byte_offset, int64_t byte_count,
                                               absl::string_view field) const {
  int64_t end;
  if (byte_offset < 0 || byte_count < 0 || __builtin_add_overflow(byte_offset, byte_count, &end) ||
      end > info_.byte_size) {
    return absl::OutOfRangeError(absl::StrCat(field, ": bytes [", byte_offset, ", +", byte_count,
                                              ") are outside region ", info_.id, " of ",
                                              info_.byte_size, " bytes"));
  }
  return data_ + byte_offset;
}

RegionLease::RegionLease(RegionLease&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)), region_(std::move(other.region_)) {}

RegionLease& RegionLease::operator=(RegionLease&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = std::exchange(other.registry_, nullptr);
    region_ = std::move(other.region_);
  }
  return *this;
}

RegionLease::~RegionLease() { Release(); }

void RegionLease::Release() {
  if (registry_ != nullptr) registry_->ReleaseLease(region_->info().id);
  registry_ = nullptr;
  region_.reset();
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterShm(const ShmRegionSpec& spec,
                                                     const Owner& owner) {
  if (absl::Status s = CheckShmName(spec.name); !s.ok()) return s;
  if (spec.offset < 0 || spec.byte_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm.offset = ", spec.offset,
                     " must be >= 0 and shm.byte_size = ", spec.byte_size, " must be > 0"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckRoom(); !s.ok()) return s;
  }
  absl::string_view name = spec.name;
  absl::ConsumePrefix(&name, "/");
  const std::string path = absl::StrCat("/", name);
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer on this thread forever;
  // O_NOFOLLOW: a symbolic link could name any file the server may open; O_NOCTTY: a terminal
  // must not become ours. Only a regular file is then mapped.
  const int flags = (spec.writable ? O_RDWR : O_RDONLY) | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY;
  const int fd = shm_open(path.c_str(), flags, 0);
  if (fd < 0) {
    const int error = errno;
    // What is there when it is not a regular file: glibc's shm_open reports a directory as
    // EINVAL, and open(2) a Unix socket as ENXIO; say what the name is instead.
    if (struct stat st{}; error != ENOENT && error != ELOOP &&
                          lstat(absl::StrCat("/dev/shm", path).c_str(), &st) == 0 &&
                          !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm.name \"", name, "\" is ", FileKind(st.st_mode), ", not a shared-memory object"));
    }
    return ErrnoStatus(error, absl::StrCat("shm.name \"", name, "\""));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return ErrnoStatus(error, absl::StrCat("fstat(\"", name, "\")"));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shm.name \"", name, "\" is ", FileKind(st.st_mode), ", not a shared-memory object"));
  }
  if (absl::Status s = CheckObjectOwner(st, spec.writable, owner, name); !s.ok()) {
    close(fd);
    return s;
  }
  int64_t end;
  if (__builtin_add_overflow(spec.offset, spec.byte_size, &end) || end > st.st_size) {
    close(fd);
    return absl::OutOfRangeError(absl::StrCat("shm.offset + shm.byte_size = ", spec.offset, " + ",
                                              spec.byte_size, " exceeds the ", st.st_size,
                                              " bytes of \"", name, "\""));
  }
  // mmap offsets must be page-aligned: map from the enclosing page.
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = spec.offset / page * page;
  const size_t map_size = static_cast<size_t>(end - map_offset);
  void* mapping = mmap(nullptr, map_size, PROT_READ | (spec.writable ? PROT_WRITE : 0), MAP_SHARED,
                       fd, map_offset);
  if (mapping == MAP_FAILED) {
    const int map_error = errno;
    close(fd);
    return ErrnoStatus(map_error, absl::StrCat("mmap(\"", name, "\")"));
  }

  // From here the region owns the fd and the mapping.
  auto region = std::shared_ptr<MappedRegion>(new MappedRegion(owner));
  region->fd_ = fd;
  region->mapping_ = mapping;
  region->mapping_size_ = map_size;
  region->mapping_offset_ = map_offset;
  region->object_device_ = st.st_dev;
  region->object_inode_ = st.st_ino;
  auto guard = GuardedMapping::Create(mapping, map_size);
  if (!guard.ok()) return guard.status();
  region->guard_ = *std::move(guard);
  region->data_ = static_cast<std::byte*>(mapping) + (spec.offset - map_offset);
  region->info_.kind = RegionKind::kShm;
  region->info_.name = std::string{name};
  region->info_.offset = spec.offset;
  region->info_.byte_size = spec.byte_size;
  region->info_.writable = spec.writable;
  return Insert(std::move(region));
}

absl::StatusOr<uint64_t> RegionRegistry::RegisterCudaIpc(const kernels::CudaIpcRegionSpec& spec,
                                                         bool writable, const Owner& owner) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckRoom(); !s.ok()) return s;
  }
  // Opening is slow (the driver maps the allocation): never under mu_.
  absl::StatusOr<std::unique_ptr<kernels::ImportedRegion>> imported = backend_.ImportCudaIpc(spec);
  if (!imported.ok()) return imported.status();
  auto region = std::shared_ptr<MappedRegion>(new MappedRegion(owner));
  region->data_ = (*imported)->data();
  region->space_ = (*imported)->space();
  region->imported_ = *std::move(imported);
  region->info_.kind = RegionKind::kCudaIpc;
  // ImportCudaIpc accepted the UUID, so it is well formed.
  region->info_.device_uuid = kernels::CanonicalDeviceUuid(spec.device_uuid).value_or("");
  region->info_.offset = spec.offset;
  region->info_.byte_size = region->imported_->byte_size();
  region->info_.writable = writable;
  return Insert(std::move(region));
}

absl::Status RegionRegistry::CheckRoom() const {
  if (static_cast<int64_t>(regions_.size()) >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "already ", regions_.size(), " regions registered (limit ", limits_.max_regions, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RegionRegistry::Insert(std::shared_ptr<MappedRegion> region) {
  absl::Status full;
  {
    absl::MutexLock lock(&mu_);
    full = CheckRoom();  // again: another registration may have raced this one
    if (full.ok()) {
      const uint64_t id = next_id_++;
      region->info_.id = id;
      regions_[id].region = std::move(region);
      return id;
    }
  }
  region.reset();  // unmapped / closed outside the lock
  return full;
}

absl::StatusOr<RegionLease> RegionRegistry::Acquire(uint64_t id, const Owner& owner) {
  if (id == 0) return absl::InvalidArgumentError("region_id is 0 (ids start at 1)");
  std::optional<RegionLease> lease;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(id);
    if (it == regions_.end() || !owner.Sees(it->second.region->owner())) {
      return absl::NotFoundError(absl::StrCat("region ", id, " not found"));
    }
    if (it->second.draining) {
      return absl::FailedPreconditionError(absl::StrCat("region ", id, " is being unregistered"));
    }
    ++it->second.in_use;
    lease.emplace(RegionLease(this, it->second.region));
  }
  // fstat outside mu_; the lease is released again if the object shrank.
  if (absl::Status s = lease->region().CheckIntact(); !s.ok()) return s;
  return *std::move(lease);
}

void RegionRegistry::ReleaseLease(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  // A region whose Unregister gave up at its deadline goes with its last lease.
  if (--it->second.in_use == 0 && it->second.draining) regions_.erase(it);
}

absl::Status RegionRegistry::Unregister(uint64_t id, const Owner& owner, absl::Time deadline) {
  if (id == 0) return absl::InvalidArgumentError("region_id is 0 (ids start at 1)");
  std::shared_ptr<MappedRegion> region;  // unmapped after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || !owner.Sees(it->second.region->owner())) {
    return absl::NotFoundError(absl::StrCat("region ", id, " not found"));
  }
  // A second call on a draining region waits like the first (the proto's promise).
  it->second.draining = true;
  // Leases release under mu_, so the entry cannot vanish while we wait for in_use == 0: only a
  // release that brings it to 0 erases it, and then the condition is already true.
  auto idle = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto found = regions_.find(id);
    return found == regions_.end() || found->second.in_use == 0;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("region ", id, " is still used by ", regions_.at(id).in_use,
                     " requests; it will be unmapped when they finish"));
  }
  it = regions_.find(id);
  if (it != regions_.end()) {
    region = std::move(it->second.region);
    regions_.erase(it);
  }
  return absl::OkStatus();
}

std::vector<RegionInfo> RegionRegistry::List(const Owner& owner) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (const auto& [id, entry] : regions_) {
    if (!owner.Sees(entry.region->owner())) continue;
    RegionInfo info = entry.region->info();
    info.in_use = entry.in_use;
    info.draining = entry.draining;
    info.shrunk = entry.region->shrunk();
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace laprox::service
