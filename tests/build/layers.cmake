# The layering rule of docs/ARCHITECTURE.md ("kernels know no model, the model knows no runtime,
# the runtime knows no LLM"), checked on every quoted #include of base/, kernels/, model/,
# runtime/ and lua/ (test script beside this file).
if(SH_FUZZ)
  return()
endif()
add_test(NAME test_layers COMMAND ${CMAKE_CURRENT_LIST_DIR}/test_layers.sh)
set_tests_properties(test_layers PROPERTIES LABELS unit TIMEOUT 60
                     ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
