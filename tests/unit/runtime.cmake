# Actor runtime: loops, actors, mailboxes, sessions, timers, stall detector, logs and metrics.
sh_test(test_runtime SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_runtime.c LABELS unit TIMEOUT 60)
sh_test(test_runtime_session SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_runtime_session.c
        LABELS unit TIMEOUT 60)
sh_test(test_metrics SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_metrics.c LABELS unit TIMEOUT 10)
sh_test(test_log SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_log.c LABELS unit TIMEOUT 10)
