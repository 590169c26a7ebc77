sh_test(test_tokenizer_vocab SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_vocab.c LABELS unit
        TIMEOUT 60)
sh_test(test_tokenizer SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.c LABELS unit TIMEOUT 120)
sh_test(test_tokenizer_model SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_model.c LABELS unit
        TIMEOUT 60)
sh_test(test_tokenizer_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_cli.c LABELS unit
        TIMEOUT 60)
