# Build robustness: configuring this tree with Debian's unpatched FindCUDAToolkit (test script
# beside this file). Two real configures in fresh folders; skips (77) without nvcc.
if(SH_FUZZ)
  return()
endif()
add_test(NAME test_cmake_cuda COMMAND ${CMAKE_CURRENT_LIST_DIR}/test_cmake_cuda.sh)
set_tests_properties(test_cmake_cuda PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
