// Reading and writing the safetensors format (8-byte little-endian header length, a JSON header
// of {name: {dtype, shape, data_offsets}} plus optional "__metadata__", then the raw bytes),
// with nlohmann::json for the header.
#ifndef LAPROX_CLIENT_CLI_SAFETENSORS_H_
#define LAPROX_CLIENT_CLI_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "laprox/kernels/tensor_view.h"

namespace laprox::cli {

struct SafeTensor {
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<int64_t> shape;
  std::vector<char> bytes;  // row-major
};

struct SafeTensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, SafeTensor> tensors;
};

// INVALID_ARGUMENT for a malformed file or a dtype other than F32, F16, BF16; NOT_FOUND when the
// file cannot be opened.
absl::StatusOr<SafeTensorsFile> ReadSafeTensors(const std::string& path);
absl::Status WriteSafeTensors(const std::string& path, const SafeTensorsFile& file);

}  // namespace laprox::cli

#endif  // LAPROX_CLIENT_CLI_SAFETENSORS_H_
