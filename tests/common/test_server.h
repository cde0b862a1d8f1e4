// TestServer: a gRPC server in this process on a fresh Unix socket, for the tests and benchmarks
// that run laprox's service in-process (the socket path, the builder, the start and the cleanup
// in one place). Header-only; link laprox_service_grpc.
//
//   server_ = laprox::testing::TestServer::Start(service_.get(), "laprox-client");
//   ASSERT_NE(server_, nullptr);
//   auto client = Client::Connect(server_->target());
//
// Destroying it shuts the server down (in-flight calls are cancelled) and removes the socket.
// Destroy it before the service and the work queue it serves.
#ifndef LAPROX_TESTS_COMMON_TEST_SERVER_H_
#define LAPROX_TESTS_COMMON_TEST_SERVER_H_

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "service/grpc/laprox_service.h"

namespace laprox::testing {

// The caller identifier of in-process tests and benchmarks that serve a LaproxService on a
// TestServer: every call acts as laproxd itself, which sees everything. (laproxd identifies
// callers by SO_PEERCRED: tests of who sees what start a service::Server, service/server.h.)
inline service::CallerIdentifier ActAsLaproxd() {
  return [](const grpc::ServerContextBase&) { return service::Owner::Laproxd(); };
}

class TestServer {
 public:
  // Serves `service` on <dir>/<prefix>-<pid>-<k>.sock, with dir $TEST_TMPDIR, $TMPDIR or /tmp;
  // max_receive_message_bytes -1 keeps gRPC's default. nullptr when gRPC cannot start it.
  static std::unique_ptr<TestServer> Start(grpc::Service* service, const std::string& prefix,
                                           int max_receive_message_bytes = -1) {
    auto server = std::unique_ptr<TestServer>(new TestServer());
    server->socket_ = TempSocketPath(prefix);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(server->target(), grpc::InsecureServerCredentials());
    if (max_receive_message_bytes >= 0) builder.SetMaxReceiveMessageSize(max_receive_message_bytes);
    builder.RegisterService(service);
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr) return nullptr;
    return server;
  }

  // A fresh socket path: <dir>/<prefix>-<pid>-<k>.sock, with dir $TEST_TMPDIR, $TMPDIR or /tmp.
  static std::string TempSocketPath(const std::string& prefix) {
    static std::atomic<int> counter{0};
    std::string dir = "/tmp";
    for (const char* name : {"TEST_TMPDIR", "TMPDIR"}) {
      if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
        dir = value;
        break;
      }
    }
    if (dir.back() != '/') dir.push_back('/');
    return dir + prefix + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++) +
           ".sock";
  }

  ~TestServer() {
    if (server_ != nullptr) server_->Shutdown();
    unlink(socket_.c_str());
  }
  TestServer(const TestServer&) = delete;
  TestServer& operator=(const TestServer&) = delete;

  const std::string& socket() const { return socket_; }
  std::string target() const { return "unix:" + socket_; }
  grpc::Server& server() { return *server_; }

 private:
  TestServer() = default;
  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace laprox::testing

#endif  // LAPROX_TESTS_COMMON_TEST_SERVER_H_
