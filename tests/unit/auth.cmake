sh_test(test_auth SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_auth.c LABELS unit TIMEOUT 10)
