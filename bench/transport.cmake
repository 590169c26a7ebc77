# bench_transport: ipc:// between two processes (rate, latency, GB/s) against a plain Unix socket.
sh_bench(bench_transport SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_transport.c)
