# Issue 11's bad input against real processes: every case exits 2 with one error line naming the
# culprit (test_cluster_bad.py), and a front and a worker on separate "hosts" over tcp:// with the
# cluster key (test_cluster_hosts.py: network namespaces and a veth pair as root, else loopback
# addresses; skipped only when neither works), and a cluster over tls+tcp:// with certificates
# named in the script (test_cluster_tls.py).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
foreach(t test_cluster_bad test_cluster_hosts test_cluster_tls)
  add_test(NAME ${t} COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/${t}.py
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${t} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endforeach()
