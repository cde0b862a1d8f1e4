// Fuzz target: the small parsers a client's strings and numbers reach. The first byte picks one,
// the rest is its input:
//   0  shm names: RegionRegistry::RegisterShm(name, offset 0, 1 byte), then Unregister ("laprox-
//      fuzz-self" in the name names the world's real input object, fuzz_world.h). Accepted
//      names must follow the rule ShmRegion.name documents.
//   1  device UUIDs: kernels::CanonicalDeviceUuid. Accepted spellings must be the canonical one
//      up to case and the optional "GPU-", and canonicalising again must change nothing.
//   2  metrics addresses (laproxd --metrics_listen): HttpExposer::Start. A port the parser would
//      accept is replaced by 0 first, so the fuzzer never takes a fixed port on this machine.
//   3  tensor extents: shape and strides (int64, little-endian, rank from the next byte) through
//      kernels::ContiguousStrides and TensorView::ElementExtent, as every tensor reference is.
// Not here: --listen, which service/server.cc hands to grpc::ServerBuilder::AddListeningPort
// after service/net/host_port's split for the loopback check (tcp_security.cc), and --socket,
// which laproxd's UnixListener binds (service/grpc/peer_identity.h).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "laprox/kernels/backend.h"
#include "laprox/kernels/tensor_view.h"
#include "service/core/core.h"
#include "service/metrics/http_exposer.h"
#include "tests/fuzz/fuzz_support.h"

namespace laprox::fuzz {
namespace {

service::Core* core = nullptr;

// ShmRegion.name: "laprox-" first (after one optional "/"), only [A-Za-z0-9._-], <= 255 bytes.
bool DocumentedShmName(absl::string_view name) {
  absl::ConsumePrefix(&name, "/");
  if (!absl::StartsWith(name, "laprox-") || name.size() > 255) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

void FuzzShmName(absl::string_view input) {
  const std::string name = ResolveShmName(input);
  auto id = core->regions().RegisterShm({.name = name, .offset = 0, .byte_size = 1},
                                        service::Owner::Laproxd());
  if (!id.ok()) {
    CheckRefusal(id.status(), "RegisterShm");
    if (id.status().code() != absl::StatusCode::kInvalidArgument && !DocumentedShmName(name)) {
      Fail(absl::StrCat("undocumented name \"", absl::CEscape(name), "\" refused with ",
                        id.status().ToString(), " instead of INVALID_ARGUMENT"));
    }
    return;
  }
  if (!DocumentedShmName(name)) {
    Fail(absl::StrCat("RegisterShm accepted \"", absl::CEscape(name), "\""));
  }
  if (absl::Status s = core->regions().Unregister(*id, service::Owner::Laproxd()); !s.ok()) {
    Fail(absl::StrCat("Unregister(", *id, "): ", s.ToString()));
  }
}

void FuzzDeviceUuid(absl::string_view input) {
  auto uuid = kernels::CanonicalDeviceUuid(input);
  if (!uuid.ok()) {
    CheckRefusal(uuid.status(), "CanonicalDeviceUuid");
    if (uuid.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail(absl::StrCat("CanonicalDeviceUuid: ", uuid.status().ToString()));
    }
    return;
  }
  const std::string& out = *uuid;
  bool canonical = out.size() == 40 && absl::StartsWith(out, "GPU-");
  for (size_t i = 4; canonical && i < out.size(); ++i) {
    const char c = out[i];
    canonical =
        (i == 12 || i == 17 || i == 22 || i == 27)
            ? c == '-'
            : absl::ascii_isxdigit(static_cast<unsigned char>(c)) && !absl::ascii_isupper(c);
  }
  absl::string_view bare = input;
  if (absl::StartsWithIgnoreCase(bare, "GPU-")) bare.remove_prefix(4);
  if (!canonical || !absl::EqualsIgnoreCase(bare, absl::string_view(out).substr(4))) {
    Fail(absl::StrCat("CanonicalDeviceUuid(\"", absl::CEscape(input), "\") = \"",
                      absl::CEscape(out), "\""));
  }
  auto again = kernels::CanonicalDeviceUuid(out);
  if (!again.ok() || *again != out) Fail(absl::StrCat("not idempotent on \"", out, "\""));
}

void FuzzMetricsAddress(absl::string_view input) {
  std::string address(input);
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon != std::string::npos && absl::SimpleAtoi(address.substr(colon + 1), &port) &&
      port >= 0 && port <= 65535) {
    address = absl::StrCat(address.substr(0, colon), ":0");
  }
  auto exposer = service::HttpExposer::Start(address, [] { return std::string("up 1\n"); });
  if (exposer.ok()) return;  // listening on port 0 of a local address; closed here
  CheckRefusal(exposer.status(), "HttpExposer::Start");
  const absl::StatusCode code = exposer.status().code();
  if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kUnavailable) {
    Fail(absl::StrCat("HttpExposer::Start(\"", absl::CEscape(address),
                      "\"): ", exposer.status().ToString()));
  }
}

void FuzzTensorExtent(absl::string_view input) {
  if (input.empty()) return;
  const size_t rank = static_cast<unsigned char>(input[0]) % 8;
  input.remove_prefix(1);
  std::vector<int64_t> numbers;
  while (input.size() >= 8) {
    int64_t x;
    std::memcpy(&x, input.data(), 8);
    numbers.push_back(x);
    input.remove_prefix(8);
  }
  if (numbers.size() < rank) return;
  const kernels::Dims shape(numbers.begin(), numbers.begin() + static_cast<int64_t>(rank));
  kernels::Dims strides(numbers.begin() + static_cast<int64_t>(rank), numbers.end());
  if (strides.size() != rank) strides = kernels::ContiguousStrides(shape);
  int64_t extent = -1;
  const absl::Status s =
      kernels::TensorView(nullptr, kernels::DType::kF32, shape, strides).ElementExtent(&extent);
  if (!s.ok()) {
    CheckRefusal(s, "ElementExtent");
    return;
  }
  // The extent covers the last element: 1 + sum (shape - 1) * stride, 0 when any shape is 0.
  bool empty = false;
  for (int64_t d : shape) empty |= d == 0;
  __int128 expected = empty ? 0 : 1;
  for (size_t i = 0; i < rank && !empty; ++i) {
    __int128 term;
    if (__builtin_mul_overflow(static_cast<__int128>(shape[i]) - 1, strides[i], &term) ||
        __builtin_add_overflow(expected, term, &expected)) {
      Fail(absl::StrCat("ElementExtent accepted an extent past 2^127: ", extent));
    }
  }
  if (extent != expected) {
    Fail(absl::StrCat("ElementExtent = ", extent, " but the extent is ",
                      static_cast<double>(expected)));
  }
}

}  // namespace
}  // namespace laprox::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  laprox::fuzz::SetUpHarness();
  laprox::fuzz::core = laprox::fuzz::NewCore().release();
  laprox::fuzz::InputObject();  // created and filled; stays linked until exit
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      laprox::fuzz::FuzzShmName(input);
      break;
    case 1:
      laprox::fuzz::FuzzDeviceUuid(input);
      break;
    case 2:
      laprox::fuzz::FuzzMetricsAddress(input);
      break;
    default:
      laprox::fuzz::FuzzTensorExtent(input);
      break;
  }
  return 0;
}
