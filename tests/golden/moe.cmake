# Mixture-of-experts models (mixtral-style llama, qwen2moe, qwen3moe, olmoe) on the tiny mkmodel
# files against the NumPy reference: logits, greedy ids, routing; batching, pipeline stages and
# bad files.
sh_test(test_llama_moe SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_moe.c LABELS golden
        TIMEOUT 120)
