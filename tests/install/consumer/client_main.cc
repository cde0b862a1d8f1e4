// Links the installed laprox::client alone: builds a client (no server needed for that) and
// validates a policy with the API types it brings (laprox::kernels_api).
#include <cstdio>

#include "laprox/client/client.h"
#include "laprox/kernels/policy.h"

int main() {
  auto client = laprox::client::Client::Connect("unix:/nonexistent.sock");
  laprox::kernels::PolicySpec policy;
  policy.budget.tokens_per_head = 64;
  if (!client.ok() || !policy.Validate().ok()) return 1;
  std::printf("client_consumer: a client and a valid policy\n");
  return 0;
}
