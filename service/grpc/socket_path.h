// Claiming laproxd's Unix socket path without taking over another server's socket or deleting
// anything that is not a stale socket. (Where it goes by default: laprox/v1/endpoint.h.)
//
//   std::string path = laprox::v1::DefaultSocketPath();
//   LAPROX_ASSIGN_OR_RETURN(SocketClaim claim, SocketClaim::Acquire(path));
//   {
//     ScopedUmask umask(0777 & ~mode);   // the socket is born with `mode`
//     ... bind (grpc::ServerBuilder::BuildAndStart) ...
//   }
//   // claim's lock is held until it is destroyed; a second laproxd on `path` fails Acquire.
#ifndef LAPROX_SERVICE_GRPC_SOCKET_PATH_H_
#define LAPROX_SERVICE_GRPC_SOCKET_PATH_H_

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace laprox::service {

// An exclusive claim on a socket path: the lock file PATH.lock (flock, held while the object
// lives; removed with the socket when the claim ends) and, when Acquire returns, nothing at
// PATH. Move-only.
class SocketClaim {
 public:
  // Creates PATH's directory with mode 0750 when it is missing (its parent must exist), takes
  // the lock, and clears PATH when it holds a stale socket (one that refuses connections).
  // FAILED_PRECONDITION, naming the path, when another laproxd holds the lock, when a server
  // accepts connections on PATH, or when PATH is anything but a socket (a regular file, a
  // directory, a symlink: left alone); other errors carry the errno text.
  static absl::StatusOr<SocketClaim> Acquire(const std::string& path);

  SocketClaim(SocketClaim&& other) noexcept;
  SocketClaim& operator=(SocketClaim&& other) noexcept;
  SocketClaim(const SocketClaim&) = delete;
  SocketClaim& operator=(const SocketClaim&) = delete;
  // RemoveFiles(), then releases the lock.
  ~SocketClaim();
  // Removes PATH if it is still the socket created under this claim, and the lock file (still
  // locked, so that a laproxd starting meanwhile sees it go and takes a new one). Idempotent;
  // not thread-safe against another call on the same claim.
  void RemoveFiles();

  const std::string& path() const { return path_; }
  // Remembers the socket now at PATH (after bind) so that the destructor removes only it.
  void Bound();

 private:
  SocketClaim(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}

  std::string path_;
  std::string lock_path_;  // set once the lock is held: removed by RemoveFiles
  int lock_fd_ = -1;
  dev_t device_ = 0;
  ino_t inode_ = 0;
};

// Sets the process umask for its lifetime (bind creates the socket with 0777 & ~umask).
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask);
  ~ScopedUmask();
  ScopedUmask(const ScopedUmask&) = delete;
  ScopedUmask& operator=(const ScopedUmask&) = delete;

 private:
  mode_t previous_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_SOCKET_PATH_H_
