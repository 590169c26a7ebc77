# The status page (issue 12, docs/cluster.md "The status page"): GET /admin/status's document and
# GET /admin/ on a single process (keys, drain) and under `shoal cluster up` with a worker killed
# (test_admin_status.py); the page in headless Chromium against a real cluster, a worker killed
# and healed, with a screenshot kept under Testing/status_page/ of the build (test_status_page.py,
# skipped with exit 77 when chromium is missing; scripts/bootstrap.sh installs it).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
foreach(t test_admin_status test_status_page)
  add_test(NAME ${t} COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/${t}.py
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${t} PROPERTIES LABELS integration TIMEOUT 240 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endforeach()
