# Speculative decoding's model drafters (model/spec_draft.h) and the forward pass's early exit on
# stories260K: the head after layer L against a reference, drafting, cache rollback, refusals.
sh_test(test_spec_draft SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec_draft.c LABELS golden
        TIMEOUT 60)
# The batched drafter of serving (model/spec_draft_batch.h) against the one-sequence drafter.
sh_test(test_spec_draft_batch SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec_draft_batch.c
        LABELS golden TIMEOUT 120)
