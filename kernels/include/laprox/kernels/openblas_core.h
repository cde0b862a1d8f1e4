// OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from a table of CPU models when
// the library loads. A model newer than the table gets a generic core: Debian 12's 0.3.21 runs
// its Prescott (SSE3) kernels on an Emerald Rapids Xeon (family 6, model 207), and its sgemm
// there runs at about a sixth of the SkylakeX kernels' rate (bench/RESULTS.md). The environment
// variable OPENBLAS_CORETYPE chooses the kernels instead, but only before the library loads, so
// a program fixes the choice by starting itself again with it set.
#ifndef LAPROX_KERNELS_OPENBLAS_CORE_H_
#define LAPROX_KERNELS_OPENBLAS_CORE_H_

#include <string>

#include "absl/strings/string_view.h"

namespace laprox::kernels {

// The OPENBLAS_CORETYPE to ask for when OpenBLAS loaded `loaded_core` (openblas_get_corename())
// on a CPU with AVX-512 (F, BW, DQ and VL, with the OS saving zmm state) or AVX2 and FMA:
// "SkylakeX" or "Haswell" when the loaded kernels are narrower than the CPU's vectors, "" when
// they are not.
std::string OpenBlasCoreFor(absl::string_view loaded_core, bool avx512, bool avx2);

// OpenBlasCoreFor of the loaded library on this CPU; "" also where OpenBLAS cannot be told
// (not a DYNAMIC_ARCH build) or OPENBLAS_CORETYPE is already set, even to "" (the user's
// choice, and how to opt out).
std::string OpenBlasCoreToRequest();

// Call first thing in main: when OpenBlasCoreToRequest() names a core, prints one line to
// stderr and executes this program again (/proc/self/exe, the same argv and environment) with
// OPENBLAS_CORETYPE set to it. Returns when there is nothing to do, or when the exec failed
// (said on stderr; the program then runs with the kernels it has).
void RestartWithOpenBlasCore(const char* program, char** argv);

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_OPENBLAS_CORE_H_
