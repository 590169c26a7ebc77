sh_test(test_gguf_write SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf_write.c LABELS unit TIMEOUT 60)
