# Mixture-of-experts models served end to end: batched completions equal each alone, the
# per-expert load counters, and a 2-stage pipeline equal to one process (sh_serve_test is
# defined in serve.cmake, included before this file).
if(SH_FUZZ)
  return()
endif()
sh_serve_test(test_serve_moe ${CMAKE_CURRENT_LIST_DIR}/run_py.sh
              ${CMAKE_CURRENT_LIST_DIR}/test_serve_moe.py)
