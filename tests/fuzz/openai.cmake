# The OpenAI request parser and response builders (what an HTTP client reaches first), seeded
# with valid requests of both endpoints.
sh_fuzz(fuzz_openai SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_openai.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/openai)
# POST /v1/responses: the request rewritten as chat, and the response object and events built from
# it, seeded with a plain request, a tool round trip and a JSON schema.
sh_fuzz(fuzz_openai_responses SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_openai_responses.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/openai_responses)
