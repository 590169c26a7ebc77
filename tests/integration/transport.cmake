# The transport between real processes over ipc:// and tcp://127.0.0.1: ping-pong, a dead peer,
# reconnection after a restart. The test starts shoal_test_node children.
if(NOT SH_FUZZ)
  add_executable(shoal_test_node ${CMAKE_CURRENT_LIST_DIR}/transport_node.c)
  target_compile_options(shoal_test_node PRIVATE ${SH_WARN_FLAGS})
  target_link_libraries(shoal_test_node PRIVATE shoal_core)
endif()
sh_test(test_transport_proc SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_proc.c
        LABELS integration TIMEOUT 120 ARGS)
if(TARGET test_transport_proc)
  target_include_directories(test_transport_proc PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
  target_compile_definitions(test_transport_proc PRIVATE
                             SH_TEST_NODE="$<TARGET_FILE:shoal_test_node>")
  add_dependencies(test_transport_proc shoal_test_node)
endif()
# The chaos soak (label chaos): skips unless SH_SOAK_SECONDS is set; `make soak` runs it.
sh_test(test_transport_soak SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_soak.c
        LABELS chaos TIMEOUT 3600)
if(TARGET test_transport_soak)
  target_include_directories(test_transport_soak PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
  target_compile_definitions(test_transport_soak PRIVATE
                             SH_TEST_NODE="$<TARGET_FILE:shoal_test_node>")
  add_dependencies(test_transport_soak shoal_test_node)
endif()
