# Included before project(): with LAPROX_FUZZ=ON the C++ compiler must be clang (libFuzzer is part
# of clang's runtime), so pick clang++-14 (Debian clang-14) unless one was named already. The
# compiler cannot change after project(); cmake/LaproxFuzz.cmake checks what was picked.
if(LAPROX_FUZZ AND NOT CMAKE_CXX_COMPILER AND NOT DEFINED ENV{CXX})
  find_program(LAPROX_FUZZ_CLANGXX NAMES clang++-14 clang++)
  if(NOT LAPROX_FUZZ_CLANGXX)
    message(FATAL_ERROR "LAPROX_FUZZ=ON needs clang++ (Debian: apt-get install clang-14 "
                        "libclang-rt-14-dev); scripts/fuzz.sh installs it")
  endif()
  set(CMAKE_CXX_COMPILER "${LAPROX_FUZZ_CLANGXX}" CACHE FILEPATH "C++ compiler (LAPROX_FUZZ)")
endif()
