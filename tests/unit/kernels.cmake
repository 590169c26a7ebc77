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
# The tiled online-softmax attention of each ISA against a dense reference, and bitwise equal
# however rows are cut into calls (kernels/cpu/attn_tiled.h); an ISA the CPU lacks skips (77).
sh_test(test_attn_tiled SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_attn_tiled.c ARGS scalar LABELS unit
        TIMEOUT 300)
if(NOT SH_FUZZ)
  foreach(isa avx2 avx512)
    add_test(NAME test_attn_tiled_${isa} COMMAND test_attn_tiled ${isa}
             WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
    set_tests_properties(test_attn_tiled_${isa} PROPERTIES LABELS unit TIMEOUT 300
                         SKIP_RETURN_CODE 77)
  endforeach()
endif()
# The AMX-INT8 forms of the packed kernels: bitwise equal to the VNNI forms, and through the
# backend against the scalar reference; skipped (77) without AMX or the OS's tile permission.
sh_test(test_kernels_amx SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_amx.c LABELS unit
        TIMEOUT 300)
if(NOT SH_FUZZ)
  set_tests_properties(test_kernels_amx PROPERTIES SKIP_RETURN_CODE 77)
endif()
# The AVX2 packed Q4_0/Q4_1 kernels against the scalar reference, matvec and tiles bitwise alike;
# skipped (77) without AVX2. Its vs_ref case alone takes about 2 minutes in the ASan build on the
# 2-vCPU AVX2 VM (the scalar reference on every shape); beside other tests and jobs it passed 300 s
# once, hence 900.
sh_test(test_kernels_avx2_packed SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_avx2_packed.c
        LABELS unit TIMEOUT 900)
