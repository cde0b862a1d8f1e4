// Links the installed laprox::kernels: builds the CPU backend in-process.
#include <cstdio>

#include "laprox/kernels/registry.h"

int main() {
  auto backend = laprox::kernels::CreateBackend("cpu");
  if (!backend.ok()) return 1;
  std::printf("kernels_consumer: %s\n", (*backend)->Describe().c_str());
  return 0;
}
