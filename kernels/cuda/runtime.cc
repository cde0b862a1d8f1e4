#include "laprox/kernels/cuda/runtime.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace laprox::kernels::cuda {

std::string CudaErrorText(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), ": ", cudaGetErrorString(error));
}

absl::Status CudaStatus(cudaError_t error, absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(context, ": ", CudaErrorText(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

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

}  // namespace laprox::kernels::cuda
