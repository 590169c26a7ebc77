# The K-quants' scalar reference (kernels/cpu/quant_k.c): round trips, refusals and known blocks
# in C, and against the PyPI gguf package's NumPy dequantizer through quant_k_tool (Python from
# scripts/test-venv.sh's venv via run_py.sh; exit 77, a skip, only when gguf cannot be imported).
sh_test(test_quant_k SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant_k.c LABELS unit TIMEOUT 60)
# Q5_0 / Q5_1 (kernels/cpu/quant.c), compared with gguf by the same script below.
sh_test(test_quant_q5 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant_q5.c LABELS unit TIMEOUT 60)

if(NOT SH_FUZZ)
  add_executable(quant_k_tool ${CMAKE_CURRENT_LIST_DIR}/quant_k_tool.c)
  target_compile_options(quant_k_tool PRIVATE ${SH_WARN_FLAGS})
  target_link_libraries(quant_k_tool PRIVATE shoal_core)
  add_test(NAME test_quant_k_gguf
           COMMAND ${CMAKE_SOURCE_DIR}/tests/integration/run_py.sh
                   ${CMAKE_CURRENT_LIST_DIR}/test_quant_k_gguf.py $<TARGET_FILE:quant_k_tool>
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_quant_k_gguf PROPERTIES LABELS unit TIMEOUT 120 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
endif()
