#include "cpu/rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/half.h"
#include "cpu/vector_ops.h"

namespace laprox::kernels::cpu {
namespace {

template <typename Convert>
void ConvertRow(const uint16_t* src, int64_t stride, int64_t cols, Convert convert, float* dst) {
  if (stride == 1) {
    for (int64_t c = 0; c < cols; ++c) dst[c] = convert(src[c]);
  } else {
    for (int64_t c = 0; c < cols; ++c) dst[c] = convert(src[c * stride]);
  }
}

constexpr int64_t kPrefetchRows = 16;

// Converts rows into dst (ld = cols).
void ConvertRows(const TensorView& view, int64_t head, int64_t row0, int64_t count, float* dst) {
  const int64_t cols = view.dim(2);
  const int64_t s2 = view.stride(2);
  // Within a block (the whole tensor when not paged) consecutive rows are stride(1) apart, so
  // the table is read once per block, not per row.
  const int64_t block_size = view.paged() ? view.layout().table->block_size() : count;
  int64_t offset = 0;
  for (int64_t r = 0; r < count; ++r) {
    if (r == 0 || (row0 + r) % block_size == 0) {
      offset = view.RowOffset(head, row0 + r);
    } else {
      offset += view.stride(1);
    }
    float* row = dst + r * cols;
    if (view.paged() && r + kPrefetchRows < count && s2 == 1) {
      // Blocks lie anywhere in the pool, so the hardware prefetcher loses the stream at every
      // block boundary: ask for a row a few ahead.
      const char* ahead = static_cast<const char*>(view.data()) +
                          view.RowOffset(head, row0 + r + kPrefetchRows) * DTypeSize(view.dtype());
      for (int64_t b = 0; b < cols * static_cast<int64_t>(DTypeSize(view.dtype())); b += 64) {
        __builtin_prefetch(ahead + b);
      }
    }
    switch (view.dtype()) {
      case DType::kF32: {
        const float* src = static_cast<const float*>(view.data()) + offset;
        if (s2 == 1) {
          std::memcpy(row, src, cols * sizeof(float));
        } else {
          for (int64_t c = 0; c < cols; ++c) row[c] = src[c * s2];
        }
        break;
      }
      case DType::kF16:
        ConvertRow(static_cast<const uint16_t*>(view.data()) + offset, s2, cols, F16ToFloat, row);
        break;
      case DType::kBF16:
        ConvertRow(static_cast<const uint16_t*>(view.data()) + offset, s2, cols, Bf16ToFloat, row);
        break;
    }
  }
}

// Finds the first non-finite element of the block and names it.
absl::Status NonFiniteError(const float* data, int64_t ld, int64_t count, int64_t cols,
                            int64_t head, int64_t row0, TensorName name) {
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = data[r * ld + c];
      if (!std::isfinite(v)) {
        // o_proj [D, H*d] is read as one "head" of D rows; it is named like its field in the
        // request (RegisterModel's o_proj[l]) and indexed in two dimensions.
        if (absl::string_view(name.field) == "o_proj") {
          return absl::InvalidArgumentError(absl::StrCat("o_proj[", name.layer,
                                                         "] has a non-finite value (", v, ") at [",
                                                         row0 + r, ", ", c, "]"));
        }
        return absl::InvalidArgumentError(absl::StrCat("layers[", name.layer, "].", name.field,
                                                       " has a non-finite value (", v, ") at [",
                                                       head, ", ", row0 + r, ", ", c, "]"));
      }
    }
  }
  return absl::InternalError("non-finite value vanished");
}

// The largest |value| of the block: NaN or +inf when a value is not finite (vector_ops.h).
float BlockMaxAbs(const float* data, int64_t ld, int64_t count, int64_t cols) {
  if (ld == cols) return MaxAbs(data, count * cols);
  float max = 0.f;
  for (int64_t r = 0; r < count; ++r) {
    const float row = MaxAbs(data + r * ld, cols);
    if (!(row <= max)) max = row;  // NaN sticks
  }
  return max;
}

}  // namespace

absl::Status LoadRows(const TensorView& view, int64_t head, int64_t row0, int64_t count,
                      TensorName name, std::vector<float>& scratch, RowBlock* out, float* max_abs) {
  const int64_t cols = view.dim(2);
  // In place: fp32 rows with unit column stride, and for a paged view all in one block.
  const bool one_block = !view.paged() || count <= 1 ||
                         row0 / view.layout().table->block_size() ==
                             (row0 + count - 1) / view.layout().table->block_size();
  if (view.dtype() == DType::kF32 && view.stride(2) == 1 && view.stride(1) >= cols && one_block) {
    out->data = static_cast<const float*>(view.data()) + view.RowOffset(head, row0);
    out->ld = view.stride(1);
  } else {
    if (static_cast<int64_t>(scratch.size()) < count * cols) scratch.resize(count * cols);
    ConvertRows(view, head, row0, count, scratch.data());
    out->data = scratch.data();
    out->ld = cols;
  }
  const float max = BlockMaxAbs(out->data, out->ld, count, cols);
  if (!std::isfinite(max)) return NonFiniteError(out->data, out->ld, count, cols, head, row0, name);
  if (max_abs != nullptr) *max_abs = std::max(*max_abs, max);
  return absl::OkStatus();
}

absl::Status CheckRowsFinite(const TensorView& view, int64_t head, int64_t row0, int64_t count,
                             TensorName name, std::vector<float>& scratch, float* max_abs,
                             const StopSignal* stop) {
  constexpr int64_t kChunk = 512;
  RowBlock block;
  for (int64_t r = row0; r < row0 + count; r += kChunk) {
    if (auto s = CheckStop(stop); !s.ok()) return s;
    const int64_t rows = std::min(kChunk, row0 + count - r);
    if (auto s = LoadRows(view, head, r, rows, name, scratch, &block, max_abs); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace laprox::kernels::cpu
