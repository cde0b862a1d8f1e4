// Links the installed laprox::client and laprox::kernels: computes a tiny plan in-process and
// builds a client (no server needed for that).
#include <cstdio>

#include "laprox/client/client.h"
#include "laprox/kernels/registry.h"

int main() {
  auto backend = laprox::kernels::CreateBackend("cpu");
  auto client = laprox::client::Client::Connect("unix:/nonexistent.sock");
  if (!backend.ok() || !client.ok()) return 1;
  std::printf("consumer: %s\n", (*backend)->Describe().c_str());
  return 0;
}
