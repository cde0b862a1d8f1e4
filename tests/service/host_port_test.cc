// service/net/host_port.h: the one "host:port" parser of --listen and --metrics_listen.
#include "service/net/host_port.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "service/grpc/tcp_security.h"

namespace laprox::service {
namespace {

using ::testing::HasSubstr;

TEST(HostPortTest, SplitsAtTheLastColonAndUnbracketsIpv6) {
  const struct {
    const char* address;
    const char* host;
    int port;
    bool bracketed;
  } cases[] = {{"127.0.0.1:9464", "127.0.0.1", 9464, false},
               {":50051", "", 50051, false},
               {"localhost:0", "localhost", 0, false},
               {"[::1]:65535", "::1", 65535, true},
               {"[::]:1", "::", 1, true},
               {"laprox.example:443", "laprox.example", 443, false}};
  for (const auto& c : cases) {
    const absl::StatusOr<HostPort> got = SplitHostPort(c.address);
    ASSERT_TRUE(got.ok()) << c.address << ": " << got.status();
    EXPECT_EQ(got->host, c.host) << c.address;
    EXPECT_EQ(got->port, c.port) << c.address;
    EXPECT_EQ(got->bracketed, c.bracketed) << c.address;
  }
}

TEST(HostPortTest, RefusesWhatIsNotHostPortNamingTheAddress) {
  for (const char* address : {"127.0.0.1", "", "host:", "host:http", "host:-1", "host:65536",
                              "[::1:80", "[::1]x:80", "host:99999999999999999999"}) {
    const absl::StatusOr<HostPort> got = SplitHostPort(address);
    ASSERT_FALSE(got.ok()) << address << " -> " << (got.ok() ? got->host : "");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr(absl::StrCat("\"", address, "\"")));
  }
}

TEST(HostPortTest, LoopbackIsLocalhost127Slash8AndColonColon1Only) {
  // gRPC listens on a host without a port too (it picks one): the same hosts count there.
  for (const char* address : {"localhost:1", "127.0.0.1:1", "127.255.0.9:1", "[::1]:1", "localhost",
                              "127.0.0.1", "[::1]"}) {
    EXPECT_TRUE(IsLoopbackAddress(address)) << address;
  }
  for (const char* address :
       {"0.0.0.0:1", "[::]:1", ":1", "128.0.0.1:1", "10.1.2.3:1", "laprox.example:1", "[::2]:1",
        "laprox.example", "0.0.0.0", "::1", "[::ffff:127.0.0.1]:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(address)) << address;
  }
}

}  // namespace
}  // namespace laprox::service
