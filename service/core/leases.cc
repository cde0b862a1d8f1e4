#include "service/core/leases.h"

#include <algorithm>
#include <cerrno>
#include <utility>

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace laprox::service {
namespace {

// A pidfd for `pid`, or -1 (errno ESRCH: no such process).
int OpenPidfd(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

bool PidfdExited(int pidfd) {
  pollfd p{.fd = pidfd, .events = POLLIN, .revents = 0};
  return poll(&p, 1, 0) > 0;  // readable once the process has exited
}

}  // namespace

LeaseTable::~LeaseTable() {
  for (auto& [key, holder] : holders_) {
    if (holder.pidfd >= 0) close(holder.pidfd);
  }
}

void LeaseTable::Add(const Owner& owner, Kind kind, uint64_t id) {
  if (owner.sees_everything() || !owner.uid().has_value()) return;
  const Key key{*owner.uid(), owner.pid()};
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = holders_.try_emplace(key);
  Holder& holder = it->second;
  if (inserted) {
    holder.uid = *owner.uid();
    holder.pid = owner.pid();
    if (holder.pid > 0) {
      holder.pidfd = OpenPidfd(holder.pid);
      holder.exited = holder.pidfd < 0 && errno == ESRCH;
    }
  }
  holder.last_seen = absl::Now();
  holder.registrations.push_back({kind, id});
}

void LeaseTable::Remove(Kind kind, uint64_t id) {
  absl::MutexLock lock(&mu_);
  for (auto& [key, holder] : holders_) {
    auto& r = holder.registrations;
    r.erase(std::remove_if(r.begin(), r.end(),
                           [&](const Registration& x) { return x.kind == kind && x.id == id; }),
            r.end());
  }
}

bool LeaseTable::Gone(Holder& holder, const Connected& connected, absl::Time now) const {
  if (connected(holder.uid, holder.pid)) {
    holder.last_seen = now;
    return false;
  }
  if (holder.pid > 0 && holder.pidfd >= 0) return PidfdExited(holder.pidfd);
  if (holder.pid > 0 && holder.exited) return true;
  return now - holder.last_seen >= lease_;
}

std::vector<LeaseTable::Registration> LeaseTable::Collect(const Connected& connected,
                                                          absl::Time now) {
  std::vector<Registration> lapsed;
  absl::MutexLock lock(&mu_);
  for (auto it = holders_.begin(); it != holders_.end();) {
    Holder& holder = it->second;
    if (holder.registrations.empty() || Gone(holder, connected, now)) {
      lapsed.insert(lapsed.end(), holder.registrations.begin(), holder.registrations.end());
      if (holder.pidfd >= 0) close(holder.pidfd);
      it = holders_.erase(it);
    } else {
      ++it;
    }
  }
  return lapsed;
}

int64_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [key, holder] : holders_) n += static_cast<int64_t>(holder.registrations.size());
  return n;
}

}  // namespace laprox::service
