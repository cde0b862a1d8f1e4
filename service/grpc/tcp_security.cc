#include "service/grpc/tcp_security.h"

#include <arpa/inet.h>

#include <fstream>
#include <sstream>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace laprox::service {
namespace {

// The host part of host:port or [host]:port ("" when there is none).
std::string Host(absl::string_view address) {
  if (absl::ConsumePrefix(&address, "[")) {
    const size_t close = address.find(']');
    return close == absl::string_view::npos ? "" : absl::StrCat(address.substr(0, close));
  }
  const size_t colon = address.rfind(':');
  return absl::StrCat(colon == absl::string_view::npos ? address : address.substr(0, colon));
}

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("--", flag, "=", path, " cannot be read"));
  std::stringstream text;
  text << file.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, " holds no PEM block"));
  }
  return text.str();
}

}  // namespace

bool IsLoopbackAddress(absl::string_view address) {
  const std::string host = Host(address);
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    absl::string_view address, const TcpSecurityOptions& options, bool* insecure) {
  *insecure = false;
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file go together: give both or neither");
  }
  if (options.cert_file.empty()) {
    if (!options.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs TLS: give --tls_cert_file and --tls_key_file too");
    }
    if (!IsLoopbackAddress(address) && !options.allow_insecure) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--listen=", address,
          " is not a loopback address and would serve the whole API in "
          "plaintext: give --tls_cert_file and --tls_key_file (and --tls_client_ca_file for "
          "client certificates), or --allow_insecure_tcp to accept the risk"));
    }
    *insecure = true;
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadPem(options.cert_file, "tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(options.key_file, "tls_key_file");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(options.client_ca_file, "tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace laprox::service
