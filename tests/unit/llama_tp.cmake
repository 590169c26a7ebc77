# Tensor parallelism of the model (model/llama_tp.c): ranks as threads over the in-process
# shared-memory collective against the whole model (stories260K, SmolLM2 Q4_1, mkmodel gemma3 and
# qwen2moe), splits that are refused, and the load and context checks.
sh_test(test_llama_tp SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_tp.c LABELS unit TIMEOUT 120)
# A rank whose peer leaves: the forward's stream-ordered all-reduce fails with the layer and the
# collective's message, quickly and again on the next call.
sh_test(test_llama_tp_peer SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_tp_peer.c LABELS unit TIMEOUT 120)
