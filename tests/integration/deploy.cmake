# Deployment (issue 29, docs/deploy.md): node identity from the environment (--name-from,
# SHOAL_NODE), against real processes of a 2-stage pipeline of the default model.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_deploy_identity
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_deploy_identity.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_deploy_identity PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
# The systemd units of examples/deploy/systemd/ through `systemd-analyze verify` (77 without it),
# and systemd's notifications (READY, WATCHDOG, STOPPING) from real nodes and front to real
# NOTIFY_SOCKET datagram sockets.
add_test(NAME test_deploy_units
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_deploy_systemd.py units
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_deploy_units PROPERTIES LABELS integration TIMEOUT 120 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
add_test(NAME test_deploy_sdnotify
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_deploy_systemd.py notify
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_deploy_sdnotify PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
# Host names in a script's addresses, resolved through a hosts file in a network namespace of the
# test's own (unshare -n -m; 77 where that is not permitted): DNS not ready at start, a worker
# restarted at another address, a name that never resolves.
add_test(NAME test_deploy_dns
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_deploy_dns.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_deploy_dns PROPERTIES LABELS integration TIMEOUT 400 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
