# The GBNF parser and matcher (the `grammar` request field reaches them first), seeded with the
# unit tests' grammars, each with a sample text after a NUL.
sh_fuzz(fuzz_gbnf SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_gbnf.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/gbnf)
