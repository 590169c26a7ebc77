# The transport between real processes over ipc:// and tcp://127.0.0.1: ping-pong, a dead peer,
# reconnection after a restart. The test starts shoal_test_node children.
if(NOT SH_FUZZ)
  add_executable(shoal_test_node ${CMAKE_CURRENT_LIST_DIR}/transport_node.c)
  target_compile_options(shoal_test_node PRIVATE ${SH_WARN_FLAGS})
  target_link_libraries(shoal_test_node PRIVATE shoal_core)
endif()
# A test that starts shoal_test_node children (tests/integration/test_proc_util.h).
function(sh_node_test name)
  sh_test(${name} SOURCES ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/${name}.c ${ARGN})
  if(TARGET ${name})
    target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
    target_compile_definitions(${name} PRIVATE SH_TEST_NODE="$<TARGET_FILE:shoal_test_node>")
    add_dependencies(${name} shoal_test_node)
  endif()
endfunction()

sh_node_test(test_transport_proc LABELS integration TIMEOUT 120)
# The chaos soak (label chaos): skips unless SH_SOAK_SECONDS is set; `make soak` runs it.
sh_node_test(test_transport_soak LABELS chaos TIMEOUT 3600)
