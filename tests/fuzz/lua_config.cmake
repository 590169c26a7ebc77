# Arbitrary text as a cluster script, a scenario and a policy under tight limits; seeded with the
# shipped examples.
sh_fuzz(fuzz_lua_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_lua_config.c SECONDS 20
        CORPUS ${CMAKE_SOURCE_DIR}/lua/examples)
