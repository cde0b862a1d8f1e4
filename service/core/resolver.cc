#include "service/core/resolver.h"

#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "laprox/kernels/layer_tensors.h"

namespace laprox::service {
namespace {

using kernels::DTypeSize;
using kernels::TensorView;

int64_t ElementCount(const kernels::Dims& shape) {
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(count, d, &count)) return -1;
  }
  return count;
}

}  // namespace

absl::StatusOr<kernels::TensorView> Resolver::Resolve(const TensorRef& ref,
                                                      const std::string& field) {
  if (ref.source == TensorRef::Source::kAbsent) return TensorView();
  kernels::Dims strides = ref.strides;
  if (strides.empty()) strides = kernels::ContiguousStrides(ref.shape);
  if (strides.size() != ref.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", ref.shape.size(),
                                                   " dimensions but ", strides.size(), " strides"));
  }
  std::optional<kernels::PagedLayout> layout;
  if (ref.paged) {
    const size_t tables = tables_ == nullptr ? 0 : tables_->size();
    if (ref.paged->block_table >= tables) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".paged.block_table = ", ref.paged->block_table,
                       " but the request has ", tables, " block tables"));
    }
    layout =
        kernels::PagedLayout{&(*tables_)[ref.paged->block_table], ref.paged->block_stride,
                             ref.paged->slot_stride, ref.paged->head_stride, ref.paged->dim_stride};
  }
  // A view over nothing yet, only to compute the extent with the kernels' overflow checks.
  const TensorView shape_only = layout ? TensorView::Paged(nullptr, ref.dtype, ref.shape, *layout)
                                       : TensorView(nullptr, ref.dtype, ref.shape, strides);
  int64_t extent = 0;
  if (absl::Status s = shape_only.ElementExtent(&extent); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  }
  const int64_t element = static_cast<int64_t>(DTypeSize(ref.dtype));
  int64_t bytes;
  if (__builtin_mul_overflow(extent, element, &bytes)) {
    return absl::OutOfRangeError(
        absl::StrCat(field, ": extent of ", extent, " elements overflows int64 bytes"));
  }
  const void* data = nullptr;
  kernels::MemorySpace space = kernels::MemorySpace::kHost;
  if (ref.source == TensorRef::Source::kInline) {
    // Inline bytes must carry every element: zero or overlapping strides would let a few
    // bytes stand for a tensor of any size, and the cost of a request must follow its size.
    const int64_t elements = ElementCount(ref.shape);
    if (elements < 0 || elements > extent) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": an inline tensor must carry every element, but ",
                       shape_only.DebugString(), " repeats elements (", extent, " distinct of ",
                       elements < 0 ? "more than 2^63" : absl::StrCat(elements),
                       "); zero or overlapping strides need a region"));
    }
    if (static_cast<int64_t>(ref.inline_bytes.size()) != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".inline_bytes has ", ref.inline_bytes.size(), " bytes, expected ",
                       bytes, " (", extent, " elements of ", element, " bytes)"));
    }
    data = ref.inline_bytes.data();
    if (reinterpret_cast<uintptr_t>(data) % element != 0) {
      // Protobuf does not promise aligned bytes fields: copy into aligned storage.
      auto& copy = copies_.emplace_back((bytes + 7) / 8);
      std::memcpy(copy.data(), data, bytes);
      data = copy.data();
    }
  } else {
    auto lease = Lease(ref.region_id, field);
    if (!lease.ok()) return lease.status();
    auto slice = (*lease)->Slice(ref.byte_offset, bytes, field);
    if (!slice.ok()) return slice.status();
    if (reinterpret_cast<uintptr_t>(*slice) % element != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".region.byte_offset = ", ref.byte_offset, " is not aligned to the ",
                       element, "-byte ", kernels::DTypeName(ref.dtype), " elements"));
    }
    inputs_.push_back(
        {(*lease)->Range(ref.byte_offset, bytes), field, ref.region_id, ref.byte_offset, bytes});
    data = *slice;
    space = (*lease)->space();  // cuda_ipc regions are read in place on the device
  }
  if (layout) return TensorView::Paged(data, ref.dtype, ref.shape, *layout, space);
  return TensorView(data, ref.dtype, ref.shape, strides, space);
}

absl::StatusOr<const MappedRegion*> Resolver::Lease(uint64_t id, const std::string& field) {
  auto it = leases_.find(id);
  if (it == leases_.end()) {
    auto lease = regions_.Acquire(id, owner_);
    if (!lease.ok()) {
      return absl::Status(lease.status().code(),
                          absl::StrCat(field, ": ", lease.status().message()));
    }
    it = leases_.emplace(id, std::move(lease).value()).first;
  }
  return &it->second.region();
}

absl::Status Resolver::CheckIntact() const {
  for (const auto& [id, lease] : leases_) {
    if (lease.region().shrunk()) return lease.region().ShrunkError();
  }
  return absl::OkStatus();
}

}  // namespace laprox::service
