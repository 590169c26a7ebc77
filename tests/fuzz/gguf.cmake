sh_fuzz(fuzz_gguf SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_gguf.c SECONDS 30
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/gguf)
