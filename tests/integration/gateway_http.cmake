# The gateway's HTTP server against real clients (curl and raw sockets) on 127.0.0.1.
sh_test(test_http SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_http.c LABELS integration TIMEOUT 60)
