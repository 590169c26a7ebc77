# bench_tokenizer: encode throughput of the SPM and BPE tokenizers (MB/s), one JSON line each.
add_executable(bench_tokenizer ${CMAKE_CURRENT_LIST_DIR}/bench_tokenizer.c)
target_compile_options(bench_tokenizer PRIVATE ${SH_WARN_FLAGS})
target_link_libraries(bench_tokenizer PRIVATE shoal_core)
