# The two-level collectives (runtime/coll_hier.c): ranks as fork()ed processes on pseudo-hosts.
sh_test(test_coll_hier SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_coll_hier.c LABELS unit TIMEOUT 90)
