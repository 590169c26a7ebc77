# bench_tokenizer: encode throughput of the SPM and BPE tokenizers (MB/s), one JSON line each.
sh_bench(bench_tokenizer SOURCES ${CMAKE_CURRENT_LIST_DIR}/bench_tokenizer.c)
