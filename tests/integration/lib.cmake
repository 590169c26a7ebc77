# The library as a host program sees it (cmake/ShoalPackage.cmake builds it): libshoal.so exports
# only the API of include/ (test_lib_symbols); a C99 program built against the API version-1
# headers of tests/abi/v1/ runs against it (test_abi); `cmake --install` into a temporary prefix,
# then every example under examples/ with a build file builds against that prefix alone and runs
# (test_install_examples, scripts/check-examples.sh).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
# In a sanitizer build the library needs the sanitizer runtimes: test_abi builds its program with
# the same flags; the examples build as users' programs do, so that test skips there.
list(JOIN SH_SAN_FLAGS " " _sh_san)
set(_sh_lib_env "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_CC=${CMAKE_C_COMPILER}"
    "SH_SAN_FLAGS=${_sh_san}"
    "SH_LIBSHOAL=$<TARGET_FILE:shoal_shared>;SH_LIBSHOAL_A=$<TARGET_FILE:shoal_core>"
    "SH_SONAME=$<TARGET_SONAME_FILE_NAME:shoal_shared>")
add_test(NAME test_lib_symbols COMMAND ${CMAKE_CURRENT_LIST_DIR}/test_lib_symbols.sh)
set_tests_properties(test_lib_symbols PROPERTIES LABELS integration TIMEOUT 60
                     ENVIRONMENT "${_sh_lib_env}")
add_test(NAME test_abi COMMAND ${CMAKE_SOURCE_DIR}/tests/abi/test_abi.sh)
set_tests_properties(test_abi PROPERTIES LABELS integration TIMEOUT 60
                     ENVIRONMENT "${_sh_lib_env}")
add_test(NAME test_install_examples COMMAND ${CMAKE_SOURCE_DIR}/scripts/check-examples.sh
                                            ${CMAKE_BINARY_DIR})
set_tests_properties(test_install_examples PROPERTIES LABELS integration TIMEOUT 600
                     SKIP_RETURN_CODE 77 ENVIRONMENT "CC=${CMAKE_C_COMPILER};SH_SAN_FLAGS=${_sh_san}")
