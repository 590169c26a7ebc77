# bench_msg: wire codec speed: encode and decode of a small message and of 1 MiB / 8 MiB ACT frames.
sh_bench(bench_msg SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_msg.c)
