// "host:port" as laproxd's TCP flags take it (--listen, --metrics_listen): one parser for both.
#ifndef LAPROX_SERVICE_NET_HOST_PORT_H_
#define LAPROX_SERVICE_NET_HOST_PORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace laprox::service {

struct HostPort {
  std::string host;        // without the brackets of "[v6]"; "" when the address is ":port"
  int port = 0;            // [0, 65535]; 0 lets the system choose
  bool bracketed = false;  // written "[host]:port" (an IPv6 literal)
};

// Splits "host:port" or "[host]:port" at its last colon (after the closing bracket). No name is
// resolved and the host is not checked: the caller says what it accepts. INVALID_ARGUMENT
// naming the address when there is no port, the port is not a number in [0, 65535], or a "["
// has no "]" right before the colon.
absl::StatusOr<HostPort> SplitHostPort(absl::string_view address);

// Whether `host` (as SplitHostPort returns it) is "localhost", an IPv4 address in 127/8 or the
// IPv6 loopback ::1.
bool IsLoopbackHost(absl::string_view host);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_NET_HOST_PORT_H_
