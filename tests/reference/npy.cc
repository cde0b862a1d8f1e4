#include "npy.h"

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace laprox::testing {
namespace {

// Extracts the value text after `'key':` in a numpy header dict.
std::string HeaderField(const std::string& header, const std::string& key) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) return "";
  size_t start = header.find(':', at) + 1;
  while (start < header.size() && header[start] == ' ') ++start;
  size_t end;
  if (header[start] == '(') {
    end = header.find(')', start) + 1;
  } else {
    end = header.find_first_of(",}", start);
  }
  return header.substr(start, end - start);
}

}  // namespace

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  char magic[8];
  in.read(magic, 8);
  if (!in || std::string(magic + 1, 5) != "NUMPY") {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not an .npy file"));
  }
  uint32_t header_len = 0;
  if (magic[6] == 1) {
    uint16_t len16 = 0;
    in.read(reinterpret_cast<char*>(&len16), 2);
    header_len = len16;
  } else {
    in.read(reinterpret_cast<char*>(&header_len), 4);
  }
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);
  NpyArray array;
  array.descr =
      std::string(absl::StripSuffix(absl::StripPrefix(HeaderField(header, "descr"), "'"), "'"));
  if (HeaderField(header, "fortran_order") != "False") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": Fortran order is not supported"));
  }
  std::string shape = HeaderField(header, "shape");
  shape = std::string(absl::StripSuffix(absl::StripPrefix(shape, "("), ")"));
  int64_t count = 1;
  for (absl::string_view part : absl::StrSplit(shape, ',', absl::SkipWhitespace())) {
    int64_t dim;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &dim)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad shape ", shape));
    }
    array.shape.push_back(dim);
    count *= dim;
  }
  int64_t item = 0;
  if (array.descr == "<f4" || array.descr == "<i4") item = 4;
  if (array.descr == "<f2" || array.descr == "<u2") item = 2;
  if (array.descr == "<f8" || array.descr == "<i8") item = 8;
  if (array.descr == "|u1" || array.descr == "|b1") item = 1;
  if (item == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": dtype ", array.descr));
  array.bytes.resize(count * item);
  in.read(array.bytes.data(), static_cast<std::streamsize>(array.bytes.size()));
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, " is truncated"));
  return array;
}

absl::Status WriteNpy(const std::string& path, const std::string& descr,
                      const std::vector<int64_t>& shape, const void* data, size_t bytes) {
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", dims, "), }");
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&len), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace laprox::testing
