# `shoal bench` end to end: option errors, a refused port, and runs against an OpenAI-compatible
# responder inside the test (streamed, whole, chat, failures, timeouts).
sh_test(test_bench_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_cli.c LABELS integration
        TIMEOUT 120)
