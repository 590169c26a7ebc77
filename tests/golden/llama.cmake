# Golden tests of the Llama forward pass: stories260K against llama2.c's recorded ids, SmolLM2
# against the NumPy reference (tests/reference), and the `shoal run` command end to end.
sh_test(test_llama_stories SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_stories.c
        LABELS golden TIMEOUT 120)
sh_test(test_llama_smollm SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_smollm.c
        LABELS golden TIMEOUT 300)
sh_test(test_llama_qwen2 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_qwen2.c
        LABELS golden TIMEOUT 60)
sh_test(test_llama_load SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_load.c LABELS unit
        TIMEOUT 30)
# No allocation per decoded token after warm-up (counts malloc through the whole process; skips
# under the sanitizers, which own the allocator).
sh_test(test_llama_noalloc SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_noalloc.c LABELS golden
        TIMEOUT 120)
# Sliding-window attention through the forward pass on synthetic mkmodel files.
sh_test(test_llama_window SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_window.c LABELS golden
        TIMEOUT 60)
# K-quant and Q5 weights (Q4_K, Q6_K and a mix of eight types) on synthetic mkmodel files against
# the NumPy reference's logits and greedy ids.
sh_test(test_llama_kquant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_kquant.c LABELS golden
        TIMEOUT 300)
# IQ4_NL and IQ4_XS: a seeded mkmodel file quantized to each, against its dequantized F32 copy
# (logits and greedy ids).
sh_test(test_llama_iq4 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_iq4.c LABELS golden
        TIMEOUT 120)
# gemma3 and qwen3 on tiny mkmodel files against the NumPy reference; stages, batching, windows.
sh_test(test_llama_arch SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_arch.c LABELS golden
        TIMEOUT 120)
