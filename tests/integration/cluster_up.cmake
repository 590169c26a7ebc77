# `shoal cluster up` against real processes: a 2-stage stories260K pipeline over ipc:// started,
# supervised (kill -9 of a worker restarts the cluster), stopped by SIGTERM with no process left;
# a node that keeps failing, kill -9 of the supervisor, a non-local URL (exit 2).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_up
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_up.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_up PROPERTIES LABELS integration TIMEOUT 180 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
