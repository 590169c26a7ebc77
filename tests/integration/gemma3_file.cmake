# The real Gemma 3 270M Q4_K_M file (scripts/get-model.sh gemma3-270m) through the real binary:
# inspect reads it, and run/serve either run it or refuse it with one clean error line, never a
# crash. Exit 77 (the model is not fetched, as in CI by default) is a skip.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
add_test(NAME test_gemma3_file COMMAND ${CMAKE_CURRENT_LIST_DIR}/test_gemma3_file.sh
         WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
set_tests_properties(test_gemma3_file PROPERTIES LABELS integration TIMEOUT 120 SKIP_RETURN_CODE 77
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
