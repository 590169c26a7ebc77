# One copy of the weights: the file mapping's pages of repacked matrices are dropped at load.
sh_test(test_llama_weights SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_weights.c LABELS unit
        TIMEOUT 60)
