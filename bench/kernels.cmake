# bench_kernels: memory bandwidth, decode matvec GB/s and prefill matmul GFLOP/s of the CPU backend.
sh_bench(bench_kernels SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c)
