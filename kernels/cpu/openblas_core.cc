#include "laprox/kernels/openblas_core.h"

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cblas.h>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "cpu/vector_ops.h"

namespace laprox::kernels {
namespace {

// OpenBLAS's names (openblas_get_corename(), lower case) of the x86 cores whose sgemm uses
// 512-bit and 256-bit FMA vectors.
constexpr std::array<absl::string_view, 3> kAvx512Cores = {"skylakex", "cooperlake",
                                                           "sapphirerapids"};
constexpr std::array<absl::string_view, 5> kAvx2Cores = {"haswell", "zen", "skylakex", "cooperlake",
                                                         "sapphirerapids"};

template <size_t N>
bool Among(const std::array<absl::string_view, N>& cores, absl::string_view core) {
  for (absl::string_view c : cores) {
    if (c == core) return true;
  }
  return false;
}

}  // namespace

std::string OpenBlasCoreFor(absl::string_view loaded_core, bool avx512, bool avx2) {
  const std::string core = absl::AsciiStrToLower(loaded_core);
  if (avx512 && !Among(kAvx512Cores, core)) return "SkylakeX";
  if (avx2 && !Among(kAvx2Cores, core)) return "Haswell";
  return "";
}

std::string OpenBlasCoreToRequest() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  if (!absl::StrContains(openblas_get_config(), "DYNAMIC_ARCH")) return "";
  const cpu::CpuVectors cpu = cpu::DetectCpuVectors();
  return OpenBlasCoreFor(openblas_get_corename(), cpu.avx512_bw_dq_vl, cpu.avx2_fma);
}

void RestartWithOpenBlasCore(const char* program, char** argv) {
  const std::string core = OpenBlasCoreToRequest();
  if (core.empty()) return;
  std::fprintf(stderr,
               "%s: OpenBLAS loaded its %s kernels on a CPU with wider vectors; starting again "
               "with OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to keep a choice)\n",
               program, openblas_get_corename(), core.c_str());
  std::fflush(stderr);
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), /*overwrite=*/1) != 0) return;
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "%s: cannot execute /proc/self/exe again (%s); going on with %s\n", program,
               std::strerror(errno), openblas_get_corename());
  unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace laprox::kernels
