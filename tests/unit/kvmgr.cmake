# The KV manager's block logic. --wrap lets the test count every heap allocation (steady state: 0).
sh_test(test_kvmgr SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kvmgr.c LABELS unit TIMEOUT 30
        LIBS -Wl,--wrap=malloc -Wl,--wrap=calloc -Wl,--wrap=realloc)
