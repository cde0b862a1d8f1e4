// Reading rows of strided fp32/fp16/bf16 host tensors as contiguous fp32, checking finiteness
// and measuring their largest magnitude.
#ifndef LAPROX_KERNELS_CPU_ROWS_H_
#define LAPROX_KERNELS_CPU_ROWS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "laprox/kernels/stop.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::kernels::cpu {

// Names a request tensor in error messages without building a string on the hot path:
// "layers[3].keys".
struct TensorName {
  int64_t layer;
  const char* field;
};

// `count` rows of `cols` fp32 values, row r at data + r * ld.
struct RowBlock {
  const float* data = nullptr;
  int64_t ld = 0;
};

// Rows [row0, row0 + count) of head `head` of a rank-3 host view [heads, rows, cols]. Uses the
// view's memory in place when it is fp32 with unit column stride (no copy); otherwise converts
// into `scratch` (resized as needed). INVALID_ARGUMENT naming the tensor and the element when a
// value is NaN or infinite. With `max_abs` set, *max_abs = max(*max_abs, largest |value| read)
// (the magnitude checks of policy/magnitude.h need the largest input of each head).
absl::Status LoadRows(const TensorView& view, int64_t head, int64_t row0, int64_t count,
                      TensorName name, std::vector<float>& scratch, RowBlock* out,
                      float* max_abs = nullptr);

// Checks that rows [row0, row0 + count) of `head` are finite without keeping them (and updates
// `max_abs` as LoadRows does); checks `stop` (may be null) once per 512 rows.
absl::Status CheckRowsFinite(const TensorView& view, int64_t head, int64_t row0, int64_t count,
                             TensorName name, std::vector<float>& scratch, float* max_abs = nullptr,
                             const StopSignal* stop = nullptr);

}  // namespace laprox::kernels::cpu

#endif  // LAPROX_KERNELS_CPU_ROWS_H_
