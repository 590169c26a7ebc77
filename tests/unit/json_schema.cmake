# The JSON-schema → GBNF converter: exact output, cases through a reference matcher, refusals.
sh_test(test_json_schema SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_json_schema.c LABELS unit TIMEOUT 60)
# The same cases through the grammar engine, once model/grammar.h is in the tree.
if(EXISTS ${CMAKE_SOURCE_DIR}/model/grammar.h)
  sh_test(test_json_schema_accept SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_json_schema_accept.c
          LABELS unit TIMEOUT 60)
endif()
