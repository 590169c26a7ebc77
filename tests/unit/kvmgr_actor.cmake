# The kvmgr actor in a real runtime: KV_ALLOC / KV_FORK / KV_FREE replies, metrics, bad input.
# --wrap counts the heap allocations made on the kvmgr's loop thread (steady state: 0).
sh_test(test_kvmgr_actor SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kvmgr_actor.c LABELS unit
        TIMEOUT 60 LIBS -Wl,--wrap=malloc -Wl,--wrap=calloc -Wl,--wrap=realloc)
