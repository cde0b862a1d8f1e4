#include "service/net/host_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace laprox::service {

absl::StatusOr<HostPort> SplitHostPort(absl::string_view address) {
  const auto refuse = [address](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("address \"", address, "\" is not host:port or [host]:port: ", why));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return refuse("no port");
  HostPort out;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &out.port) || out.port < 0 || out.port > 65535) {
    return refuse("the port is not a number in [0, 65535]");
  }
  absl::string_view host = address.substr(0, colon);
  if (!host.empty() && host.front() == '[') {
    if (host.size() < 2 || host.back() != ']') return refuse("\"[\" without \"]\" before the port");
    host = host.substr(1, host.size() - 2);
    out.bracketed = true;
  }
  out.host.assign(host.begin(), host.end());
  return out;
}

bool IsLoopbackHost(absl::string_view host) {
  if (host == "localhost") return true;
  const std::string text(host);
  in_addr v4{};
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, text.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

}  // namespace laprox::service
