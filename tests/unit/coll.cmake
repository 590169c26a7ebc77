# Collectives of a tensor-parallel group: the shared-memory transport, in-process and across
# fork()ed processes.
sh_test(test_coll_shm SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_coll_shm.c LABELS unit TIMEOUT 30)
