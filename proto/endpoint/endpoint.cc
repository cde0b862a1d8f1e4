#include "laprox/v1/endpoint.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace laprox::v1 {

std::string DefaultSocketPath() {
  constexpr char kSystemWide[] = "/run/laprox/laproxd.sock";
  if (geteuid() == 0) return kSystemWide;
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  if (runtime == nullptr || runtime[0] != '/') return kSystemWide;
  std::string dir = runtime;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir == "/") dir.clear();
  return dir + "/laprox/laproxd.sock";
}

std::string DefaultTarget() { return "unix:" + DefaultSocketPath(); }

}  // namespace laprox::v1
