#include "laprox/kernels/device.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace laprox::kernels {

absl::StatusOr<std::string> CanonicalDeviceUuid(absl::string_view uuid) {
  absl::string_view bare = uuid;
  if (absl::StartsWithIgnoreCase(bare, "GPU-")) bare.remove_prefix(4);
  bool ok = bare.size() == 36;
  std::string out = "GPU-";
  for (size_t i = 0; ok && i < bare.size(); ++i) {
    const char c = bare[i];
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      ok = c == '-';
    } else {
      ok = absl::ascii_isxdigit(static_cast<unsigned char>(c));
    }
    out.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_uuid \"", absl::CEscape(uuid.substr(0, 64)),
        "\" is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, hex digits)"));
  }
  return out;
}

}  // namespace laprox::kernels
