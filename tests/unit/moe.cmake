# The CPU backend's Mixture-of-Experts FFN (kernels/cpu/moe.c): routing and outputs against a
# double-precision reference on every ISA, batching and thread counts bit-exact, bad arguments.
sh_test(test_moe SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_moe.c LABELS unit TIMEOUT 600)
