sh_test(test_mkmodel SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mkmodel.c LABELS unit TIMEOUT 120)
sh_test(test_mkmodel_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mkmodel_cli.c LABELS unit TIMEOUT 120)
sh_test(test_mkmodel_arch SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_mkmodel_arch.c LABELS unit TIMEOUT 120)
# The NumPy reference (tests/reference/ref_forward.py) on a small mkmodel model of every
# architecture, the committed synthetic golden data against its models, and llama.cpp's greedy
# text when SH_LLAMA_CPP_BIN names a llama.cpp build/bin (Python from scripts/test-venv.sh's venv
# via run_py.sh; exit 77, a skip, when numpy or gguf cannot be imported).
if(NOT SH_FUZZ)
  add_test(NAME test_mkmodel_ref
           COMMAND ${CMAKE_SOURCE_DIR}/tests/integration/run_py.sh
                   ${CMAKE_SOURCE_DIR}/tests/reference/test_ref_synth.py $<TARGET_FILE:shoal>
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_mkmodel_ref PROPERTIES LABELS unit TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
endif()
