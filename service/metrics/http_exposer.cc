#include "service/metrics/http_exposer.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "absl/strings/str_cat.h"
#include "service/net/host_port.h"

namespace laprox::service {
namespace {

constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr size_t kStackBytes = size_t{1} << 20;  // the thread serialises the whole registry
// A reply holds its body until the client has read it (or the connection is idle for the
// timeout), so the connections bound the memory scrapes hold: kMaxConnections bodies at most
// (8-16 MB each at the default series caps), however many clients connect and do not read.
// Further clients wait in the listen backlog. Without the limit, 100 clients that sent
// GET /metrics and never read made laproxd hold 1.4 GB.
constexpr unsigned int kMaxConnections = 16;
constexpr unsigned int kConnectionTimeoutSeconds = 10;
constexpr char kRenderFailed[] =
    "laproxd could not render its metrics (out of memory?); counted in "
    "laprox_metrics_scrape_failures_total, the next scrape tries again\n";

MHD_Result Queue(MHD_Connection* connection, unsigned int code, MHD_Response* response,
                 const char* content_type) {
  if (response == nullptr) return MHD_NO;  // out of memory: libmicrohttpd closes the connection
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  const MHD_Result result = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return result;
}

// A reply of static text: nothing to allocate on our side.
MHD_Result Reply(MHD_Connection* connection, unsigned int code, const char* text) {
  return Queue(connection, code,
               MHD_create_response_from_buffer(std::strlen(text), const_cast<char*>(text),
                                               MHD_RESPMEM_PERSISTENT),
               "text/plain");
}

// A reply of `body`, handed to libmicrohttpd (no second copy of a large page).
MHD_Result Reply(MHD_Connection* connection, std::unique_ptr<std::string> body) {
  MHD_Response* response = MHD_create_response_from_buffer_with_free_callback_cls(
      body->size(), body->data(), [](void* owned) { delete static_cast<std::string*>(owned); },
      body.get());
  if (response != nullptr) (void)body.release();  // now the response's; else freed here
  return Queue(connection, MHD_HTTP_OK, response, kContentType);
}

MHD_Result Dispatch(void* cls, MHD_Connection* connection, const char* url, const char* method,
                    const char* /*version*/, const char* /*upload_data*/,
                    size_t* /*upload_data_size*/, void** /*state*/) {
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      std::strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    return Reply(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET\n");
  }
  if (std::strcmp(url, "/metrics") == 0) {
    // The body is built whole: a host short of memory (std::bad_alloc) fails this scrape, never
    // the process (no exception may leave this C callback).
    const auto* exposer = static_cast<const HttpExposer*>(cls);
    std::unique_ptr<std::string> body;
    try {
      body = std::make_unique<std::string>(exposer->Render());
    } catch (...) {
      exposer->CountFailure();
      return Reply(connection, MHD_HTTP_INTERNAL_SERVER_ERROR, kRenderFailed);
    }
    return Reply(connection, std::move(body));
  }
  if (std::strcmp(url, "/") == 0) {
    return Reply(connection, MHD_HTTP_OK, "laproxd: metrics are at /metrics\n");
  }
  return Reply(connection, MHD_HTTP_NOT_FOUND, "not found; metrics are at /metrics\n");
}

// "host:port" -> socket address; IPv4 dotted quad or "[v6]".
struct Address {
  sockaddr_storage storage{};
  bool v6 = false;
};

absl::StatusOr<Address> ParseAddress(const std::string& address) {
  absl::StatusOr<HostPort> split = SplitHostPort(address);
  if (!split.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics ", split.status().message()));
  }
  std::string host = split->host;
  const int port = split->port;
  Address out;
  if (split->bracketed) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, host.c_str(), &in6->sin6_addr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics address \"", address, "\": \"", host, "\" is not an IPv6 address"));
    }
    out.v6 = true;
    return out;
  }
  if (host.empty()) host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  auto* in4 = reinterpret_cast<sockaddr_in*>(&out.storage);
  in4->sin_family = AF_INET;
  in4->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &in4->sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\": \"", host, "\" is not an IPv4 address"));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(const std::string& address,
                                                                std::function<std::string()> body) {
  absl::StatusOr<Address> parsed = ParseAddress(address);
  if (!parsed.ok()) return parsed.status();
  std::unique_ptr<HttpExposer> exposer(new HttpExposer(std::move(body)));
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
  if (parsed->v6) flags |= MHD_USE_IPv6;
  exposer->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Dispatch, exposer.get(), MHD_OPTION_SOCK_ADDR,
      reinterpret_cast<const sockaddr*>(&parsed->storage), MHD_OPTION_THREAD_STACK_SIZE,
      kStackBytes, MHD_OPTION_CONNECTION_TIMEOUT, kConnectionTimeoutSeconds,
      MHD_OPTION_CONNECTION_LIMIT, kMaxConnections, MHD_OPTION_END);
  if (exposer->daemon_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", std::strerror(errno)));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(exposer->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  exposer->port_ = info != nullptr ? info->port : 0;
  return exposer;
}

HttpExposer::~HttpExposer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

}  // namespace laprox::service
