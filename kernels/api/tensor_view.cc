#include "laprox/kernels/tensor_view.h"

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
  return absl::StrCat("[", absl::StrJoin(shape_, ", "), "] ", DTypeName(dtype_), " strides [",
                      absl::StrJoin(strides_, ", "), "]",
                      space_ == MemorySpace::kDevice ? " device" : "");
}

}  // namespace laprox::kernels
