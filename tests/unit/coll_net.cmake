# The network collectives (runtime/coll_net.c): ranks as fork()ed processes over ipc:// and tcp://.
sh_test(test_coll_net SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_coll_net.c LABELS unit TIMEOUT 60)
