#include "service/core/fault_guard.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace laprox::service {
namespace {

// One guarded mapping. The handler reads these without a lock: a slot is published by storing
// `end` and then `begin` (release), and retired by storing begin = 0 first.
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[GuardedMapping::kMaxGuarded];
std::atomic<int> g_slots_used{0};  // slots [0, used) have been handed out at least once
std::atomic<int64_t> g_faults{0};
struct sigaction g_previous;  // written once, before the handler can run

absl::Mutex g_free_mu(absl::kConstInit);
int g_free[GuardedMapping::kMaxGuarded] ABSL_GUARDED_BY(g_free_mu);  // retired slots
int g_free_count ABSL_GUARDED_BY(g_free_mu) = 0;

// Hands the fault on as if the guard were not there.
void Chain(int signo, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signo, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signo);
    return;
  }
  // Default action: returning re-executes the faulting access, which now kills the process
  // with SIGBUS (and a core dump) exactly as it would have without the guard.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(signo, &fallback, nullptr);
}

// Only async-signal-safe work: atomics and mmap(2).
void OnSigbus(int signo, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const int used = g_slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    Slot& slot = g_slots[i];
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin) continue;
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    if (address >= end) continue;
    // Zero pages over the whole mapping: every later access, on any thread, reads zeros.
    // NOLINTNEXTLINE(performance-no-int-to-ptr): addresses are kept as integers to compare
    void* replaced = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (replaced == MAP_FAILED) break;
    slot.faulted.store(true, std::memory_order_release);
    g_faults.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Chain(signo, info, context);
}

absl::Status InstallHandler() {
  static absl::once_flag once;
  static int error = 0;
  absl::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous) != 0) error = errno;
  });
  if (error != 0) {
    return absl::InternalError(
        absl::StrCat("cannot install the SIGBUS handler: ", std::strerror(error)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GuardedMapping>> GuardedMapping::Create(void* begin, size_t size) {
  if (absl::Status s = InstallHandler(); !s.ok()) return s;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t end = first + (size + page - 1) / page * page;
  int slot = -1;
  {
    absl::MutexLock lock(&g_free_mu);
    if (g_free_count > 0) {
      slot = g_free[--g_free_count];
    } else if (g_slots_used.load() < kMaxGuarded) {
      slot = g_slots_used.load();
    } else {
      return absl::ResourceExhaustedError(
          absl::StrCat("already ", kMaxGuarded, " shared-memory mappings are guarded"));
    }
    Slot& s = g_slots[slot];
    s.faulted.store(false, std::memory_order_relaxed);
    s.end.store(end, std::memory_order_release);
    s.begin.store(first, std::memory_order_release);
    if (slot == g_slots_used.load()) g_slots_used.store(slot + 1, std::memory_order_release);
  }
  return std::unique_ptr<GuardedMapping>(new GuardedMapping(slot));
}

GuardedMapping::~GuardedMapping() {
  Slot& s = g_slots[slot_];
  s.begin.store(0, std::memory_order_release);
  s.end.store(0, std::memory_order_release);
  absl::MutexLock lock(&g_free_mu);
  g_free[g_free_count++] = slot_;
}

bool GuardedMapping::faulted() const {
  return g_slots[slot_].faulted.load(std::memory_order_acquire);
}

void GuardedMapping::MarkShrunk() { g_slots[slot_].faulted.store(true, std::memory_order_release); }

int64_t GuardedFaultCount() { return g_faults.load(std::memory_order_relaxed); }

}  // namespace laprox::service
