sh_test(test_llama2c SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama2c.c LABELS unit TIMEOUT 30)
