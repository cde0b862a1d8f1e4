// Minimal .npy reading and writing for the reference comparison (little-endian, C order,
// dtypes <f4, <f2, <u2, <f8, <i4, |u1). Test-only code.
#ifndef LAPROX_TESTS_REFERENCE_NPY_H_
#define LAPROX_TESTS_REFERENCE_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace laprox::testing {

struct NpyArray {
  std::string descr;           // numpy dtype string, e.g. "<f4"
  std::vector<int64_t> shape;  // C order
  std::vector<char> bytes;     // raw element data
};

absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const std::string& descr,
                      const std::vector<int64_t>& shape, const void* data, size_t bytes);

}  // namespace laprox::testing

#endif  // LAPROX_TESTS_REFERENCE_NPY_H_
