sh_test(test_spec SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec.c LABELS unit TIMEOUT 60)
