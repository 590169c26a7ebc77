# No heap allocation per token in the batcher, kvmgr and stage (real actors, real model).
sh_test(test_serve_noalloc SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_serve_noalloc.c
        LABELS integration TIMEOUT 240)
