#include "client/cli/safetensors.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace laprox::cli {
namespace {

using nlohmann::json;

absl::StatusOr<kernels::DType> ParseDType(const std::string& name) {
  if (name == "F32") return kernels::DType::kF32;
  if (name == "F16") return kernels::DType::kF16;
  if (name == "BF16") return kernels::DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors dtype ", name, " is not supported (F32, F16, BF16)"));
}

const char* DTypeTag(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kF32:
      return "F32";
    case kernels::DType::kF16:
      return "F16";
    case kernels::DType::kBF16:
      return "BF16";
  }
  return "?";
}

}  // namespace

absl::StatusOr<SafeTensorsFile> ReadSafeTensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::vector<char> content(static_cast<size_t>(in.tellg()));
  in.seekg(0);
  in.read(content.data(), static_cast<std::streamsize>(content.size()));
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  if (content.size() < 8) return absl::InvalidArgumentError(path + " is too short");
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = header_size << 8 | static_cast<uint8_t>(content[i]);
  if (header_size > content.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header of ", header_size, " bytes runs past the end"));
  }
  const json header = json::parse(content.begin() + 8, content.begin() + 8 + header_size,
                                  /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(path + ": the header is not a JSON object");
  }
  const size_t data_start = 8 + header_size;
  SafeTensorsFile file;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [key, value] : entry.items()) {
        if (value.is_string()) file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    if (!entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", name, " is incomplete"));
    }
    SafeTensor tensor;
    auto dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) return dtype.status();
    tensor.dtype = *dtype;
    tensor.shape = entry["shape"].get<std::vector<int64_t>>();
    const auto offsets = entry["data_offsets"].get<std::vector<uint64_t>>();
    int64_t elements = 1;
    for (int64_t s : tensor.shape) elements *= s;
    if (offsets.size() != 2 || offsets[1] < offsets[0] ||
        offsets[1] > content.size() - data_start ||
        offsets[1] - offsets[0] != static_cast<uint64_t>(elements) * DTypeSize(tensor.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", name, " has inconsistent data_offsets"));
    }
    tensor.bytes.assign(content.begin() + data_start + offsets[0],
                        content.begin() + data_start + offsets[1]);
    file.tensors[name] = std::move(tensor);
  }
  return file;
}

absl::Status WriteSafeTensors(const std::string& path, const SafeTensorsFile& file) {
  json header = json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : file.tensors) {
    header[name] = {{"dtype", DTypeTag(tensor.dtype)},
                    {"shape", tensor.shape},
                    {"data_offsets", {offset, offset + tensor.bytes.size()}}};
    offset += tensor.bytes.size();
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text += ' ';  // the format pads the header with spaces
  std::ofstream out(path, std::ios::binary);
  uint64_t size = text.size();
  for (int i = 0; i < 8; ++i, size >>= 8) out.put(static_cast<char>(size & 0xff));
  out << text;
  for (const auto& [name, tensor] : file.tensors) {
    out.write(tensor.bytes.data(), static_cast<std::streamsize>(tensor.bytes.size()));
  }
  return out ? absl::OkStatus() : absl::InternalError("cannot write " + path);
}

}  // namespace laprox::cli
