# The model seeds of fuzz_gguf's corpus (tests/fuzz/corpus/gguf): each architecture's tiny file
# loads and runs, each K-quant file holds whole blocks, each broken file is refused naming the
# culprit (by the loader and by `shoal run`).
sh_test(test_llama_seeds SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_seeds.c LABELS unit
        TIMEOUT 60)
