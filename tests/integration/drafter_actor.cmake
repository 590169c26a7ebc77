# The drafter actor before a stage actor on stories260K: drafts appended to STEPs are verified
# into the greedy tokens (a draft of itself has all accepted), joins with and without prior.
sh_test(test_drafter_actor SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_drafter_actor.c
        LABELS integration TIMEOUT 120)
