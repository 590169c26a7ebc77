# The K-quants' scalar reference (kernels/cpu/quant_k.c): round trips, refusals and known blocks.
sh_test(test_quant_k SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant_k.c LABELS unit TIMEOUT 60)
