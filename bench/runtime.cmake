# bench_runtime: actor-to-actor message rate and request/response latency within one node.
sh_bench(bench_runtime SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_runtime.c)
