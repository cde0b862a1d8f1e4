// Where laproxd listens when nobody says: the one rule that laproxd (--socket=auto), the C++
// client (laprox::client::DefaultTarget) and the Python client (laprox.default_target, which
// mirrors it) share; tests/python/test_default_target.py runs all three on it.
//
//   effective uid 0                        -> /run/laprox/laproxd.sock
//   XDG_RUNTIME_DIR set to an absolute path -> $XDG_RUNTIME_DIR/laprox/laproxd.sock
//                                              (trailing slashes of the variable dropped)
//   otherwise                              -> /run/laprox/laproxd.sock (a system-wide laproxd)
#ifndef LAPROX_ENDPOINT_LAPROX_V1_ENDPOINT_H_
#define LAPROX_ENDPOINT_LAPROX_V1_ENDPOINT_H_

#include <string>

namespace laprox::v1 {

// The socket path of the rule above, from this process's euid and environment.
std::string DefaultSocketPath();
// "unix:" + DefaultSocketPath(): a gRPC target.
std::string DefaultTarget();

}  // namespace laprox::v1

#endif  // LAPROX_ENDPOINT_LAPROX_V1_ENDPOINT_H_
