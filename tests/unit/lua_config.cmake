# The Lua host: cluster configs and the sandbox, degradation policies, fault scenarios.
sh_test(test_lua_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lua_config.c LABELS unit TIMEOUT 30)
sh_test(test_lua_policy SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lua_policy.c LABELS unit TIMEOUT 30)
sh_test(test_lua_scenario SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_lua_scenario.c LABELS unit
        TIMEOUT 30)
