# Packaging: libshoal.so beside libshoal.a (shoal_core), the install rules, shoal.pc for
# pkg-config and the CMake package (find_package(Shoal) -> Shoal::shoal). docs/install.md says
# how they are used.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# One version: project() and include/shoal/version.h must agree.
file(STRINGS ${CMAKE_SOURCE_DIR}/include/shoal/version.h _sh_ver_line
     REGEX "^#define SH_VERSION_STRING \"[0-9.]+\"")
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" _sh_ver "${_sh_ver_line}")
if(NOT _sh_ver STREQUAL PROJECT_VERSION)
  message(FATAL_ERROR "include/shoal/version.h says ${_sh_ver}, CMakeLists.txt's project() says "
                      "${PROJECT_VERSION}: make them agree")
endif()

# The Lua module (api/lua/, a target named shoal_lua where it exists) installs beside the library.
set(SH_LUA_MODULE_DIR ${CMAKE_INSTALL_LIBDIR}/lua/5.4)
set(SH_CMAKE_PACKAGE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/Shoal)

# A fuzzing build builds the fuzz targets' dependencies only.
if(SH_FUZZ)
  return()
endif()

# ---- libshoal.so ------------------------------------------------------------------------------
# The same objects as libshoal.a. The version script, generated from the public headers by
# scripts/api-symbols.sh, exports the sh_ functions that include/shoal.h and include/shoal/*.h
# declare and makes every other symbol local: the internal sh__ functions and whatever the
# dependencies would otherwise re-export. tests/integration/test_lib_symbols.sh checks the result.
file(GLOB _sh_public_headers CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/include/shoal.h
     ${CMAKE_SOURCE_DIR}/include/shoal/*.h)
set(SH_VERSION_SCRIPT ${CMAKE_BINARY_DIR}/libshoal.map)
add_custom_command(
  OUTPUT ${SH_VERSION_SCRIPT}
  COMMAND ${CMAKE_SOURCE_DIR}/scripts/api-symbols.sh --map ${CMAKE_C_COMPILER}
          ${CMAKE_SOURCE_DIR}/include > ${SH_VERSION_SCRIPT}.tmp
  COMMAND ${CMAKE_COMMAND} -E rename ${SH_VERSION_SCRIPT}.tmp ${SH_VERSION_SCRIPT}
  DEPENDS ${_sh_public_headers} ${CMAKE_SOURCE_DIR}/scripts/api-symbols.sh
  COMMENT "Generating libshoal.map (the exported API) from include/"
  VERBATIM)

add_library(shoal_shared SHARED $<TARGET_OBJECTS:shoal_core> ${SH_VERSION_SCRIPT})
target_link_libraries(shoal_shared PRIVATE ${SH_CORE_LIBS})
target_include_directories(shoal_shared
                           INTERFACE $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/include>
                                     $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_link_options(shoal_shared PRIVATE "LINKER:--version-script=${SH_VERSION_SCRIPT}")
if(NOT SH_SAN_FLAGS)
  # Every symbol the library needs comes from its own objects or a library it names (sanitizer
  # runtimes are supplied by the executable, hence the exception).
  target_link_options(shoal_shared PRIVATE "LINKER:--no-undefined")
endif()
set_target_properties(shoal_shared PROPERTIES
  OUTPUT_NAME shoal
  EXPORT_NAME shoal
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}
  LINK_DEPENDS ${SH_VERSION_SCRIPT}
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/lib)

# ---- Install ----------------------------------------------------------------------------------
install(FILES ${CMAKE_SOURCE_DIR}/include/shoal.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${CMAKE_SOURCE_DIR}/include/shoal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(TARGETS shoal_shared EXPORT ShoalTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS shoal_core ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS shoal RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET shoal_lua)
  # The module finds the libshoal.so installed two folders up, wherever the prefix is.
  set_target_properties(shoal_lua PROPERTIES INSTALL_RPATH "$ORIGIN/../..")
  install(TARGETS shoal_lua LIBRARY DESTINATION ${SH_LUA_MODULE_DIR})
endif()

# CMake package: Shoal::shoal is libshoal.so with the include directory.
install(EXPORT ShoalTargets NAMESPACE Shoal:: DESTINATION ${SH_CMAKE_PACKAGE_DIR})
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/ShoalConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/ShoalConfig.cmake
                              INSTALL_DESTINATION ${SH_CMAKE_PACKAGE_DIR})
# 0.x: a new minor version may break the API, so only the same major.minor satisfies a request.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/ShoalConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/ShoalConfig.cmake ${CMAKE_BINARY_DIR}/ShoalConfigVersion.cmake
        DESTINATION ${SH_CMAKE_PACKAGE_DIR})

# pkg-config: relocatable (the prefix is found from the .pc file's own place), so that
# `cmake --install build --prefix P` works with any P. Static linking (pkg-config --static) needs
# the dependencies: those with a .pc file go to Requires.private, the others to Libs.private.
set(_sh_pc_requires libuv lua5.4 libpcre2-8 jansson)
set(_sh_pc_libs "")
foreach(_cand msgpack-c msgpack)
  pkg_check_modules(_SH_PC_MSGPACK QUIET ${_cand})
  if(_SH_PC_MSGPACK_FOUND)
    list(APPEND _sh_pc_requires ${_cand})
    break()
  endif()
endforeach()
if(NOT _SH_PC_MSGPACK_FOUND)
  list(APPEND _sh_pc_libs -lmsgpackc)
endif()
pkg_check_modules(_SH_PC_NNG QUIET nng)
if(_SH_PC_NNG_FOUND)
  list(APPEND _sh_pc_requires nng)
else()
  list(APPEND _sh_pc_libs -lnng -lmbedtls -lmbedx509)
endif()
list(APPEND _sh_pc_libs -lhttp_parser -lmbedcrypto -lpthread -lm)
list(JOIN _sh_pc_requires " " SH_PC_REQUIRES_PRIVATE)
list(JOIN _sh_pc_libs " " SH_PC_LIBS_PRIVATE)
file(RELATIVE_PATH SH_PC_PREFIX_FROM_PCDIR /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
string(REGEX REPLACE "/$" "" SH_PC_PREFIX_FROM_PCDIR "${SH_PC_PREFIX_FROM_PCDIR}")
configure_file(${CMAKE_SOURCE_DIR}/cmake/shoal.pc.in ${CMAKE_BINARY_DIR}/shoal.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/shoal.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
