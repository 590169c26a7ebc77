# CPU backend kernels: every fast path vs the scalar reference, attention, RoPE, the pool and queue.
sh_test(test_kernels SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels.c LABELS unit TIMEOUT 120)
sh_test(test_kernels_attn SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_attn.c LABELS unit
        TIMEOUT 60)
sh_test(test_pool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_pool.c LABELS unit TIMEOUT 60)
sh_test(test_kernels_packed SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_packed.c LABELS unit
        TIMEOUT 120)
# Gemma's ops: GEGLU (reference vs formula, SIMD vs reference, fused matmul), scale, soft-cap.
sh_test(test_kernels_gemma SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_gemma.c LABELS unit
        TIMEOUT 60)
