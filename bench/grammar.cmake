# bench_grammar: JSON-grammar mask cost per decode step (p50/p99) on the default model's and Gemma
# 3's vocabularies, one JSON line each.
sh_bench(bench_grammar SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_grammar.c)
