# The batcher with real stages (stories260K in 2 stage actors, a kvmgr, one runtime): METRICS
# reports to a router and metric labels, CANCEL withdraw, pipelining (max_inflight 2 gives
# max_inflight 1's greedy tokens with two steps really in flight) and a step timeout with two steps
# in flight. Skips without the model.
sh_test(test_batcher_pipeline SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_batcher_pipeline.c
        LABELS integration TIMEOUT 300)
if(TARGET test_batcher_pipeline)
  target_include_directories(test_batcher_pipeline PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
endif()
