sh_test(test_quant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant.c LABELS unit TIMEOUT 60)
