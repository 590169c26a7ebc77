# The watchdog against real processes: a worker stopped (SIGSTOP), cut off (a fault-scenario
# partition) and killed and restarted, under load: detected, resumed, every output equal.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_cluster_watchdog
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_cluster_watchdog.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_cluster_watchdog PROPERTIES LABELS integration TIMEOUT 180 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
