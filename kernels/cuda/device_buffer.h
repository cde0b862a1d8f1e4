// DeviceBuffer: owned device memory that grows on demand (a workspace), and a small helper to
// turn CUDA errors of a sequence of calls into one value.
#ifndef LAPROX_KERNELS_CUDA_DEVICE_BUFFER_H_
#define LAPROX_KERNELS_CUDA_DEVICE_BUFFER_H_

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

namespace laprox::kernels::cuda {

// Device memory owned by one object; move-only. Not thread-safe: a workspace belongs to one
// request at a time (the CUDA backend serialises requests).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), capacity_(std::exchange(other.capacity_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Free();
      data_ = std::exchange(other.data_, nullptr);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { Free(); }

  // Ensures at least `bytes` of capacity. Growing frees the old memory first (its contents are
  // lost) and allocates with cudaMalloc, which synchronises the device. Returns
  // cudaErrorMemoryAllocation when the device is full (the buffer is then empty).
  [[nodiscard]] cudaError_t Reserve(size_t bytes) {
    if (bytes <= capacity_) return cudaSuccess;
    Free();
    const cudaError_t error = cudaMalloc(&data_, bytes);
    if (error != cudaSuccess) {
      data_ = nullptr;
      return error;
    }
    capacity_ = bytes;
    return cudaSuccess;
  }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t capacity() const { return capacity_; }

 private:
  void Free() {
    if (data_ != nullptr) cudaFree(data_);  // never fails for a pointer cudaMalloc returned
    data_ = nullptr;
    capacity_ = 0;
  }

  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Carves typed, 256-byte aligned sub-arrays out of one workspace: call Add for every array to
// learn the total, Reserve once, then Take in the same order.
class WorkspaceLayout {
 public:
  template <typename T>
  size_t Add(size_t count) {
    const size_t offset = total_;
    total_ += Align(count * sizeof(T));
    return offset;
  }
  size_t total() const { return total_; }
  static size_t Align(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  size_t total_ = 0;
};

}  // namespace laprox::kernels::cuda

#endif  // LAPROX_KERNELS_CUDA_DEVICE_BUFFER_H_
