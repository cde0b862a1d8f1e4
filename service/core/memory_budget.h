// MemoryBudget: bytes that concurrent work reserves before it allocates, refused past a limit.
//
// laproxd sizes everything a request or a model registration implies before allocating it
// (kernels::Backend::EstimateKeepPlanMemory / EstimatePrepareMemory) and reserves that much
// here; what does not fit is RESOURCE_EXHAUSTED naming the quantity, its value, what others hold
// and the limit, instead of an allocation that aborts the process or wakes the OOM killer.
// Reservations are not queued: a request that does not fit now is refused now (gRPC clients
// may retry RESOURCE_EXHAUSTED).
//
// Thread safety: every method may be called concurrently.
#ifndef LAPROX_SERVICE_CORE_MEMORY_BUDGET_H_
#define LAPROX_SERVICE_CORE_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace laprox::service {

class MemoryBudget {
 public:
  // Held bytes, returned to the budget when destroyed. Move-only; may outlive nothing but the
  // budget.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&& other) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation();

    int64_t bytes() const { return bytes_; }

   private:
    friend class MemoryBudget;
    Reservation(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
    void Release();

    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // `name` for messages ("request memory"), `flag` the option that sets `limit_bytes`
  // ("--max_request_memory"). limit_bytes > 0.
  MemoryBudget(std::string name, std::string flag, int64_t limit_bytes);
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Reserves `bytes` (>= 0) for `what` ("this request's scores and plan"). RESOURCE_EXHAUSTED
  // when bytes exceed the limit alone, or together with what is reserved now.
  absl::StatusOr<Reservation> Reserve(int64_t bytes, absl::string_view what);

  int64_t limit() const { return limit_; }
  int64_t in_use() const { return in_use_.load(std::memory_order_relaxed); }

 private:
  const std::string name_, flag_;
  const int64_t limit_;
  std::atomic<int64_t> in_use_{0};
};

// The memory this process may use: the smallest of its cgroup's memory limit (v2 memory.max or
// v1 memory.limit_in_bytes, when set), RLIMIT_AS, and the host's physical memory.
int64_t ProcessMemoryLimit();

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_MEMORY_BUDGET_H_
