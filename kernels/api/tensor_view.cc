#include "laprox/kernels/tensor_view.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/half.h"

namespace laprox::kernels {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

Dims ContiguousStrides(const Dims& shape) {
  Dims strides(shape.size());
  int64_t stride = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    // Saturates instead of overflowing (shapes come from the wire): a stride of INT64_MAX is
    // only ever multiplied by shape - 1 >= 1 in ElementExtent, which then reports OUT_OF_RANGE.
    if (shape[i] < 0 || __builtin_mul_overflow(stride, shape[i], &stride)) {
      stride = std::numeric_limits<int64_t>::max();
    }
  }
  return strides;
}

TensorView::TensorView(const void* data, DType dtype, Dims shape, MemorySpace space)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), space_(space) {
  strides_ = ContiguousStrides(shape_);
}

TensorView::TensorView(const void* data, DType dtype, Dims shape, Dims strides, MemorySpace space)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      space_(space) {}

TensorView TensorView::Paged(const void* data, DType dtype, Dims shape, PagedLayout layout,
                             MemorySpace space) {
  TensorView view(data, dtype, std::move(shape),
                  Dims{layout.head_stride, layout.slot_stride, layout.dim_stride}, space);
  view.layout_ = layout;
  return view;
}

int64_t TensorView::RowOffset(int64_t head, int64_t row) const {
  if (!paged()) return head * strides_[0] + row * strides_[1];
  const int64_t block_size = layout_.table->block_size();
  return layout_.table->ids()[row / block_size] * layout_.block_stride +
         (row % block_size) * layout_.slot_stride + head * layout_.head_stride;
}

int64_t TensorView::num_elements() const {
  int64_t count = 1;
  for (int64_t d : shape_) {
    if (d < 0 || __builtin_mul_overflow(count, d, &count)) {
      return std::numeric_limits<int64_t>::max();
    }
  }
  return count;
}

absl::Status TensorView::ElementExtent(int64_t* extent) const {
  if (paged()) return PagedExtent(extent);
  if (strides_.size() != shape_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor has ", shape_.size(), " dimensions but ",
                                                   strides_.size(), " strides"));
  }
  int64_t last = 0;  // largest element offset
  for (size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] < 0 || strides_[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative size or stride in ", DebugString()));
    }
    if (shape_[i] == 0) {
      *extent = 0;
      return absl::OkStatus();
    }
    int64_t term;
    if (__builtin_mul_overflow(shape_[i] - 1, strides_[i], &term) ||
        __builtin_add_overflow(last, term, &last)) {
      return absl::OutOfRangeError(absl::StrCat("extent of ", DebugString(), " overflows int64"));
    }
  }
  if (__builtin_add_overflow(last, int64_t{1}, extent)) {
    return absl::OutOfRangeError(absl::StrCat("extent of ", DebugString(), " overflows int64"));
  }
  return absl::OkStatus();
}

absl::Status TensorView::PagedExtent(int64_t* extent) const {
  const BlockTable& table = *layout_.table;
  if (shape_.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a paged tensor has rank 3 [heads, rows, cols], not ", DebugString()));
  }
  for (int64_t d : shape_) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative size in ", DebugString()));
  }
  for (int64_t stride :
       {layout_.block_stride, layout_.slot_stride, layout_.head_stride, layout_.dim_stride}) {
    if (stride < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative stride in ", DebugString()));
    }
  }
  const int64_t rows = shape_[1], block_size = table.block_size();
  const int64_t blocks = BlockTable::BlocksFor(rows, block_size);
  if (static_cast<int64_t>(table.ids().size()) != blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the block table has ", table.ids().size(), " ids, but ", rows, " rows in blocks of ",
        block_size, " need ceil(", rows, " / ", block_size, ") = ", blocks));
  }
  if (shape_[0] == 0 || rows == 0 || shape_[2] == 0) {
    *extent = 0;
    return absl::OkStatus();
  }
  // One block's span covers every slot (engines allocate whole blocks), so the extent is the
  // end of the largest id's block.
  int64_t last = 0, term;
  for (auto [count, stride] :
       {std::pair{block_size, layout_.slot_stride}, std::pair{shape_[0], layout_.head_stride},
        std::pair{shape_[2], layout_.dim_stride},
        std::pair{int64_t{table.max_id()} + 1, layout_.block_stride}}) {
    if (__builtin_mul_overflow(count - 1, stride, &term) ||
        __builtin_add_overflow(last, term, &last)) {
      return absl::OutOfRangeError(absl::StrCat("extent of ", DebugString(), " (block id ",
                                                table.max_id(), ") overflows int64"));
    }
  }
  if (__builtin_add_overflow(last, int64_t{1}, extent)) {
    return absl::OutOfRangeError(absl::StrCat("extent of ", DebugString(), " overflows int64"));
  }
  return absl::OkStatus();
}

float TensorView::LoadAsFloat(int64_t offset) const {
  switch (dtype_) {
    case DType::kF32: {
      float v;
      std::memcpy(&v, static_cast<const char*>(data_) + offset * 4, 4);
      return v;
    }
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(data_)[offset]);
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data_)[offset]);
  }
  return 0.f;
}

std::string TensorView::DebugString() const {
  if (paged()) {
    return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_), " paged (",
                        layout_.table->ids().size(), " blocks of ", layout_.table->block_size(),
                        "; strides block ", layout_.block_stride, ", slot ", layout_.slot_stride,
                        ", head ", layout_.head_stride, ", dim ", layout_.dim_stride, ")",
                        space_ == MemorySpace::kDevice ? " device" : "");
  }
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_), " strides [",
                      absl::StrJoin(strides_, ", "), "]",
                      space_ == MemorySpace::kDevice ? " device" : "");
}

absl::StatusOr<BlockTable> BlockTable::Create(std::vector<int32_t> ids, int64_t block_size,
                                              bool allow_repeated_ids) {
  if (block_size < 1 || block_size > kMaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", block_size, " is outside [1, ", kMaxBlockSize, "]"));
  }
  BlockTable table;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("block id [", i, "] = ", ids[i], " is negative"));
    }
    table.max_id_ = std::max(table.max_id_, ids[i]);
  }
  if (!allow_repeated_ids && ids.size() > 1) {
    // (id, index) pairs sorted: a repeated id shows up as two neighbours.
    std::vector<std::pair<int32_t, size_t>> sorted(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) sorted[i] = {ids[i], i};
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i].first == sorted[i - 1].first) {
        return absl::InvalidArgumentError(
            absl::StrCat("block ids [", sorted[i - 1].second, "] and [", sorted[i].second,
                         "] are both physical block ", sorted[i].first,
                         "; one sequence may repeat a block only with allow_repeated_ids"));
      }
    }
  }
  table.ids_ = std::move(ids);
  table.block_size_ = block_size;
  table.allow_repeated_ids_ = allow_repeated_ids;
  return table;
}

}  // namespace laprox::kernels
