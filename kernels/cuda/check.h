// CheckInputs: the data checks of a keep-plan request on the device (NaN/Inf anywhere in the
// inputs, window attention rows that are not probability rows), run before any scoring.
#ifndef LAPROX_KERNELS_CUDA_CHECK_H_
#define LAPROX_KERNELS_CUDA_CHECK_H_

#include <vector>

#include "absl/status/status.h"
#include "cuda/context.h"
#include "cuda/device_buffer.h"
#include "laprox/kernels/backend.h"

namespace laprox::kernels::cuda {

// The largest finite |x| of every head's inputs, as the CPU backend's magnitude checks take them
// (policy/magnitude.h): keys and values per (layer, KV head), window queries per (layer, query
// head), row-major [L][Hkv] and [L][H]; 0 where a tensor is not given.
struct InputMagnitudes {
  std::vector<float> keys, values, queries;
};

class InputChecker {
 public:
  // Checks every element of every given view of every layer (keys, values, window_queries or
  // window_attention, window_lse; all in MemorySpace::kDevice) and synchronises the stream.
  // INVALID_ARGUMENT for the lowest layer, then tensor in that order, then lowest element:
  //   "layers[l].keys has a non-finite value (nan) at [g, i, k]";
  //   "layers[l].window_attention has a negative value (x) at [h, t, j]";
  //   "layers[l].window_attention row [h, t] sums to s, not 1 (tolerance 0.01)" (sum in fp64).
  // The same cases, in the same words, as the CPU backend (kernels/cpu/rows.cc, window.cc).
  // INTERNAL on a CUDA error. When OK, `magnitudes` (if not null) holds the inputs' maxima.
  absl::Status Check(const DeviceContext& context, const std::vector<LayerInputs>& layers,
                     const RequestShape& shape, InputMagnitudes* magnitudes = nullptr);

 private:
  DeviceBuffer scratch_;
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_CHECK_H_
