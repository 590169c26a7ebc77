# RoPE scaling (linear, YaRN, Llama 3 rope_freqs, Phi-3 long rope) and phi3's fused tensors on
# tiny mkmodel files against the NumPy reference; bad rope metadata and factor tensors.
sh_test(test_llama_rope SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_llama_rope.c LABELS golden
        TIMEOUT 120)
