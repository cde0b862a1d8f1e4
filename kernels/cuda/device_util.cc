#include "cuda/device_util.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"

namespace laprox::kernels::cuda {

KernelTensor ToKernelTensor(const TensorView& view) {
  KernelTensor t;
  t.data = view.data();
  t.dtype = static_cast<int>(view.dtype());
  const int rank = view.rank();
  for (int i = 0; i < 3; ++i) {
    t.dims[i] = i < rank ? view.dim(i) : 1;
    t.strides[i] = i < rank ? view.stride(i) : 0;
  }
  return t;
}

absl::StatusOr<float> ReadDeviceElement(const void* data, DType dtype, int64_t offset,
                                        absl::string_view what) {
  const size_t size = DTypeSize(dtype);
  uint32_t bits = 0;
  LAPROX_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(&bits, static_cast<const std::byte*>(data) + offset * static_cast<int64_t>(size),
                 size, cudaMemcpyDeviceToHost),
      what));
  switch (dtype) {
    case DType::kF16:
      return F16ToFloat(static_cast<uint16_t>(bits));
    case DType::kBF16:
      return Bf16ToFloat(static_cast<uint16_t>(bits));
    case DType::kF32:
      break;
  }
  float value = 0.f;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace laprox::kernels::cuda
