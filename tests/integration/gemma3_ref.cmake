# Shoal against llama.cpp on the real Gemma 3 270M Q4_K_M file (tests/data/gemma3/, made by
# tests/reference/llamacpp_ref.c): test_gemma3_tokens checks `shoal tokenize` on each prompt
# against llama.cpp's ids; test_gemma3_ref checks 16 greedy tokens per prompt (equal, or first
# diverging at a near-tie); test_gemma3_chat checks chat-formatted prompts' ids and that
# `shoal run --chat` prints what greedy decoding of those ids gives. All skip (77) only without the
# model (scripts/get-model.sh gemma3-270m).
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()
foreach(part tokens ref chat)
  set(arg ${part})
  if(part STREQUAL "ref")
    set(arg greedy)
  endif()
  add_test(NAME test_gemma3_${part}
           COMMAND ${CMAKE_CURRENT_LIST_DIR}/run_py.sh ${CMAKE_CURRENT_LIST_DIR}/test_gemma3_ref.py ${arg}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_gemma3_${part} PROPERTIES LABELS integration TIMEOUT 300
                       SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endforeach()
