// What --listen may serve: TLS (optionally requiring client certificates) from PEM files, or
// plaintext only on a loopback address unless the operator explicitly allows more.
#ifndef LAPROX_SERVICE_GRPC_TCP_SECURITY_H_
#define LAPROX_SERVICE_GRPC_TCP_SECURITY_H_

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace laprox::service {

struct TcpSecurityOptions {
  std::string cert_file;        // PEM certificate chain; with key_file: TLS
  std::string key_file;         // PEM private key
  std::string client_ca_file;   // PEM CA bundle: clients must present a certificate it signed
  bool allow_insecure = false;  // plaintext on a non-loopback address
};

// Whether `address` (host:port, [v6]:port) names a loopback host: localhost, 127.0.0.0/8 or
// ::1. Anything else (0.0.0.0, [::], a name, a malformed address) is not.
bool IsLoopbackAddress(absl::string_view address);

// The credentials for --listen=`address`. TLS when cert_file and key_file are given (mutual
// TLS with client_ca_file); plaintext on a loopback address; plaintext elsewhere only with
// allow_insecure. INVALID_ARGUMENT for half a key pair or a client CA without TLS,
// FAILED_PRECONDITION for plaintext on a non-loopback address, NOT_FOUND / INVALID_ARGUMENT for
// a file that cannot be read or holds no PEM block. `*insecure` tells whether the result is
// plaintext.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    absl::string_view address, const TcpSecurityOptions& options, bool* insecure);

}  // namespace laprox::service

#endif  // LAPROX_SERVICE_GRPC_TCP_SECURITY_H_
