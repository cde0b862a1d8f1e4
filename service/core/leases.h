// LeaseTable: what each local client process registered, so that laproxd can take it back when
// the process is gone.
//
// A holder is a process on the Unix socket: (uid, pid) when the kernel gave laproxd the pid,
// else (uid) for a peer in a pid namespace laproxd cannot see. Its regions and models are
// reclaimed once none of its connections is open any more and
//   - with a pid: the process has exited (a pidfd taken when it first registered says so at
//     once; a pid that no longer exists counts as exited);
//   - without: `lease` has passed since it was last seen connected.
// A process that is alive keeps what it registered even while its channel is idle and
// disconnected. Registrations of laproxd itself and of TCP callers are not tracked (a TCP
// client has no process laproxd could watch, and no keep-alive exists yet).
//
// Thread safety: every method may be called concurrently.
#ifndef LAPROX_SERVICE_CORE_LEASES_H_
#define LAPROX_SERVICE_CORE_LEASES_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/core/owner.h"

namespace laprox::service {

class LeaseTable {
 public:
  enum class Kind { kRegion, kModel };
  struct Registration {
    Kind kind = Kind::kRegion;
    uint64_t id = 0;
  };
  // Whether a holder still has an open connection: (uid, pid); pid 0 matches any of the uid's
  // connections whose pid is unknown.
  using Connected = std::function<bool(uid_t uid, pid_t pid)>;

  explicit LeaseTable(absl::Duration lease) : lease_(lease) {}
  ~LeaseTable();
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // Records that `owner` registered (kind, id); ignored unless owner is a LocalUser.
  void Add(const Owner& owner, Kind kind, uint64_t id);
  // Forgets (kind, id): it was unregistered.
  void Remove(Kind kind, uint64_t id);
  // Removes the holders that are gone (see above) at `now` and returns their registrations,
  // for the caller to unregister.
  std::vector<Registration> Collect(const Connected& connected, absl::Time now = absl::Now());
  // Registrations tracked, over every holder (for tests).
  int64_t size() const;

 private:
  struct Holder {
    uid_t uid = 0;
    pid_t pid = 0;
    int pidfd = -1;        // -1: none (pid unknown, or pidfd_open refused)
    bool exited = false;   // the pid did not exist when it first registered
    absl::Time last_seen;  // connected, or registering
    std::vector<Registration> registrations;
  };
  using Key = std::tuple<uid_t, pid_t>;

  bool Gone(Holder& holder, const Connected& connected, absl::Time now) const;

  const absl::Duration lease_;
  mutable absl::Mutex mu_;
  std::map<Key, Holder> holders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_LEASES_H_
