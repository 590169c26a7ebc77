# bench_grammar: JSON-grammar mask cost per decode step (p50/p99) on the default model's and Gemma
# 3's vocabularies, one JSON line each.
sh_bench(bench_grammar SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_grammar.c)
# bench_step_grammar: STEP frame bytes for 12 sequences under 12 JSON-schema grammars, with the
# grammar text sent every step against only on a sequence's first step (its hash afterwards).
sh_bench(bench_step_grammar SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_step_grammar.c)
