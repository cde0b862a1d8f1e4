#include "service/core/memory_budget.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

#include <sys/resource.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace laprox::service {
namespace {

constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

// The first line of `path` as a byte count; kUnlimited when missing, "max" or unparsable.
int64_t ReadLimit(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return kUnlimited;
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value) || value <= 0) {
    return kUnlimited;
  }
  return value;
}

// The cgroup memory limit of this process, from /proc/self/cgroup.
int64_t CgroupLimit() {
  std::ifstream in("/proc/self/cgroup");
  int64_t limit = kUnlimited;
  for (std::string line; std::getline(in, line);) {
    // "0::/kubepods/pod.../container" (v2) or "4:memory:/docker/..." (v1)
    std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    std::string path = parts[2];
    if (parts[1].empty()) {
      // v2: the limit may be set on the cgroup or any ancestor; take the smallest.
      for (;;) {
        limit = std::min(limit, ReadLimit(absl::StrCat("/sys/fs/cgroup", path, "/memory.max")));
        if (path.empty() || path == "/") break;
        path = path.substr(0, path.rfind('/'));
      }
    } else if (absl::StrContains(parts[1], "memory")) {
      // v1 reports "no limit" as a huge page-rounded number; the host memory bounds it below.
      limit = std::min(
          limit, ReadLimit(absl::StrCat("/sys/fs/cgroup/memory", path, "/memory.limit_in_bytes")));
      limit = std::min(limit, ReadLimit("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
    }
  }
  return limit;
}

}  // namespace

MemoryBudget::Reservation::Reservation(Reservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryBudget::Reservation& MemoryBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryBudget::Reservation::~Reservation() { Release(); }

void MemoryBudget::Reservation::Release() {
  if (budget_ != nullptr) budget_->in_use_.fetch_sub(bytes_, std::memory_order_relaxed);
  budget_ = nullptr;
  bytes_ = 0;
}

MemoryBudget::MemoryBudget(std::string name, std::string flag, int64_t limit_bytes)
    : name_(std::move(name)), flag_(std::move(flag)), limit_(limit_bytes) {}

absl::StatusOr<MemoryBudget::Reservation> MemoryBudget::Reserve(int64_t bytes,
                                                                absl::string_view what) {
  if (bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(name_, ": ", what, " needs ", bytes,
                                                     " bytes, more than the limit of ", limit_,
                                                     " bytes (", flag_, ")"));
  }
  int64_t held = in_use_.load(std::memory_order_relaxed);
  do {
    if (held > limit_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          name_, ": ", what, " needs ", bytes, " bytes, but ", held, " of the limit of ", limit_,
          " bytes (", flag_, ") are in use; retry later"));
    }
  } while (!in_use_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
  return Reservation(this, bytes);
}

int64_t ProcessMemoryLimit() {
  int64_t limit = CgroupLimit();
  struct rlimit rl {};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    limit = std::min<int64_t>(limit, static_cast<int64_t>(rl.rlim_cur));
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) limit = std::min<int64_t>(limit, int64_t{pages} * page);
  return limit;
}

}  // namespace laprox::service
