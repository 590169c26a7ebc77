sh_test(test_sampler SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sampler.c LABELS unit TIMEOUT 30)
