#include "cuda/device_util.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

}  // namespace laprox::kernels::cuda
