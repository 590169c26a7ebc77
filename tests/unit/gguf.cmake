sh_test(test_gguf SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf.c LABELS unit TIMEOUT 60)
sh_test(test_gguf_corrupt SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_gguf_corrupt.c LABELS unit
        TIMEOUT 300)
sh_test(test_inspect_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_inspect_cli.c LABELS unit
        TIMEOUT 120)
