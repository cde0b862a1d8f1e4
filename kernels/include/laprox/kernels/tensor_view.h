// TensorView: a non-owning description of a strided tensor in host or device memory.
//
// laprox never copies the engine's KV cache to compute a keep-plan; it reads the engine's own
// buffers through views. A view carries the element type, the logical shape, element strides
// (not bytes) and the memory space. Views are cheap to copy and never own the data.
#ifndef LAPROX_KERNELS_TENSOR_VIEW_H_
#define LAPROX_KERNELS_TENSOR_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace laprox::kernels {

// Element types accepted for every input tensor. 16-bit types are converted to fp32 on the fly.
enum class DType { kF32, kF16, kBF16 };

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
absl::string_view DTypeName(DType dtype);

// Where the bytes live. Host memory is readable by the CPU backend; device memory only by the
// CUDA backend (the CPU backend answers UNIMPLEMENTED for it).
enum class MemorySpace { kHost, kDevice };

// Shapes and strides. (A std::vector rather than absl::InlinedVector: GCC 12 warns about the
// latter's moved-from inline storage, and a few small allocations per request cost nothing.)
using Dims = std::vector<int64_t>;

class TensorView {
 public:
  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(const void* data, DType dtype, Dims shape, MemorySpace space = MemorySpace::kHost);
  // Strided view; `strides` are in elements, one per dimension, and must be non-negative.
  TensorView(const void* data, DType dtype, Dims shape, Dims strides,
             MemorySpace space = MemorySpace::kHost);

  // A view is empty when it points at nothing (an optional input that was not given).
  bool empty() const { return data_ == nullptr; }
  const void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  MemorySpace space() const { return space_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  const Dims& shape() const { return shape_; }
  const Dims& strides() const { return strides_; }
  int64_t dim(int i) const { return shape_[i]; }
  int64_t stride(int i) const { return strides_[i]; }
  // Number of logical elements (product of the shape); INT64_MAX when it overflows.
  int64_t num_elements() const;
  // One past the largest element offset the view touches (0 for an empty shape), or an
  // OUT_OF_RANGE error when that number does not fit in int64. Callers that own the buffer
  // compare it with the buffer's element count.
  absl::Status ElementExtent(int64_t* extent) const;

  // Reads element at flat element offset `offset` as fp32 (host memory only).
  float LoadAsFloat(int64_t offset) const;

  // "[2, 128, 64] bf16 strides [8192, 64, 1]" — for error messages.
  std::string DebugString() const;

 private:
  const void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Dims shape_;
  Dims strides_;
  MemorySpace space_ = MemorySpace::kHost;
};

// Row-major strides for `shape` (shapes from the wire: a stride that overflows saturates at
// INT64_MAX, so that TensorView::ElementExtent then reports OUT_OF_RANGE).
Dims ContiguousStrides(const Dims& shape);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_TENSOR_VIEW_H_
