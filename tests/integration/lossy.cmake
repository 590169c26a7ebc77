# Lossy and corrupting links (issue 12, docs/cluster.md "Lossy and corrupting links"): a 2-stage
# stories260K cluster under 1% drop with 50 ms delay, 0.1% corrupted and 5% duplicated frames,
# 200 greedy requests each, every output equal to a clean run's (test_cluster_lossy.py).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_lossy
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_lossy.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_lossy PROPERTIES LABELS "integration;chaos" TIMEOUT 600
                     SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
