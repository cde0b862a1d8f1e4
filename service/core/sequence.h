// One keep-plan call's sequences: each checked and resolved into the backend's request
// (PrepareSequence), and the output areas a destination region receives, checked against each
// other and the call's inputs, then written (WriteOutputs). Part of Core (service/core/core.cc),
// in a file of its own.
#ifndef LAPROX_SERVICE_CORE_SEQUENCE_H_
#define LAPROX_SERVICE_CORE_SEQUENCE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/tensor_view.h"
#include "service/core/core.h"
#include "service/core/memory_budget.h"
#include "service/core/region_registry.h"
#include "service/core/resolver.h"

namespace laprox::service {

// Whether the call should stop: CANCELLED / DEADLINE_EXCEEDED saying what was not done.
absl::Status CheckCall(const CallContext& context, absl::string_view not_done);

// One output area of a destination region.
struct Area {
  std::string field;  // "outputs.destination.positions", prefixed by its sequence in a batch
  const MappedRegion* region;
  int64_t offset;
  const void* data;
  int64_t bytes;
  int64_t alignment;
  std::byte* target = nullptr;  // set by the checks
  MemoryRange range;            // set by the checks
};

// One sequence of a keep-plan call, resolved: its tables, region leases, destination and the
// backend's request.
struct Sequence {
  std::string prefix;  // "sequences[i]." in a batch, else empty
  std::vector<kernels::BlockTable> tables;
  std::unique_ptr<Resolver> resolver;      // reads `tables`
  MemoryBudget::Reservation table_memory;  // block tables copied from regions
  const MappedRegion* destination = nullptr;
  kernels::KeepPlanRequest request;
};

// FAILED_PRECONDITION, naming the sequence, when a client shrank a region a sequence read or
// writes (Resolver::CheckIntact).
absl::Status CheckIntact(const std::vector<Sequence>& sequences);

// Checks every area against its region, every other area and every input of the call, then
// (unless the call stopped) writes them all.
absl::Status WriteOutputs(kernels::Backend& backend, std::vector<Area>& areas,
                          const std::vector<Sequence>& sequences, const CallContext& context);

// Adds the area of `values` to `areas` when the sequence's destination names an offset for
// output `name` ("positions", ...).
template <typename T>
void AddArea(std::vector<Area>& areas, const Sequence& sequence, const char* name,
             const std::optional<int64_t>& offset, const std::vector<T>& values) {
  if (!offset) return;
  areas.push_back({absl::StrCat(sequence.prefix, "outputs.destination.", name),
                   sequence.destination, *offset, values.data(),
                   static_cast<int64_t>(values.size() * sizeof(T)),
                   static_cast<int64_t>(alignof(T))});
}

// The same status with `prefix` ("sequences[2].") before its message.
absl::Status Prefixed(const absl::Status& status, absl::string_view prefix);

// Checks one sequence's call before anything is read: n, its block tables (copied), its region
// leases and destination, and resolves every reference into the backend's request.
absl::Status PrepareSequence(const KeepPlanCall& call, const CallContext& context,
                             int64_t max_tokens, RegionRegistry& regions, MemoryBudget& memory,
                             Sequence& sequence);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_SEQUENCE_H_
