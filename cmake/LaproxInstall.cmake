# `cmake --install` puts laproxd, the libraries, their headers and a CMake package in the
# prefix, so that another project can `find_package(laprox)` and link laprox::client (talk to
# laproxd; with laprox::client_cuda to export device memory) or laprox::kernels (the in-process
# compute library). laprox::client needs only laprox::kernels_api, laprox::wire,
# laprox::endpoint and laprox::proto: a consumer of it links neither OpenBLAS nor the CUDA runtime
# (tests/install/install_test.sh checks the binary).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LAPROX_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/laprox")

# Exported under the aliases used in this tree (laprox::kernels, laprox::client, ...).
set(_laprox_exported laprox_kernels_api laprox_kernels laprox_proto laprox_wire laprox_endpoint
                     laprox_client laprox_client_cuda)
if(LAPROX_WITH_CUDA)
  list(APPEND _laprox_exported laprox_cuda_runtime)
endif()
foreach(_target IN LISTS _laprox_exported)
  string(REGEX REPLACE "^laprox_" "" _name "${_target}")
  set_target_properties(${_target} PROPERTIES EXPORT_NAME ${_name})
endforeach()
install(TARGETS ${_laprox_exported}
        EXPORT laproxTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS laproxd RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
install(DIRECTORY "${PROJECT_SOURCE_DIR}/kernels/include/" "${PROJECT_SOURCE_DIR}/client/cpp/include/"
                  "${PROJECT_SOURCE_DIR}/proto/wire/" "${PROJECT_SOURCE_DIR}/proto/endpoint/"
                  "${PROJECT_SOURCE_DIR}/kernels/cuda/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" FILES_MATCHING PATTERN "*.h")
install(FILES "${PROJECT_SOURCE_DIR}/proto/laprox/v1/laprox.proto"
        DESTINATION "${CMAKE_INSTALL_DATADIR}/laprox/proto/laprox/v1")
install(EXPORT laproxTargets NAMESPACE laprox:: DESTINATION "${LAPROX_CMAKE_DIR}")

configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/laproxConfig.cmake.in"
                              "${CMAKE_CURRENT_BINARY_DIR}/laproxConfig.cmake"
                              INSTALL_DESTINATION "${LAPROX_CMAKE_DIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/laproxConfigVersion.cmake"
                                  COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/laproxConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/laproxConfigVersion.cmake"
        DESTINATION "${LAPROX_CMAKE_DIR}")
