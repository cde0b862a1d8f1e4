// Owner: who registered a region or a model, and who is asking.
//
// Every region and model belongs to the identity that registered it; a call sees, uses and
// unregisters only what its own identity registered (anything else is NOT_FOUND, as if it did
// not exist). A local process is identified by its uid (the kernel's SO_PEERCRED on the Unix
// socket: two processes of one user are one identity, as Unix would have it); a TCP client by
// its client certificate, or as the one identity "tcp" without mutual TLS. Owner::Laproxd() is
// the server itself (metrics, shutdown, tests): it sees everything and passes every check.
#ifndef LAPROX_SERVICE_CORE_OWNER_H_
#define LAPROX_SERVICE_CORE_OWNER_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace laprox::service {

class Owner {
 public:
  // laproxd itself: sees everything; maps any shm object it may open.
  static Owner Laproxd() { return Owner("laproxd", std::nullopt, /*all=*/true); }
  // A local process running as `uid` ("uid:1000"): maps only shm objects `uid` owns, unless
  // `uid` is 0. `pid` (0: unknown) is the process calling: what it registers is reclaimed
  // when it is gone (leases.h); it does not change what the owner sees.
  static Owner LocalUser(uid_t uid, pid_t pid = 0) {
    Owner owner(absl::StrCat("uid:", uid), uid, false);
    owner.pid_ = pid;
    return owner;
  }
  // A client on TCP ("tcp", or "x509:" + its certificate's identity with mutual TLS): it has
  // no local uid, so it maps no shm object.
  static Owner Remote(std::string identity) {
    return Owner(std::move(identity), std::nullopt, false);
  }

  const std::string& id() const { return id_; }
  // The local uid, for shm ownership checks; none for TCP clients and for Laproxd().
  std::optional<uid_t> uid() const { return uid_; }
  // The calling process of a LocalUser (0: unknown, and for the others).
  pid_t pid() const { return pid_; }
  bool sees_everything() const { return all_; }

  // Whether something `registrant` registered is visible to this caller.
  bool Sees(const Owner& registrant) const { return all_ || registrant.id_ == id_; }

 private:
  Owner(std::string id, std::optional<uid_t> uid, bool all)
      : id_(std::move(id)), uid_(uid), all_(all) {}

  std::string id_;
  std::optional<uid_t> uid_;
  pid_t pid_ = 0;
  bool all_ = false;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_OWNER_H_
