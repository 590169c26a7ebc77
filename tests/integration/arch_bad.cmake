# Broken gemma3 and qwen3 files (a tensor or key left out, wrong shapes, unsupported keys) through
# `shoal run` and `shoal serve`: exit code 2 and one `error:` line naming it. Needs the gguf
# package (scripts/test-venv.sh) to write the variants; 77 without it.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_arch_bad
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_arch_bad.py
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_arch_bad PROPERTIES LABELS integration TIMEOUT 180 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
