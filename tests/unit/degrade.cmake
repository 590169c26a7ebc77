# The degradation ladder (actors/degrade.h) in a real runtime: hysteresis, the registry's metrics,
# bad policies, reloads, the effects on requests and the ticking actor.
sh_test(test_degrade SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_degrade.c LABELS unit TIMEOUT 60)
if(TARGET test_degrade)
  target_include_directories(test_degrade PRIVATE ${CMAKE_SOURCE_DIR}/tests/unit)
endif()
