# Issue 25's hostile peers against a keyed cluster of real processes over tcp:// (test_cluster_forged.py):
# frames whose src claims another node (CONTROL SHUTDOWN as the front, METRICS as a worker, STEP
# with epoch 2^64-1) are refused and counted while the cluster keeps serving equal outputs. The
# forged frames come from shoal_test_forge (forge_node.c), an outsider that can merely connect.
if(SH_FUZZ)
  return()
endif()
add_executable(shoal_test_forge ${CMAKE_CURRENT_LIST_DIR}/forge_node.c)
target_compile_options(shoal_test_forge PRIVATE ${SH_WARN_FLAGS})
target_include_directories(shoal_test_forge PRIVATE ${CMAKE_SOURCE_DIR})
target_link_libraries(shoal_test_forge PRIVATE shoal_core)
add_test(NAME test_cluster_forged
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_forged.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_forged PROPERTIES LABELS integration TIMEOUT 300
                     SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>;SH_TEST_FORGE=$<TARGET_FILE:shoal_test_forge>")
# Connections that never prove a node: half frames and idle connections (test_cluster_preauth.py).
add_test(NAME test_cluster_preauth
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_preauth.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_preauth PROPERTIES LABELS integration TIMEOUT 300
                     SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
