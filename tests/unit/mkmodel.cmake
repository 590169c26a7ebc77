sh_test(test_mkmodel SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mkmodel.c LABELS unit TIMEOUT 120)
sh_test(test_mkmodel_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mkmodel_cli.c LABELS unit TIMEOUT 120)
