# bench_model_shapes: decode and prefill matmul sequences of whole model shapes on synthetic weights.
sh_bench(bench_model_shapes SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_model_shapes.c)
