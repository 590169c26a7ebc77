# test_lua_module: the Lua module of api/lua/ (the target shoal_lua) as a host's Lua sees it.
# The system lua5.4 runs test_shoal_lua.lua with the built module against the
# real stories260K model. Skipped (77) without the interpreter (scripts/bootstrap.sh installs it)
# and in sanitizer builds, whose module would need the sanitizer runtime loaded before lua5.4.
find_program(SH_LUA_INTERP lua5.4)
set(_sh_lua_model ${CMAKE_SOURCE_DIR}/tests/data/stories260K/stories260K.gguf)
set(_sh_lua_ids ${CMAKE_SOURCE_DIR}/tests/data/stories260K/expected_ids_bos_256.txt)
if(NOT TARGET shoal_lua)
  return()
endif()
if(SH_LUA_INTERP AND NOT SH_SAN_FLAGS)
  add_test(NAME test_lua_module
           COMMAND ${SH_LUA_INTERP} ${CMAKE_SOURCE_DIR}/api/lua/test_shoal_lua.lua ${_sh_lua_model}
                   ${_sh_lua_ids}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_lua_module PROPERTIES
                       ENVIRONMENT "LUA_CPATH=$<TARGET_FILE_DIR:shoal_lua>/?.so;LUA_PATH="
                       REQUIRED_FILES $<TARGET_FILE:shoal_lua>)
else()
  if(SH_SAN_FLAGS)
    set(_sh_lua_why "sanitizer build")
  else()
    set(_sh_lua_why "lua5.4 is not installed (scripts/bootstrap.sh)")
  endif()
  add_test(NAME test_lua_module COMMAND sh -c "echo 'skipped: ${_sh_lua_why}'; exit 77")
  set_tests_properties(test_lua_module PROPERTIES SKIP_RETURN_CODE 77)
endif()
set_tests_properties(test_lua_module PROPERTIES LABELS integration TIMEOUT 120)
