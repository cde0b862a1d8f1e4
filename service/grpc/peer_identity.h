// Who a call comes from, and whether it may call at all.
//
// On the Unix socket the kernel says who connected (SO_PEERCRED: pid, uid, gid; SO_PEERGROUPS:
// the supplementary groups), but gRPC's auth context does not carry it (gRPC 1.51). So laproxd
// accepts connections itself (UnixListener), reads each connection's credentials once, and
// hands the connection to the gRPC server (grpc::AddInsecureChannelFromFd), which names its
// calls' peer "fd:N". A call's credentials are those recorded for fd N, and only while fd N is
// still the very socket that was accepted (same inode; anything else is PERMISSION_DENIED).
// gRPC may close fd N when the peer hangs up, before a call that arrived on it has been
// identified, so the listener hands connections out under numbers counted upwards through
// [min(limit / 2, 65536), RLIMIT_NOFILE) and reuses a number only after the whole range went
// round (the kernel gives other files the lowest free numbers, far below). What remains: a call
// whose handler starts only after that many later connections (458k at a 512k limit, 512 at a
// limit of 1024) could be identified as the connection that got its number again.
//
// On TCP the identity is the client certificate's (mutual TLS), else the one identity "tcp".
//
//   auto listener = UnixListener::Listen("/run/laprox/laproxd.sock");   // bound, listening
//   ... server = builder.BuildAndStart();  (*listener)->Start(server.get());
//   options.identify = [&](const grpc::ServerContextBase& c) {
//     return IdentifyCaller(c, listener->get(), policy);
//   };
//   ... (*listener)->Stop(); server->Shutdown();
#ifndef LAPROX_SERVICE_GRPC_PEER_IDENTITY_H_
#define LAPROX_SERVICE_GRPC_PEER_IDENTITY_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "service/core/owner.h"

namespace laprox::service {

// What the kernel said about a Unix-socket peer when it connected.
struct PeerCredentials {
  pid_t pid = 0;  // 0 when the peer is in a pid namespace laproxd cannot see
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups (SO_PEERGROUPS), may be empty
};

// Who may call laproxd over the Unix socket: uid 0 always, then any uid in `uids`, then any
// peer whose primary or supplementary group is in `gids`. (Who may connect at all is the
// socket's mode: --socket_mode.)
struct AccessPolicy {
  std::vector<uid_t> uids;
  std::vector<gid_t> gids;

  // laproxd's own uid and gid: the default.
  static AccessPolicy OwnUser();
  // Parses "1000,1001" (decimal ids, comma-separated; empty: none); INVALID_ARGUMENT naming
  // `flag` and the bad entry.
  static absl::StatusOr<std::vector<uint32_t>> ParseIds(absl::string_view text,
                                                        absl::string_view flag);
  // OK, or PERMISSION_DENIED naming the peer's uid and groups and what is allowed.
  absl::Status Check(const PeerCredentials& peer) const;
};

// Accepts connections on a Unix socket and hands them to a gRPC server, remembering each
// connection's credentials. Thread-safe.
class UnixListener {
 public:
  // Binds `path` (which must not exist: SocketClaim clears it; the socket's mode is the umask's)
  // and listens. Errors carry the errno text and the path.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Listen(const std::string& path);
  ~UnixListener();  // Stop(), then closes the listening socket
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Starts accepting on a thread of its own; every connection goes to `server`, which must
  // stay up until Stop() returns.
  void Start(grpc::Server* server);
  // Stops accepting (call before shutting the server down); connections already handed over
  // stay the server's. Idempotent.
  void Stop();

  // The credentials of the connection a call arrived on, from its context's peer() ("fd:N"),
  // or nullopt when the peer is not one of this listener's live connections.
  std::optional<PeerCredentials> Lookup(absl::string_view peer) const;

  // Whether a connection of (uid, pid) is still open (pid 0: one whose pid is unknown); the
  // LeaseTable's Connected.
  bool Connected(uid_t uid, pid_t pid) const;

  // Connections accepted so far (for tests and logs).
  int64_t accepted() const;

 private:
  struct Connection {
    PeerCredentials credentials;
    uint64_t inode = 0;  // the socket's inode: a recycled fd number names another one
  };

  UnixListener(int listen_fd, int wake_fd) : listen_fd_(listen_fd), wake_fd_(wake_fd) {}
  void AcceptLoop(grpc::Server* server);
  // Accepts one connection and hands it to `server`; false when there was none to accept.
  bool AcceptOne(grpc::Server* server);
  // A descriptor number for a new connection (see the file comment); takes ownership of `fd`.
  int Renumber(int fd);

  const int listen_fd_;
  const int wake_fd_;  // eventfd: wakes the accept loop to stop
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);
  int64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  int next_fd_ = 0;  // the accept thread's only
  int low_fd_ = 0;
  int high_fd_ = 0;
};

// The Owner a call acts as: a connection of `listener` ("fd:N") as the uid (and pid) it
// connected with, if `policy` allows it; TCP ("ipv4:", "ipv6:") as "x509:<certificate
// identity>" with mutual TLS, else "tcp". PERMISSION_DENIED for a Unix peer the policy refuses, and
// for a peer laproxd cannot identify (a connection it did not accept).
absl::StatusOr<Owner> IdentifyCaller(const grpc::ServerContextBase& context,
                                     const UnixListener* listener, const AccessPolicy& policy);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_PEER_IDENTITY_H_
