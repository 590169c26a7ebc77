# The OpenAI request parser and response builders (what an HTTP client reaches first), seeded
# with valid requests of both endpoints.
sh_fuzz(fuzz_openai SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_openai.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/openai)
