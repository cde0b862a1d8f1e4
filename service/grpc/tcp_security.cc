#include "service/grpc/tcp_security.h"

#include <fstream>
#include <sstream>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "service/net/host_port.h"

namespace laprox::service {
namespace {

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
  const absl::StatusOr<HostPort> split = SplitHostPort(address);
  if (split.ok()) return IsLoopbackHost(split->host);
  // gRPC also listens on a host without a port (it picks the port): "localhost", "[::1]".
  absl::ConsumePrefix(&address, "[");
  absl::ConsumeSuffix(&address, "]");
  return IsLoopbackHost(address);
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
