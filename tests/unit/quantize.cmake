# `shoal quantize` (model/quantize.c, tools/cmd_quantize.c). test_quantize: the tensor rules, the
# tensor data against llama-quantize's (sha256s recorded in tests/data/quantize/ by make_hashes.sh
# there; llama.cpp is not needed to run it), round trips, --keep, threads, metadata, refusals.
# test_quantize_cli: the command as a process: bad input, leftovers, `shoal run` on the results.
sh_test(test_quantize SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quantize.c LABELS unit TIMEOUT 900)
if(TARGET test_quantize)
  target_include_directories(test_quantize PRIVATE ${MBEDTLS_INCLUDE_DIR})
endif()
sh_test(test_quantize_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quantize_cli.c LABELS unit
        TIMEOUT 300)
