# Decides whether the CUDA backend is built. This is the only place the build looks for nvcc;
# the C++ code learns the answer through LAPROX_HAVE_CUDA, used only in kernels/registry.cc.
set(LAPROX_WITH_CUDA OFF)
if(NOT LAPROX_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Build machines have no GPU: never "native". sm_90 code plus PTX for newer devices.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 knows no CUDA20 flags for nvcc
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(LAPROX_WITH_CUDA ON)
  elseif(LAPROX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "LAPROX_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "laprox: CUDA backend ${LAPROX_WITH_CUDA}")
