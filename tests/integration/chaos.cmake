# The chaos suite (issue 12; label `chaos`): `shoal chaos` runs each scenario of examples/chaos/
# against a real 2-stage stories260K cluster under `shoal cluster up`, at least 200 greedy
# requests each, and checks that none is lost and none differs from the undisturbed run
# (test_chaos.py; scenarios whose recovery is not built yet exit 77 with the reason unless
# SH_CHAOS_STRICT=1). test_chaos_engine_*: the same bar through the C API's cluster front
# (`shoal chaos --engine`: sh_engine_open in the chaos process, the workers under `cluster up
# --no-front`), for every scenario but attach (a front started by hand). test_chaos_bad: bad
# scenarios and flags are refused before anything starts.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
set(_sh_chaos_env
    "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
foreach(s kill-prefill kill-decode kill-twice kill-standby kill-replica stop-2s partition-2s
          drop-delay corrupt duplicate leak attach kill-rank stop-rank-2s drop-coll-1pct
          kill-leader-standby kill-decode-spec)
  string(REPLACE "-" "_" t "test_chaos_${s}")
  add_test(NAME ${t}
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_chaos.py ${s}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${t} PROPERTIES LABELS chaos TIMEOUT 180 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${_sh_chaos_env}")
endforeach()
foreach(s kill-prefill kill-decode kill-twice kill-standby kill-replica stop-2s partition-2s
          drop-delay corrupt duplicate leak kill-rank stop-rank-2s drop-coll-1pct
          kill-leader-standby kill-decode-spec)
  string(REPLACE "-" "_" t "test_chaos_engine_${s}")
  add_test(NAME ${t}
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_chaos.py ${s}
                   --engine
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${t} PROPERTIES LABELS chaos TIMEOUT 180 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${_sh_chaos_env}")
endforeach()
add_test(NAME test_chaos_bad
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_chaos_bad.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_chaos_bad PROPERTIES LABELS "chaos;integration" TIMEOUT 120
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${_sh_chaos_env}")
