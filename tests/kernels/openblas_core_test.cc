// laprox/kernels/openblas_core.h: which OpenBLAS kernels to ask for, and that a program that
// restarts itself as laproxd does ends up with kernels as wide as the CPU's vectors.
#include "laprox/kernels/openblas_core.h"

#include <cstdlib>
#include <string>

#include <cblas.h>
#include <gtest/gtest.h>

#include "cpu/vector_ops.h"

namespace laprox::kernels {
namespace {

TEST(OpenBlasCoreFor, NarrowKernelsOnWideCpus) {
  // OpenBLAS 0.3.21 on an Emerald Rapids Xeon (model 207): Prescott.
  EXPECT_EQ(OpenBlasCoreFor("Prescott", /*avx512=*/true, /*avx2=*/true), "SkylakeX");
  EXPECT_EQ(OpenBlasCoreFor("Haswell", true, true), "SkylakeX");
  EXPECT_EQ(OpenBlasCoreFor("Zen", true, true), "SkylakeX");
  EXPECT_EQ(OpenBlasCoreFor("Sandybridge", false, true), "Haswell");
  EXPECT_EQ(OpenBlasCoreFor("Nehalem", false, true), "Haswell");
}

TEST(OpenBlasCoreFor, KernelsAsWideAsTheCpuStay) {
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids", "skylakex"}) {
    EXPECT_EQ(OpenBlasCoreFor(core, true, true), "") << core;
  }
  for (const char* core : {"Haswell", "Zen", "SkylakeX"}) {
    EXPECT_EQ(OpenBlasCoreFor(core, false, true), "") << core;
  }
  // A CPU without AVX2 keeps whatever OpenBLAS chose.
  EXPECT_EQ(OpenBlasCoreFor("Prescott", false, false), "");
  EXPECT_EQ(OpenBlasCoreFor("Nehalem", false, false), "");
}

// OPENBLAS_CORETYPE as the test's process found it before any restart ("unset" when it was
// not set), carried across the restart by main() in kOriginalCoreVariable.
constexpr char kOriginalCoreVariable[] = "LAPROX_TEST_ORIGINAL_OPENBLAS_CORETYPE";

// This binary's main restarted it as laproxd's does. Without a user's OPENBLAS_CORETYPE the
// kernels OpenBLAS now runs are the ones this CPU calls for (on a CPU whose model OpenBLAS does
// not know, this fails without the restart). With one (any value, Haswell on an AVX-512 CPU
// included), it is the user's choice: kept as it was, and nothing more is asked for.
TEST(RestartWithOpenBlasCore, LoadedKernelsMatchTheCpuUnlessTheUserChose) {
  const char* original = std::getenv(kOriginalCoreVariable);
  ASSERT_NE(original, nullptr) << "main() sets " << kOriginalCoreVariable;
  const char* now = std::getenv("OPENBLAS_CORETYPE");
  // Once set, nothing more is asked for: a restarted program does not restart again.
  if (now != nullptr) EXPECT_EQ(OpenBlasCoreToRequest(), "");
  if (std::string(original) != "unset") {
    ASSERT_NE(now, nullptr);
    EXPECT_EQ(std::string(now), std::string(original)) << "the user's choice was replaced";
    return;
  }
  if (std::string(openblas_get_config()).find("DYNAMIC_ARCH") == std::string::npos) {
    GTEST_SKIP() << "OpenBLAS without DYNAMIC_ARCH cannot change its kernels: "
                 << openblas_get_config();
  }
  const cpu::CpuVectors cpu = cpu::DetectCpuVectors();
  EXPECT_EQ(OpenBlasCoreFor(openblas_get_corename(), cpu.avx512_bw_dq_vl, cpu.avx2_fma), "")
      << "OpenBLAS runs its " << openblas_get_corename() << " kernels (" << openblas_get_config()
      << ")";
}

}  // namespace
}  // namespace laprox::kernels

int main(int argc, char** argv) {
  // The first start records what the user set (the environment survives the restart's exec).
  if (std::getenv(laprox::kernels::kOriginalCoreVariable) == nullptr) {
    const char* user = std::getenv("OPENBLAS_CORETYPE");
    setenv(laprox::kernels::kOriginalCoreVariable, user == nullptr ? "unset" : user, 1);
  }
  laprox::kernels::RestartWithOpenBlasCore("laprox_openblas_core_test", argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
