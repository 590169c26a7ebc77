# The JSON-schema → GBNF converter (response_format's schema), seeded with schemas of each kind the
# converter covers and some it refuses.
sh_fuzz(fuzz_json_schema SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_json_schema.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/json_schema)
