sh_test(test_chat SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_chat.c LABELS unit TIMEOUT 10)
