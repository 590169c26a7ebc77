# Every node's series on the front's /metrics: a 2-stage stories260K cluster over ipc:// (real
# `shoal node` and `shoal serve -c` processes); the exposition parsed strictly, the first stage's
# ACT bytes growing with completions, the report age of a stopped worker growing.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_metrics
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_metrics.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_metrics PROPERTIES LABELS integration TIMEOUT 180
                     SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
