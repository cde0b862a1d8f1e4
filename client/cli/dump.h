// A KV dump as laprox-cli reads it (a safetensors file: per layer keys, values, window queries
// or attention, optional window LSE, o_proj; the geometry as JSON), and the generated demo sample.
#ifndef LAPROX_CLIENT_CLI_DUMP_H_
#define LAPROX_CLIENT_CLI_DUMP_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/cli/safetensors.h"
#include "laprox/kernels/geometry.h"

namespace laprox::cli {

struct Dump {
  kernels::ModelGeometry geometry;
  int64_t n = 0;
  SafeTensorsFile file;
  const SafeTensor& Get(int layer, const char* what) const {
    return file.tensors.at(absl::StrCat("layers.", layer, ".", what));
  }
  const SafeTensor* Find(int layer, const char* what) const {
    auto it = file.tensors.find(absl::StrCat("layers.", layer, ".", what));
    return it == file.tensors.end() ? nullptr : &it->second;
  }
};

// The dump in `file`, its geometry from `geometry_file` (JSON; empty: the file's metadata key
// "laprox.geometry"). INVALID_ARGUMENT names a missing tensor or a bad geometry.
absl::StatusOr<Dump> LoadDump(SafeTensorsFile file, const std::string& geometry_file);

// A sample with the structure of real prefills: attention sinks at the first positions, a few
// heavy-hitter tokens the window queries attend to, value norms growing with depth. It has 64
// window query rows, so that every policy's default window fits.
SafeTensorsFile MakeDemo();

}  // namespace laprox::cli

#endif  // LAPROX_CLIENT_CLI_DUMP_H_
