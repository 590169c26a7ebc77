# Per-node metrics of a cluster: the label merge, a registry rendered with other nodes' series
# (checked by a Prometheus text parser), the front's store refusing malformed reports, and a
# reporter and a collector exchanging real METRICS messages in one runtime.
sh_test(test_node_metrics SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_node_metrics.c LABELS unit
        TIMEOUT 30)
if(TARGET test_node_metrics)
  target_include_directories(test_node_metrics PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
endif()
