# Matmul and embed for Q5_0/Q5_1 and the K-quants (kernels/cpu/ops_k_ref.c and the ISA tables):
# every ISA against a float reference, fused mixed types, threads; the Gemma file's real tensors
# (skipped, 77, without models/gemma3-270m-q4_k_m.gguf).
# (7 s of CPU for the types case under ASan; the timeouts leave room for a loaded machine)
sh_test(test_kernels_kq SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_kq.c ARGS types LABELS unit
        TIMEOUT 300)
if(NOT SH_FUZZ)
  foreach(case threads fused embed refused gemma)
    add_test(NAME test_kernels_kq_${case} COMMAND test_kernels_kq ${case}
             WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
    set_tests_properties(test_kernels_kq_${case} PROPERTIES LABELS unit TIMEOUT 300
                         SKIP_RETURN_CODE 77 ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  endforeach()
endif()
