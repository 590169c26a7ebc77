sh_test(test_grammar SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_grammar.c LABELS unit TIMEOUT 60)
