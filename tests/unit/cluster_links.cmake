# How a cluster script's tensor-parallel group links (actors/cluster.c): shared memory, the network
# or two levels, and each rank's host.
sh_test(test_cluster_links SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cluster_links.c LABELS unit
        TIMEOUT 30)
