#include "service/core/sequence.h"

#include <cstring>
#include <utility>

#include "absl/time/clock.h"
#include "laprox/kernels/layer_tensors.h"

namespace laprox::service {
namespace {

using kernels::TensorView;

std::string AreaName(const Area& area) {
  return absl::StrCat(area.field, " (region ", area.region->info().id, ", bytes [", area.offset,
                      ", +", area.bytes, "))");
}

}  // namespace

absl::Status CheckCall(const CallContext& context, absl::string_view not_done) {
  if (context.cancelled && context.cancelled()) {
    return absl::CancelledError(absl::StrCat("the call was cancelled; ", not_done));
  }
  if (absl::Now() > context.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed; ", not_done));
  }
  return absl::OkStatus();
}

absl::Status CheckIntact(const std::vector<Sequence>& sequences) {
  for (const Sequence& sequence : sequences) {
    if (absl::Status s = sequence.resolver->CheckIntact(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(sequence.prefix, s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteOutputs(kernels::Backend& backend, std::vector<Area>& areas,
                          const std::vector<Sequence>& sequences, const CallContext& context) {
  for (Area& area : areas) {
    auto slice = area.region->Slice(area.offset, area.bytes, area.field);
    if (!slice.ok()) return slice.status();
    if (area.offset % area.alignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          area.field, " offset ", area.offset, " is not aligned to ", area.alignment, " bytes"));
    }
    area.target = *slice;
    area.range = area.region->Range(area.offset, area.bytes);
  }
  for (size_t a = 0; a < areas.size(); ++a) {
    for (size_t b = a + 1; b < areas.size(); ++b) {
      if (areas[a].range.Overlaps(areas[b].range)) {
        return absl::InvalidArgumentError(
            absl::StrCat(AreaName(areas[a]), " overlaps ", AreaName(areas[b])));
      }
    }
    for (const Sequence& sequence : sequences) {
      for (const Resolver::Input& input : sequence.resolver->inputs()) {
        if (areas[a].range.Overlaps(input.range)) {
          return absl::InvalidArgumentError(
              absl::StrCat(AreaName(areas[a]), " overlaps the input ", sequence.prefix, input.field,
                           " (region ", input.region_id, ", bytes [", input.byte_offset, ", +",
                           input.byte_count, ")): outputs never overwrite inputs"));
        }
      }
    }
  }
  if (absl::Status s = CheckCall(context, "nothing was written"); !s.ok()) return s;
  if (absl::Status s = CheckIntact(sequences); !s.ok()) return s;
  for (const Area& area : areas) {
    absl::Status s = backend.CopyToRegion(area.target, area.region->space(), area.data, area.bytes);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(area.field, ": ", s.message()));
  }
  // A shrink during the copies leaves the areas with any bytes: the call must fail.
  return CheckIntact(sequences);
}

absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  if (status.ok() || prefix.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

absl::Status PrepareSequence(const KeepPlanCall& call, const CallContext& context,
                             int64_t max_tokens, RegionRegistry& regions, MemoryBudget& memory,
                             Sequence& sequence) {
  if (call.n > max_tokens) {
    return absl::OutOfRangeError(absl::StrCat("n = ", call.n, " exceeds this server's limit of ",
                                              max_tokens, " tokens (max_tokens)"));
  }
  if (absl::Status s = CheckCall(context, "nothing was computed"); !s.ok()) return s;
  if (call.cache) {
    // An empty cache would leave the backend a prefill (no layer_entries): refuse it here.
    if (call.cache->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache.layers is empty; a decode re-plan gives one per model layer (",
                       call.layers.size(), " layers given)"));
    }
    for (const CacheLayer& layer : *call.cache) {
      sequence.request.layer_entries.push_back(layer.entries);
    }
  }
  // Each table is checked once and copied: the views read laproxd's copy, and the request's
  // bytes stay the client's.
  const size_t max_tables = 2 * call.layers.size();
  if (call.block_tables.size() > max_tables) {
    return absl::InvalidArgumentError(absl::StrCat("block_tables has ", call.block_tables.size(),
                                                   " tables; at most 2 * ", call.layers.size(),
                                                   " layers = ", max_tables));
  }
  std::vector<kernels::BlockTable>& tables = sequence.tables;
  tables.reserve(call.block_tables.size());  // views point into it: never reallocated
  sequence.resolver = std::make_unique<Resolver>(regions, context.owner, &tables);
  Resolver& resolver = *sequence.resolver;
  // The copies of region-held ids (and the table's own sorted copy) are reserved first.
  int64_t region_ids = 0;
  for (const BlockTableSpec& spec : call.block_tables) {
    if (spec.in_region && spec.in_region->count > 0 && spec.in_region->count <= call.n) {
      region_ids += spec.in_region->count;
    }
  }
  if (region_ids > 0) {
    auto held = memory.Reserve(region_ids * 3 * int64_t{sizeof(int32_t)},
                               "the copies of block tables held in regions");
    if (!held.ok()) return held.status();
    sequence.table_memory = *std::move(held);
  }
  for (size_t t = 0; t < call.block_tables.size(); ++t) {
    const BlockTableSpec& spec = call.block_tables[t];
    const int64_t given =
        spec.in_region ? spec.in_region->count : static_cast<int64_t>(spec.ids.size());
    // Every table is this sequence's: its length follows from n, checked before the ids are
    // copied and sorted so that a bloated table costs nothing. A decode re-plan's layers hold
    // n_l <= n entries each: its tables have at most as many ids as n needs (each tensor read
    // through one then needs exactly its own count, TensorView::Paged).
    if (spec.block_size >= 1 && call.n >= 1) {
      const int64_t blocks = kernels::BlockTable::BlocksFor(call.n, spec.block_size);
      if (call.cache && (given < 1 || given > blocks)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block_tables[", t, "] has ", given, " ids; a decode re-plan's tables have 1 to ceil(n",
            " / ", spec.block_size, ") = ", blocks, " (n = ", call.n, ")"));
      }
      if (!call.cache && given != blocks) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block_tables[", t, "] has ", given, " ids, but n = ", call.n, " tokens in blocks of ",
            spec.block_size, " need ceil(", call.n, " / ", spec.block_size, ") = ", blocks));
      }
    }
    std::vector<int32_t> ids(spec.ids.begin(), spec.ids.end());
    if (spec.in_region && (given < 1 || given > call.n)) {
      // Whatever the block size, a table of n tokens has 1 to n ids: nothing else is read (nor
      // sized: a count from the wire is bounded here before it is multiplied).
      return absl::InvalidArgumentError(absl::StrCat("block_tables[", t, "].ids_count = ", given,
                                                     " is outside [1, n = ", call.n, "]"));
    }
    if (spec.in_region && spec.block_size >= 1) {
      const std::string field = absl::StrCat("block_tables[", t, "].ids_region");
      auto region = resolver.Lease(spec.in_region->region_id, field);
      if (!region.ok()) return region.status();
      if ((*region)->space() != kernels::MemorySpace::kHost) {
        return absl::UnimplementedError(absl::StrCat(
            field, ": region ", spec.in_region->region_id,
            " is device memory; block table ids must be in host memory (a shm region)"));
      }
      auto bytes =
          (*region)->Slice(spec.in_region->byte_offset, given * int64_t{sizeof(int32_t)}, field);
      if (!bytes.ok()) return bytes.status();
      if (reinterpret_cast<uintptr_t>(*bytes) % alignof(int32_t) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".byte_offset = ", spec.in_region->byte_offset,
                         " is not aligned to the 4-byte ids"));
      }
      // A copy: the client may rewrite its table during the call without effect on it.
      ids.resize(static_cast<size_t>(given));
      std::memcpy(ids.data(), *bytes, ids.size() * sizeof(int32_t));
      if ((*region)->shrunk()) return (*region)->ShrunkError();
    }
    auto table =
        kernels::BlockTable::Create(std::move(ids), spec.block_size, spec.allow_repeated_ids);
    if (!table.ok()) {
      return absl::Status(table.status().code(),
                          absl::StrCat("block_tables[", t, "]: ", table.status().message()));
    }
    tables.push_back(*std::move(table));
  }
  if (call.destination) {
    auto region = resolver.Lease(call.destination->region_id, "outputs.destination");
    if (!region.ok()) return region.status();
    if (!(*region)->info().writable) {
      return absl::FailedPreconditionError(
          absl::StrCat("outputs.destination: region ", call.destination->region_id,
                       " was registered read-only; register it writable to receive outputs"));
    }
    sequence.destination = *region;
  }
  kernels::KeepPlanRequest& request = sequence.request;
  request.n = call.n;
  request.policy = call.policy;
  request.outputs = call.outputs;
  for (size_t l = 0; l < call.layers.size(); ++l) {
    const LayerRefs& refs = call.layers[l];
    const std::string prefix = absl::StrCat("layers[", l, "].");
    kernels::LayerInputs& in = request.layers.emplace_back();
    absl::Status resolved = kernels::ForEachLayerTensor(
        [&](kernels::LayerTensor tensor, const TensorRef& ref, TensorView& view) {
          auto resolved_view = resolver.Resolve(ref, prefix + tensor.name);
          if (!resolved_view.ok()) return resolved_view.status();
          view = *resolved_view;
          return absl::OkStatus();
        },
        refs, in);
    if (!resolved.ok()) return resolved;
  }
  if (sequence.destination != nullptr) {
    // Outputs written into the region are computed even if the inline flags did not ask.
    request.outputs.positions |= call.destination->positions_offset.has_value();
    request.outputs.bitmask |= call.destination->bitmask_offset.has_value();
    request.outputs.scores |= call.destination->scores_offset.has_value();
  }
  return absl::OkStatus();
}

}  // namespace laprox::service
