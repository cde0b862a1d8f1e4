#include "service/grpc/socket_path.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace laprox::service {
namespace {

std::string ErrnoText(int error) { return std::strerror(error); }

absl::Status Failed(absl::string_view what, const std::string& path, int error) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", ErrnoText(error)));
}

std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

const char* KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  return "not a socket";
}

// Whether a server accepts connections on the socket at `path`: OK(true) if one does,
// OK(false) if the socket refuses them (nobody listens: stale).
absl::StatusOr<bool> Accepts(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return Failed("cannot create a socket to test", path, errno);
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int error = errno;
  close(fd);
  if (rc == 0 || error == EAGAIN) return true;  // EAGAIN: listening, its backlog full
  if (error == ECONNREFUSED) return false;
  return absl::FailedPreconditionError(absl::StrCat("cannot tell whether a server listens on ",
                                                    path, " (connect: ", ErrnoText(error),
                                                    "); laproxd does not replace it"));
}

}  // namespace

absl::StatusOr<SocketClaim> SocketClaim::Acquire(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path \"", path, "\" is ", path.size(),
                                                   " bytes; a Unix socket path takes 1 to ",
                                                   sizeof(sockaddr_un{}.sun_path) - 1));
  }
  const std::string directory = Directory(path);
  struct stat st {};
  if (stat(directory.c_str(), &st) != 0) {
    if (errno != ENOENT) return Failed("cannot stat the socket directory", directory, errno);
    // Only the last component: a missing parent is a configuration error, not ours to create.
    if (mkdir(directory.c_str(), 0750) != 0 && errno != EEXIST) {
      return Failed("cannot create the socket directory", directory, errno);
    }
    if (chmod(directory.c_str(), 0750) != 0) {  // mkdir's mode went through the umask
      return Failed("cannot set the mode of", directory, errno);
    }
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the socket directory ", directory, " is not a directory"));
  }

  const std::string lock_path = path + ".lock";
  // The holder removes the lock file when it exits. A lock taken on a file that was removed
  // (or replaced) between our open and our flock guards nothing: then start again.
  SocketClaim claim(path, -1);  // closes the lock file on every return below
  for (int attempt = 0;; ++attempt) {
    const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return Failed("cannot open the lock file", lock_path, errno);
    claim.lock_fd_ = fd;
    if (fstat(fd, &st) != 0) return Failed("cannot stat", lock_path, errno);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(lock_path, " is not a regular file"));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) return Failed("cannot lock", lock_path, errno);
      char text[32] = {};
      const ssize_t got = pread(fd, text, sizeof(text) - 1, 0);
      int64_t pid = 0;
      const bool known = got > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &pid);
      return absl::FailedPreconditionError(
          absl::StrCat("another laproxd", known ? absl::StrCat(" (pid ", pid, ")") : "", " serves ",
                       path, " (it holds ", lock_path, "); stop it or give another --socket"));
    }
    struct stat now {};
    if (lstat(lock_path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      break;
    }
    close(std::exchange(claim.lock_fd_, -1));
    if (attempt == 16) {
      return absl::FailedPreconditionError(
          absl::StrCat(lock_path, " keeps being removed or replaced while laproxd locks it"));
    }
  }
  claim.lock_path_ = lock_path;
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(claim.lock_fd_, 0) != 0 || pwrite(claim.lock_fd_, pid.data(), pid.size(), 0) < 0) {
    return Failed("cannot write the pid into", lock_path, errno);
  }

  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return claim;
    return Failed("cannot stat", path, errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is ", KindOf(st.st_mode),
        "; laproxd removes only a stale socket there: move it away or give another --socket"));
  }
  absl::StatusOr<bool> live = Accepts(path);
  if (!live.ok()) return live.status();
  if (*live) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a server that is not a laproxd holding ", lock_path, " accepts connections on ", path,
        "; laproxd does not take over a live socket"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Failed("cannot remove the stale socket", path, errno);
  }
  return claim;
}

SocketClaim::SocketClaim(SocketClaim&& other) noexcept
    : path_(std::move(other.path_)),
      lock_path_(std::exchange(other.lock_path_, std::string())),
      lock_fd_(std::exchange(other.lock_fd_, -1)),
      device_(other.device_),
      inode_(std::exchange(other.inode_, 0)) {}

SocketClaim& SocketClaim::operator=(SocketClaim&& other) noexcept {
  // other's destructor releases what this held
  std::swap(path_, other.path_);
  std::swap(lock_path_, other.lock_path_);
  std::swap(lock_fd_, other.lock_fd_);
  std::swap(device_, other.device_);
  std::swap(inode_, other.inode_);
  return *this;
}

SocketClaim::~SocketClaim() {
  RemoveFiles();
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the lock
}

void SocketClaim::RemoveFiles() {
  struct stat st {};
  if (inode_ != 0 && lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
      st.st_dev == device_ && st.st_ino == inode_) {
    unlink(path_.c_str());
  }
  inode_ = 0;
  // Still locked: whoever opened the file meanwhile finds it gone after its flock (Acquire).
  if (lock_fd_ >= 0 && !lock_path_.empty()) unlink(lock_path_.c_str());
  lock_path_.clear();
}

void SocketClaim::Bound() {
  struct stat st {};
  if (lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    device_ = st.st_dev;
    inode_ = st.st_ino;
  }
}

ScopedUmask::ScopedUmask(mode_t mask) : previous_(umask(mask)) {}
ScopedUmask::~ScopedUmask() { umask(previous_); }

}  // namespace laprox::service
