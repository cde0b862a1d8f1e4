#include "service/grpc/peer_identity.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpcpp/server_posix.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace laprox::service {
namespace {

absl::Status ErrnoError(absl::string_view what, int error) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(error)));
}

// The inode of the socket behind `fd`, or 0 when `fd` is closed or not a socket.
uint64_t SocketInode(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

std::vector<gid_t> PeerGroups(int fd) {
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto length = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &length) == 0) {
      groups.resize(length / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE) break;
    groups.resize(length / sizeof(gid_t) + 1);  // the kernel said how much it needs
  }
  return {};
}

}  // namespace

AccessPolicy AccessPolicy::OwnUser() { return {.uids = {getuid()}, .gids = {getgid()}}; }

absl::StatusOr<std::vector<uint32_t>> AccessPolicy::ParseIds(absl::string_view text,
                                                             absl::string_view flag) {
  std::vector<uint32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    uint32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id == static_cast<uint32_t>(-1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": \"", part, "\" is not a numeric id (give e.g. 1000,1001)"));
    }
    ids.push_back(id);
  }
  return ids;
}

absl::Status AccessPolicy::Check(const PeerCredentials& peer) const {
  if (peer.uid == 0) return absl::OkStatus();
  if (std::find(uids.begin(), uids.end(), peer.uid) != uids.end()) return absl::OkStatus();
  auto allowed_group = [this](gid_t g) {
    return std::find(gids.begin(), gids.end(), g) != gids.end();
  };
  if (allowed_group(peer.gid) ||
      std::any_of(peer.groups.begin(), peer.groups.end(), allowed_group)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "uid ", peer.uid, " (gid ", peer.gid,
      peer.groups.empty() ? "" : absl::StrCat(", groups ", absl::StrJoin(peer.groups, ",")),
      ") may not call laproxd: it allows uid 0, --allowed_uids=", absl::StrJoin(uids, ","),
      " and --allowed_gids=", absl::StrJoin(gids, ",")));
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Listen(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path \"", path,
                                                   "\" is empty or longer than ",
                                                   sizeof(address.sun_path) - 1, " bytes"));
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return ErrnoError("socket(AF_UNIX)", errno);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, SOMAXCONN) != 0) {
    const int error = errno;
    close(fd);
    return absl::Status(
        error == EADDRINUSE ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kInternal,
        absl::StrCat("cannot listen on ", path, ": ", std::strerror(error)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int error = errno;
    close(fd);
    return ErrnoError("eventfd", error);
  }
  std::unique_ptr<UnixListener> listener(new UnixListener(fd, wake));
  // Connections get descriptor numbers from a high range, counted upwards (the file comment).
  struct rlimit files {};
  const int limit = getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < (1u << 30)
                        ? static_cast<int>(files.rlim_cur)
                        : 1 << 20;
  listener->low_fd_ = std::min(limit / 2, 1 << 16);
  listener->high_fd_ = limit;
  listener->next_fd_ = listener->low_fd_;
  return listener;
}

UnixListener::~UnixListener() {
  Stop();
  close(listen_fd_);
  close(wake_fd_);
}

void UnixListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    std::perror("laproxd: waking the accept loop");
  }
  thread_.join();
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  for (;;) {
    pollfd fds[2] = {{.fd = listen_fd_, .events = POLLIN, .revents = 0},
                     {.fd = wake_fd_, .events = POLLIN, .revents = 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::perror("laproxd: poll on the listening socket");
      return;
    }
    if (fds[1].revents != 0) return;
    while (AcceptOne(server)) {
    }
  }
}

bool UnixListener::AcceptOne(grpc::Server* server) {
  const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    const int error = errno;
    if (error == EINTR || error == ECONNABORTED) return true;
    if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
      std::fprintf(stderr, "laproxd: cannot accept a connection: %s\n", std::strerror(error));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // no busy loop meanwhile
    }
    return false;  // EAGAIN: none left
  }
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    std::perror("laproxd: SO_PEERCRED");
    close(fd);
    return true;
  }
  Connection connection{.credentials = {.pid = credentials.pid,
                                        .uid = credentials.uid,
                                        .gid = credentials.gid,
                                        .groups = PeerGroups(fd)}};
  const int number = Renumber(fd);
  connection.inode = SocketInode(number);
  {
    absl::MutexLock lock(&mu_);
    // Forget connections gRPC has closed (their fd no longer is the socket accepted).
    for (auto it = connections_.begin(); it != connections_.end();) {
      it = SocketInode(it->first) == it->second.inode ? std::next(it) : connections_.erase(it);
    }
    connections_[number] = std::move(connection);
    ++accepted_;
  }
  grpc::AddInsecureChannelFromFd(server, number);  // gRPC owns the fd from here
  return true;
}

int UnixListener::Renumber(int fd) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (next_fd_ < low_fd_ || next_fd_ >= high_fd_) next_fd_ = low_fd_;
    const int moved = fcntl(fd, F_DUPFD_CLOEXEC, next_fd_);
    if (moved >= 0) {
      close(fd);
      next_fd_ = moved + 1;
      return moved;
    }
    next_fd_ = low_fd_;  // nothing free above: start the range again
  }
  return fd;  // the range is full: keep the kernel's number (the inode check still holds)
}

std::optional<PeerCredentials> UnixListener::Lookup(absl::string_view peer) const {
  int number = 0;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &number)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(number);
  if (it == connections_.end() || SocketInode(number) != it->second.inode) return std::nullopt;
  return it->second.credentials;
}

bool UnixListener::Connected(uid_t uid, pid_t pid) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [number, connection] : connections_) {
    if (connection.credentials.uid == uid && connection.credentials.pid == pid &&
        SocketInode(number) == connection.inode) {
      return true;
    }
  }
  return false;
}

int64_t UnixListener::accepted() const {
  absl::MutexLock lock(&mu_);
  return accepted_;
}

absl::StatusOr<Owner> IdentifyCaller(const grpc::ServerContextBase& context,
                                     const UnixListener* listener, const AccessPolicy& policy) {
  const std::string peer = context.peer();
  if (absl::StartsWith(peer, "fd:")) {
    std::optional<PeerCredentials> credentials =
        listener == nullptr ? std::nullopt : listener->Lookup(peer);
    if (!credentials) {
      return absl::PermissionDeniedError(
          absl::StrCat("laproxd did not accept the connection this call came on (", peer,
                       "), so it cannot tell who is calling"));
    }
    if (absl::Status s = policy.Check(*credentials); !s.ok()) return s;
    return Owner::LocalUser(credentials->uid, credentials->pid);
  }
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
    const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) {
      std::vector<std::string> names;
      for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
        names.emplace_back(name.data(), name.size());
      }
      return Owner::Remote(absl::StrCat("x509:", absl::StrJoin(names, ",")));
    }
    return Owner::Remote("tcp");
  }
  return absl::PermissionDeniedError(
      absl::StrCat("laproxd cannot tell who is calling from peer \"", peer, "\""));
}

}  // namespace laprox::service
