// Resolver: turns a call's tensor references (inline bytes, shared-memory or CUDA IPC regions,
// paged through block tables) into the kernels' views, holding one lease per region it names
// and remembering the memory every input occupies (for the output overlap check). Part of
// Core (service/core/core.cc), in a file of its own.
#ifndef LAPROX_SERVICE_CORE_RESOLVER_H_
#define LAPROX_SERVICE_CORE_RESOLVER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "laprox/kernels/tensor_view.h"
#include "service/core/core.h"
#include "service/core/owner.h"
#include "service/core/region_registry.h"

namespace laprox::service {

class Resolver {
 public:
  struct Input {
    MemoryRange range;
    std::string field;
    uint64_t region_id;
    int64_t byte_offset, byte_count;
  };

  // Leases regions on behalf of `owner`: another owner's region is NOT_FOUND. Paged references
  // name `tables` by index.
  Resolver(RegionRegistry& regions, const Owner& owner,
           const std::vector<kernels::BlockTable>* tables = nullptr)
      : regions_(regions), owner_(owner), tables_(tables) {}

  // The view of `ref`; `field` names it in errors ("layers[0].keys"). INVALID_ARGUMENT for a
  // malformed reference, OUT_OF_RANGE past a region or int64, NOT_FOUND for a region the owner
  // does not hold.
  absl::StatusOr<kernels::TensorView> Resolve(const TensorRef& ref, const std::string& field);

  // A lease on region `id`; `field` names it in errors ("layers[0].keys").
  absl::StatusOr<const MappedRegion*> Lease(uint64_t id, const std::string& field);

  // FAILED_PRECONDITION if the client shrank a region this call read or writes.
  absl::Status CheckIntact() const;

  const std::vector<Input>& inputs() const { return inputs_; }

 private:
  RegionRegistry& regions_;
  const Owner& owner_;
  const std::vector<kernels::BlockTable>* tables_;  // filled after construction, never resized
                                                    // once a view points into it
  std::map<uint64_t, RegionLease> leases_;
  std::vector<std::vector<uint64_t>> copies_;
  std::vector<Input> inputs_;
};

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_CORE_RESOLVER_H_
