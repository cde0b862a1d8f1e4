// What the tests of service/core share: a POSIX shared-memory object made for one test, unique
// object names, and a status matcher.
#ifndef LAPROX_TESTS_SERVICE_SHM_OBJECT_H_
#define LAPROX_TESTS_SERVICE_SHM_OBJECT_H_

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace laprox::service::core_testing {

// A shared-memory object created for one test and unlinked after it.
class ShmObject {
 public:
  ShmObject(const std::string& name, size_t size) : name_(name) {
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    auto* bytes = static_cast<unsigned char*>(p);
    for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i % 251);
    munmap(p, size);
    close(fd);
  }
  ~ShmObject() { shm_unlink(("/" + name_).c_str()); }
  const std::string& name() const { return name_; }
  // What a client may do at any time: shrink (or grow) the object under the server.
  void Truncate(off_t size) {
    const int fd = shm_open(("/" + name_).c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, size), 0);
    close(fd);
  }

 private:
  std::string name_;
};

// A shared-memory object name no other test or process uses.
inline std::string UniqueName(absl::string_view tag) {
  static std::atomic<int> counter{0};
  return absl::StrCat("laprox-test-", getpid(), "-", tag, "-", counter++);
}

// A status with this code whose message contains `substring`.
MATCHER_P2(IsStatus, code, substring, "") {
  *result_listener << "status " << arg;
  return arg.code() == code && absl::StrContains(arg.message(), substring);
}

}  // namespace laprox::service::core_testing

#endif  // LAPROX_TESTS_SERVICE_SHM_OBJECT_H_
