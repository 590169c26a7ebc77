# Tensor-parallel groups in cluster scripts against real processes (issue 26,
# test_cluster_tp.py): bad input to a group exits 2 with one error line naming the culprit.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_tp
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_tp.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_tp PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
# test_cluster_tp_eq.py: equality on the shapes test_cluster_tp.py does not cover (3 ranks, the
# network collective over tcp://, an MoE file, Gemma 3 270M when present, n-gram speculative
# decoding in a group).
add_test(NAME test_cluster_tp_eq
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_tp_eq.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_tp_eq PROPERTIES LABELS integration TIMEOUT 120 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
# test_cluster_tp_hier.py: one stage of 4 ranks over 2 pseudo-hosts (127.0.0.1 and 127.0.0.2)
# linked over two levels (tp_link = "hier"), and the same nodes with "auto".
add_test(NAME test_cluster_tp_hier
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_tp_hier.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_tp_hier PROPERTIES LABELS integration TIMEOUT 120 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
# test_cluster_tp_standby.py: a standby takes a killed rank's place (rank 1 and the leader, over
# shared memory and the network collective) under load, every output unchanged; a standby of
# another script is refused by name at its promotion.
add_test(NAME test_cluster_tp_standby
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_tp_standby.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_tp_standby PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
