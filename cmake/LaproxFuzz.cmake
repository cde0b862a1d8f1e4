# LAPROX_FUZZ=ON: the libFuzzer targets of tests/fuzz (tests/fuzz/README.md). Every project target
# is compiled with coverage instrumentation for libFuzzer (-fsanitize=fuzzer-no-link), ASan and
# UBSan; the fuzz targets add -fsanitize=fuzzer when they link. UBSan stays recoverable so that a
# known report can be suppressed while fuzzing on (UBSAN_OPTIONS=suppressions=...), but the
# targets default to halt_on_error=1 (tests/fuzz/fuzz_support.cc), so any report is a finding.
# The dependencies stay Debian's gcc-built libraries (gRPC, protobuf, Abseil, OpenBLAS): ASan
# intercepts their allocations, but their code is neither instrumented nor checked.
if(NOT LAPROX_FUZZ)
  return()
endif()
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "LAPROX_FUZZ=ON needs clang, but the C++ compiler is "
                      "${CMAKE_CXX_COMPILER_ID} (${CMAKE_CXX_COMPILER}); configure a fresh build "
                      "directory, or pass -DCMAKE_CXX_COMPILER=clang++-14")
endif()
# The CPU backend is the one fuzzed; nvcc would not take these flags.
if(NOT LAPROX_CUDA STREQUAL "OFF")
  message(STATUS "laprox: LAPROX_FUZZ=ON builds without the CUDA backend")
  set(LAPROX_CUDA OFF)
endif()
add_compile_options(
  $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link,address,undefined>
  $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>
  $<$<COMPILE_LANGUAGE:CXX>:-gline-tables-only>
  # Bounds checks in std::vector::operator[] and friends; no ABI change.
  $<$<COMPILE_LANGUAGE:CXX>:-D_GLIBCXX_ASSERTIONS>)
add_link_options(-fsanitize=address,undefined)
