# Pipeline stages in one process: 2 and 3 stage actors joined by ACT give the single-stage stage's
# greedy tokens for stories260K and the default model; failures on any stage reach the batcher
# as a failed STEP_DONE. Skips without either model. --wrap counts heap allocations during
# decode steps through a pipeline (none expected).
sh_test(test_stage_pipeline SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stage_pipeline.c
        LABELS integration TIMEOUT 300 LIBS -Wl,--wrap=malloc -Wl,--wrap=calloc
        -Wl,--wrap=realloc)
