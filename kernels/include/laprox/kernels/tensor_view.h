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
#include "absl/status/statusor.h"
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

class BlockTable;

// How a paged tensor [heads, rows, cols] lies in a pool of fixed-size blocks (vLLM's paged KV
// cache, SGLang's token pool with one token per block, TensorRT-LLM's blocks): row r of head h is
// in physical block table->id(r / block_size), slot r % block_size, and element (h, r, c) is at
//   id * block_stride + (r % block_size) * slot_stride + h * head_stride + c * dim_stride
// elements from the view's data(), which points at element 0 of physical block 0. Every stride
// is in elements and >= 0, so K and V interleaved or not, NHD or HND, are each one description.
struct PagedLayout {
  const BlockTable* table = nullptr;  // not owned; must outlive the view
  int64_t block_stride = 0, slot_stride = 0, head_stride = 0, dim_stride = 0;
};

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
  // Paged view of rank 3 [heads, rows, cols]; strides() are then the strides inside one block
  // {head_stride, slot_stride, dim_stride}, which only paged-aware readers may use.
  static TensorView Paged(const void* data, DType dtype, Dims shape, PagedLayout layout,
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
  bool paged() const { return layout_.table != nullptr; }
  const PagedLayout& layout() const { return layout_; }
  // Element offset of row `row` of head `head`, column 0 (rank 3; paged or not).
  int64_t RowOffset(int64_t head, int64_t row) const;
  // Number of logical elements (product of the shape); INT64_MAX when it overflows.
  int64_t num_elements() const;
  // One past the largest element offset the view touches (0 for an empty shape), or an
  // OUT_OF_RANGE error when that number does not fit in int64. Callers that own the buffer
  // compare it with the buffer's element count. A paged view is checked here too: rank 3,
  // strides >= 0 and a table of exactly BlocksFor(rows, block_size) ids; its extent covers the
  // largest id's whole block. Blocks that overlap each other are not refused (reading them is
  // safe; the plan is then the engine's own garbage).
  absl::Status ElementExtent(int64_t* extent) const;

  // Reads element at flat element offset `offset` as fp32 (host memory only).
  float LoadAsFloat(int64_t offset) const;

  // "[2, 128, 64] bf16 strides [8192, 64, 1]" — for error messages.
  std::string DebugString() const;

 private:
  absl::Status PagedExtent(int64_t* extent) const;

  const void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Dims shape_;
  Dims strides_;
  MemorySpace space_ = MemorySpace::kHost;
  PagedLayout layout_;
};

// A sequence's block table: the physical block id of each logical block of `block_size` tokens.
// Valid by construction (Create checks it once, however many views share it) and immutable: a
// client cannot change it while a plan reads through it.
class BlockTable {
 public:
  // At most kMaxBlockSize tokens per block.
  static constexpr int64_t kMaxBlockSize = int64_t{1} << 16;

  // INVALID_ARGUMENT when block_size is outside [1, kMaxBlockSize], when an id is negative, or
  // when two logical blocks name one physical block and `allow_repeated_ids` is false (the
  // message names both indices and the id).
  static absl::StatusOr<BlockTable> Create(std::vector<int32_t> ids, int64_t block_size,
                                           bool allow_repeated_ids = false);

  // ceil(rows / block_size): the ids a table of a sequence of `rows` tokens holds (rows >= 0,
  // block_size >= 1).
  static int64_t BlocksFor(int64_t rows, int64_t block_size) {
    return rows / block_size + (rows % block_size != 0);
  }

  const std::vector<int32_t>& ids() const { return ids_; }
  int64_t block_size() const { return block_size_; }
  int32_t max_id() const { return max_id_; }  // -1 for an empty table
  bool allows_repeated_ids() const { return allow_repeated_ids_; }

 private:
  BlockTable() = default;
  std::vector<int32_t> ids_;
  int64_t block_size_ = 1;
  int32_t max_id_ = -1;
  bool allow_repeated_ids_ = false;
};

// Row-major strides for `shape` (shapes from the wire: a stride that overflows saturates at
// INT64_MAX, so that TensorView::ElementExtent then reports OUT_OF_RANGE).
Dims ContiguousStrides(const Dims& shape);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_TENSOR_VIEW_H_
