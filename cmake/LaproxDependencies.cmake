# Third-party dependencies, all from Debian packages (scripts/install-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(absl REQUIRED CONFIG)
# Protobuf 3.21 through CMake's FindProtobuf (Debian ships no protobuf CMake config):
# protobuf::libprotobuf, protobuf::protoc and protobuf_generate(). gRPC 1.51's config provides
# gRPC::grpc++ and gRPC::grpc_cpp_plugin. Order matters: absl, then Protobuf, then gRPC.
find_package(Protobuf 3.21 REQUIRED)
find_package(gRPC 1.51 REQUIRED CONFIG)
# prometheus-cpp 1.0 (Debian prometheus-cpp-dev; its config carries no version): the metrics
# registry and text format. /metrics is served with libmicrohttpd (service/metrics/http_exposer.h
# says why not prometheus-cpp's civetweb exposer).
find_package(prometheus-cpp REQUIRED CONFIG)
find_package(PkgConfig REQUIRED)
pkg_check_modules(microhttpd REQUIRED IMPORTED_TARGET libmicrohttpd>=0.9.66)

# Debian's libopenblas-dev ships an OpenBLASConfig.cmake with variables only; wrap them in a
# target. Fall back to FindBLAS when the config file is absent (other distributions).
find_package(OpenBLAS CONFIG QUIET)
if(OpenBLAS_FOUND)
  add_library(laprox_openblas INTERFACE IMPORTED)
  target_include_directories(laprox_openblas INTERFACE ${OpenBLAS_INCLUDE_DIRS})
  target_link_libraries(laprox_openblas INTERFACE ${OpenBLAS_LIBRARIES})
else()
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
  add_library(laprox_openblas INTERFACE IMPORTED)
  target_link_libraries(laprox_openblas INTERFACE BLAS::BLAS)
endif()

find_package(nlohmann_json 3.10 REQUIRED CONFIG)  # laprox-cli (safetensors) and test tools
# The tests and benchmarks need what `scripts/install-deps.sh --dev` installs; without it (a
# machine set up with --run, for the quickstart's demo) they are left out, saying so, and a later
# configure finds them once installed.
if(LAPROX_BUILD_TESTS)
  find_package(GTest CONFIG)
  find_package(Python3 COMPONENTS Interpreter)
  if(NOT GTest_FOUND OR NOT Python3_FOUND)
    message(STATUS "laprox: GoogleTest or Python 3 not found: the tests are not built "
                   "(scripts/install-deps.sh --dev installs them)")
    set(LAPROX_BUILD_TESTS OFF)
  endif()
endif()
if(LAPROX_BUILD_BENCH)
  find_package(benchmark CONFIG)
  if(NOT benchmark_FOUND)
    message(STATUS "laprox: Google Benchmark not found: the benchmarks are not built "
                   "(scripts/install-deps.sh --dev installs it)")
    set(LAPROX_BUILD_BENCH OFF)
  endif()
endif()
