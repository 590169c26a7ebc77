# The degradation ladder against real processes (docs/serving.md, "Degradation"): one
# `shoal serve -m` driven level by level through its policy (effects, hysteresis, bad policies,
# reloads), and a cluster front whose policy follows real load up to level 4 and back down
# (fallback model included). Python runs through run_py.sh. Exit 77 (no model) is a skip.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
foreach(t test_serve_degrade test_cluster_degrade)
  add_test(NAME ${t} COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/${t}.py
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${t} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endforeach()
