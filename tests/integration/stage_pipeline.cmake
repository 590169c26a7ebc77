# Pipeline stages: 2 and 3 stage actors joined by ACT, in one process and in separate processes
# over ipc:// (stages in shoal_test_stage_node children), give the single-stage stage's greedy
# tokens for stories260K and the default model; failures on any stage reach the batcher as a
# failed STEP_DONE. Skips without either model. --wrap counts heap allocations during decode
# steps through a pipeline (none expected).
if(NOT SH_FUZZ)
  add_executable(shoal_test_stage_node ${CMAKE_CURRENT_LIST_DIR}/stage_node.c)
  target_compile_options(shoal_test_stage_node PRIVATE ${SH_WARN_FLAGS})
  target_link_libraries(shoal_test_stage_node PRIVATE shoal_core)
endif()
sh_test(test_stage_pipeline SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stage_pipeline.c
        LABELS integration TIMEOUT 300 LIBS -Wl,--wrap=malloc -Wl,--wrap=calloc
        -Wl,--wrap=realloc)
if(TARGET test_stage_pipeline)
  target_include_directories(test_stage_pipeline PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
  target_compile_definitions(test_stage_pipeline
                             PRIVATE SH_TEST_NODE="$<TARGET_FILE:shoal_test_stage_node>")
  add_dependencies(test_stage_pipeline shoal_test_stage_node)
endif()
