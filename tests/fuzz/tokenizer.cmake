# Seeded with the round-trip corpus; runs from the source tree so the vocabularies are found.
sh_fuzz(fuzz_tokenizer SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_tokenizer.c SECONDS 30
        CORPUS ${CMAKE_SOURCE_DIR}/tests/data/tokenizer)
