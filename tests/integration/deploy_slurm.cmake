# examples/deploy/slurm/ on a one-machine Slurm cluster the test configures (slurm-wlm): the
# 2-stage pipeline as one job step, greedy output equal to one process, scancel drains.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_deploy_slurm
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_deploy_slurm.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_deploy_slurm PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     RUN_SERIAL TRUE
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
