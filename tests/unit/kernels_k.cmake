# The K-quant dot products (kernels/cpu/ops_k_*.c): the scalar reference against the dequantized
# float dot product, and the AVX2 kernels against the reference (skipped without AVX2).
sh_test(test_kernels_k SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_k.c ARGS ref LABELS unit
        TIMEOUT 60)
if(NOT SH_FUZZ)
  add_test(NAME test_kernels_k_avx2 COMMAND test_kernels_k avx2
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_kernels_k_avx2 PROPERTIES LABELS unit TIMEOUT 60 SKIP_RETURN_CODE 77)
  add_test(NAME test_kernels_k_avx512 COMMAND test_kernels_k avx512
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_kernels_k_avx512 PROPERTIES LABELS unit TIMEOUT 60
                       SKIP_RETURN_CODE 77)
endif()
