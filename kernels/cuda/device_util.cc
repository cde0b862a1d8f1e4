#include "cuda/device_util.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "cuda/cuda_status.h"

namespace laprox::kernels::cuda {

std::string FormatUuid(const cudaUUID_t& uuid) {
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    absl::StrAppendFormat(&out, "%02x", static_cast<unsigned char>(uuid.bytes[i]));
  }
  return out;
}

absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeQuery() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                             cudaEnableDefault, &found);
  if (error != cudaSuccess) {
    return CudaStatus(error, "looking up the driver's cuMemGetAddressRange");
  }
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return absl::InternalError(
        absl::StrCat("the CUDA driver has no cuMemGetAddressRange (entry point query result ",
                     static_cast<int>(found), ")"));
  }
  return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn);
}

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
