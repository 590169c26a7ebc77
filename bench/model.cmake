# bench_model: prefill (ppN) and decode (tgN) tokens/s of a GGUF model through the forward pass.
sh_bench(bench_model SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_model.c)
