# The router in front of 2 replicas, against real processes: a replica slowed by a fault-layer
# delay gets under a third of new requests, queued requests are re-dispatched and finish, prefix
# affinity keeps shared 1k-token prefixes cached (hit ratio >= 80%, clearly above without it).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_router
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_router.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_router PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
