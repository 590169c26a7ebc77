# The gateway's OpenAI layer: request validation, response builders, stop strings, API keys.
sh_test(test_openai SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_openai.c LABELS unit TIMEOUT 20)
sh_test(test_stopstr SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_stopstr.c LABELS unit TIMEOUT 20)
# POST /v1/embeddings' codec: inputs, errors naming the field and input, float and base64 answers.
sh_test(test_openai_embed SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_openai_embed.c LABELS unit TIMEOUT 20)
# Tool calls: request fields, rendering per model family, output parsing (whole and streamed),
# the forcing grammars against the grammar engine.
sh_test(test_openai_tools SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_openai_tools.c LABELS unit
        TIMEOUT 20)
# POST /v1/responses' codec: input items into the chat request, 400s naming Responses fields, the
# response object and the stream's typed events.
sh_test(test_openai_responses SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_openai_responses.c
        LABELS unit TIMEOUT 20)
