# The stage actor with the default model: batched STEPs give the tokens of each sequence run
# alone; bad steps answer a status; shutdown frees queued steps. Skips without the model.
# --wrap counts heap allocations during decode steps (none after a sequence's first sample).
sh_test(test_stage_actor SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stage_actor.c LABELS integration
        TIMEOUT 300 LIBS -Wl,--wrap=malloc -Wl,--wrap=calloc -Wl,--wrap=realloc)
