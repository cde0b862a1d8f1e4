// FaultGuard: client shared memory that cannot kill the server when the client shrinks it.
//
// A POSIX shm object stays the client's: it may ftruncate it at any time, and then every page
// of our MAP_SHARED mapping past the new end raises SIGBUS on access — in a BLAS kernel, a
// memcpy, or the CUDA driver copying it to the device. Sealing (F_SEAL_SHRINK) is only possible
// on memfds created with MFD_ALLOW_SEALING, not on shm_open objects, and checking the size with
// fstat before each use leaves a window between the check and the read. So laproxd catches the
// fault: a process-wide SIGBUS handler looks the faulting address up in a lock-free table of
// guarded mappings; if it lies in one, the handler replaces that whole mapping with anonymous
// zero pages (mmap MAP_FIXED: one system call, no allocation, no lock) and marks it faulted,
// and the faulting instruction resumes on zeros. The request that was reading it computes
// garbage that is never returned: Core checks faulted() before it writes or replies and fails
// the request with FAILED_PRECONDITION; the region stays unusable until it is unregistered.
// No longjmp leaves a library in an unknown state, and no thread is killed.
//
// A SIGBUS at an address outside every guarded mapping is a real bug: the handler restores the
// previous disposition (the default: core dump) and returns, so the fault repeats and is
// reported as it would have been without the guard.
//
// Thread safety: Create, the destructor and faulted() may be called from any thread, and the
// handler may run on any thread at any time.
#ifndef LAPROX_SERVICE_CORE_FAULT_GUARD_H_
#define LAPROX_SERVICE_CORE_FAULT_GUARD_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace laprox::service {

class GuardedMapping {
 public:
  // Guards the page-aligned mapping [begin, begin + size) (size is rounded up to whole pages)
  // until the returned object is destroyed, which must happen before the mapping is unmapped.
  // Installs the SIGBUS handler on first use. RESOURCE_EXHAUSTED when kMaxGuarded mappings are
  // guarded already; INTERNAL if the handler cannot be installed.
  static absl::StatusOr<std::unique_ptr<GuardedMapping>> Create(void* begin, size_t size);

  GuardedMapping(const GuardedMapping&) = delete;
  GuardedMapping& operator=(const GuardedMapping&) = delete;
  ~GuardedMapping();

  // Whether an access faulted (the mapping now holds zeros) or MarkShrunk was called.
  bool faulted() const;
  // Marks the mapping unusable without a fault (the object was seen to be too small).
  void MarkShrunk();

  static constexpr int kMaxGuarded = 1 << 16;

 private:
  explicit GuardedMapping(int slot) : slot_(slot) {}
  int slot_;
};

// SIGBUS faults absorbed inside guarded mappings since the process started.
int64_t GuardedFaultCount();

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_FAULT_GUARD_H_
