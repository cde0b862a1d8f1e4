# `cmake --install` puts laproxd, the libraries, their headers and a CMake package in the
# prefix, so that another project can `find_package(laprox)` and link laprox::client (or
# laprox::kernels for the in-process library).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LAPROX_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/laprox")

# Exported as laprox::kernels, laprox::proto, laprox::client (the aliases used in this tree).
set_target_properties(laprox_kernels PROPERTIES EXPORT_NAME kernels)
set_target_properties(laprox_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(laprox_client PROPERTIES EXPORT_NAME client)
set_target_properties(laprox_wire PROPERTIES EXPORT_NAME wire)
install(TARGETS laprox_kernels laprox_proto laprox_wire laprox_client
        EXPORT laproxTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS laproxd RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
install(DIRECTORY "${PROJECT_SOURCE_DIR}/kernels/include/" "${PROJECT_SOURCE_DIR}/client/cpp/include/"
                  "${PROJECT_SOURCE_DIR}/proto/wire/"
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
