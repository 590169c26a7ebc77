# The network collectives over tls+tcp:// (runtime/coll_net.c): fork()ed ranks with certificates
# the test makes with the openssl CLI (skipped without it).
sh_test(test_coll_net_tls SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_coll_net_tls.c LABELS unit
        TIMEOUT 120)
