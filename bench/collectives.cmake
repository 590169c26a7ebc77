# bench_collectives: latency and bus bandwidth of the tensor-parallel collectives per transport.
sh_bench(bench_collectives SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_collectives.c)
