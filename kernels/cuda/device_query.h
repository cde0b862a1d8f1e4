// Host launchers of the CUDA backend that do not need a request: device discovery.
#ifndef LAPROX_KERNELS_CUDA_DEVICE_QUERY_H_
#define LAPROX_KERNELS_CUDA_DEVICE_QUERY_H_

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// Number of CUDA devices this process can use (0 with cudaErrorNoDevice when there is none).
cudaError_t CountDevices(int* count);

// Runs a one-thread kernel on `device` and waits for it: proves the device executes our code.
cudaError_t ProbeDevice(int device);

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_DEVICE_QUERY_H_
